// kvstitch chat page: ask (SSE over fetch), sources, stats, history, ingest. No libraries, no build step.
(function () {
  "use strict";

  const KEY_STORAGE = "kvstitch.apiKey";
  const HISTORY_STORAGE = "kvstitch.history";
  const HISTORY_LIMIT = 12;
  const POLL_MS = 500;
  const POLL_MAX_FAILURES = 5;
  // In request order; every stage but decode is part of the time to first token (the server's `done` sends all).
  const TIMING_STAGES = ["retrieve", "queue", "load", "h2d", "precompute", "stitch", "prefill", "decode"];
  const TIERS = ["gpu", "host", "disk", "miss"];

  // ---------------------------------------------------------------- SSE parsing (WHATWG event-stream rules)

  /** Incremental text/event-stream parser: push() decoded text in any slices, end() at EOF. */
  class SSEParser {
    constructor(onEvent) {
      this.onEvent = onEvent;
      this.line = "";          // the unfinished line carried between pushes
      this.skipLF = false;     // the previous push ended in CR; a leading LF belongs to that line break
      this.type = "";
      this.data = [];
      this.lastId = "";
    }

    push(text) {
      let start = 0;
      if (this.skipLF && text.length > 0) {
        if (text[0] === "\n") start = 1;
        this.skipLF = false;
      }
      const breaks = /\r\n|\r|\n/g;
      breaks.lastIndex = start;
      let match;
      while ((match = breaks.exec(text)) !== null) {
        // a lone CR at the very end may be the first half of a CRLF split across pushes
        if (match[0] === "\r" && match.index === text.length - 1) this.skipLF = true;
        this.processLine(this.line + text.slice(start, match.index));
        this.line = "";
        start = breaks.lastIndex;
      }
      this.line += text.slice(start);
    }

    /** At EOF: a last line without a break and an event without its blank line are still delivered. */
    end() {
      if (this.line !== "") this.processLine(this.line);
      this.line = "";
      this.dispatch();
    }

    processLine(line) {
      if (line === "") { this.dispatch(); return; }
      if (line[0] === ":") return; // comment / keep-alive
      const colon = line.indexOf(":");
      const field = colon === -1 ? line : line.slice(0, colon);
      let value = colon === -1 ? "" : line.slice(colon + 1);
      if (value[0] === " ") value = value.slice(1);
      if (field === "event") this.type = value;
      else if (field === "data") this.data.push(value);
      else if (field === "id" && value.indexOf("\0") === -1) this.lastId = value;
      // "retry" and unknown fields are ignored
    }

    dispatch() {
      if (this.data.length > 0) {
        this.onEvent({ type: this.type || "message", data: this.data.join("\n"), id: this.lastId });
      }
      this.type = "";
      this.data = [];
    }
  }

  // ---------------------------------------------------------------- pure helpers

  /** Turns a FastAPI error body ({"detail": str | [{loc,msg}] | object}) into one readable line. */
  function describeDetail(body) {
    if (body === null || body === undefined) return "";
    const detail = typeof body === "object" && "detail" in body ? body.detail : body;
    if (typeof detail === "string") return detail;
    if (Array.isArray(detail)) {
      return detail.map(function (item) {
        if (item && typeof item === "object" && "msg" in item) {
          const loc = Array.isArray(item.loc) ? item.loc.filter(function (p) { return p !== "body"; }).join(".") : "";
          return loc ? loc + ": " + item.msg : String(item.msg);
        }
        return typeof item === "string" ? item : JSON.stringify(item);
      }).join("; ");
    }
    return JSON.stringify(detail);
  }

  /** Reads a non-2xx response into an Error with a message that names the status. */
  async function httpError(res) {
    let text = "";
    try { text = await res.text(); } catch (_) { /* body unreadable: the status line still says enough */ }
    let message = text.trim();
    try { message = describeDetail(JSON.parse(text)) || message; } catch (_) { /* not JSON */ }
    let prefix = "HTTP " + res.status + (res.statusText ? " " + res.statusText : "");
    if (res.status === 401) prefix += " — check the API key";
    const err = new Error(message ? prefix + ": " + message : prefix);
    err.status = res.status;
    return err;
  }

  /** fetch() and body reads reject with a bare TypeError when the network fails; name it for the reader. */
  function networkError(err, what) {
    if (err && err.name === "AbortError") return err;
    return new Error("Network error while " + what + ": " + ((err && err.message) || err) + " — is the server reachable?");
  }

  async function guarded(promise, what) {
    try { return await promise; } catch (err) { throw networkError(err, what); }
  }

  function describeFailure(err) {
    return (err && err.message) || String(err);
  }

  function isNum(x) { return typeof x === "number" && isFinite(x); }
  function fmtMs(x) { return isNum(x) ? (x >= 100 ? x.toFixed(0) : x.toFixed(1)) : "—"; }
  function fmtCount(x) { return isNum(x) ? String(x) : "—"; }
  function plural(n, noun) { return fmtCount(n) + " " + noun + (n === 1 ? "" : "s"); }

  function tierLine(kv) {
    if (!kv || typeof kv !== "object") return "KV tiers —";
    return "KV tiers: " + TIERS.map(function (t) { return t + " " + fmtCount(kv[t]); }).join(" · ");
  }

  function median(values) {
    if (values.length === 0) return NaN;
    const s = values.slice().sort(function (a, b) { return a - b; });
    const mid = s.length >> 1;
    return s.length % 2 ? s[mid] : (s[mid - 1] + s[mid]) / 2;
  }

  /** Reads an optional number input: "" → undefined; invalid → throws with the field's label. */
  function readNumber(input, label, opts) {
    const raw = input.value.trim();
    if (raw === "") {
      if (opts.required) throw new Error(label + " is required.");
      return undefined;
    }
    const n = Number(raw);
    if (!isFinite(n) || (opts.integer && !Number.isInteger(n))) {
      throw new Error(label + " must be " + (opts.integer ? "a whole number." : "a number."));
    }
    if (opts.min !== undefined && n < opts.min) throw new Error(label + " must be at least " + opts.min + ".");
    if (opts.max !== undefined && n > opts.max) throw new Error(label + " must be at most " + opts.max + ".");
    return n;
  }

  // ---------------------------------------------------------------- sources that link back

  /** The source's document URL (its metadata's `url`) when it is an absolute http(s) URL, else null. */
  function sourceLink(c) {
    const url = c && c.metadata && typeof c.metadata === "object" ? c.metadata.url : undefined;
    if (typeof url !== "string" || url.length > 2048) return null;
    let parsed;
    try {
      parsed = new URL(url);
    } catch (err) {
      return null;
    }
    return parsed.protocol === "http:" || parsed.protocol === "https:" ? parsed.href : null;
  }

  /** The source's document name: a link to its URL where it has one (text only, never markup), else plain text. */
  function sourceName(doc, c) {
    const href = sourceLink(c);
    const name = doc.createElement(href ? "a" : "span");
    name.className = "doc-id";
    const title = c.metadata && typeof c.metadata.title === "string" && c.metadata.title ? c.metadata.title : null;
    const id = c.doc_id === undefined || c.doc_id === null ? "(unknown document)" : String(c.doc_id);
    name.textContent = href && title ? title : id;
    if (href) {
      name.setAttribute("href", href);
      name.setAttribute("target", "_blank");
      name.setAttribute("rel", "noopener noreferrer");
      name.setAttribute("title", id);
    }
    return name;
  }

  // ---------------------------------------------------------------- page

  function init() {
    const $ = function (id) { return document.getElementById(id); };
    const el = {
      apiKey: $("api-key"),
      askForm: $("ask-form"), question: $("question"), ask: $("ask"), stop: $("stop"), status: $("status"),
      newConversation: $("new-conversation"), conversation: $("conversation"),
      mode: $("mode"), positions: $("positions"), topK: $("top-k"), maxNewTokens: $("max-new-tokens"),
      temperature: $("temperature"), topP: $("top-p"), seed: $("seed"),
      answer: $("answer"), ttft: $("ttft"), ttftClient: $("ttft-client"), outputTokens: $("output-tokens"),
      tiers: $("tiers"), timings: $("timings"), sources: $("sources"), sourcesEmpty: $("sources-empty"),
      history: $("history"), historySummary: $("history-summary"), historyClear: $("history-clear"),
      ingestForm: $("ingest-form"), ingestId: $("ingest-id"), ingestFormat: $("ingest-format"),
      ingestText: $("ingest-text"), ingestFiles: $("ingest-files"), ingestSubmit: $("ingest-submit"),
      ingestStatus: $("ingest-status"), ingestProgress: $("ingest-progress"),
    };

    // -------- storage (web storage can be unavailable: private windows, file://)
    // The history is kept across visits (localStorage); the API key only for this tab's session (sessionStorage),
    // so it does not outlive the tab on a shared machine.

    function area(name) { try { return window[name]; } catch (_) { return null; } }
    function load(key, fallback, name) {
      try { const v = area(name || "localStorage").getItem(key); return v === null ? fallback : v; } catch (_) { return fallback; }
    }
    function save(key, value, name) {
      try {
        const storage = area(name || "localStorage");
        if (value === "" || value === null) storage.removeItem(key);
        else storage.setItem(key, value);
      } catch (_) { /* not persisted; still used for this page */ }
    }

    save(KEY_STORAGE, "", "localStorage"); // a key an earlier version of the page kept for good
    el.apiKey.value = load(KEY_STORAGE, "", "sessionStorage");
    el.apiKey.addEventListener("input", function () { save(KEY_STORAGE, el.apiKey.value.trim(), "sessionStorage"); });

    function headers(extra) {
      const h = Object.assign({}, extra);
      const key = el.apiKey.value.trim();
      if (key) {
        if (!/^[\x21-\x7e]+$/.test(key)) throw new Error("The API key has characters that cannot be sent in a header.");
        h["Authorization"] = "Bearer " + key;
      }
      return h;
    }

    // Relative to the page, so the gateway also works behind a path prefix.
    function url(path) { return new URL(path, document.baseURI).toString(); }

    // -------- state

    function setState(state) { document.body.dataset.state = state; }

    function setStatus(text, kind) {
      el.status.textContent = text;
      el.status.dataset.kind = kind;
    }

    // ================================================================ ask

    let current = null; // { controller, params, started, firstTokenAt, tokens, text }

    // The conversation so far ({role, content}, oldest first): sent as `history` with each question, so the
    // server puts it between the retrieved chunks and the new question. "New conversation" empties it.
    const CONVERSATION_LIMIT = 16; // messages kept; the server's own bound is KVSTITCH_MAX_HISTORY_MESSAGES
    let conversation = [];

    function renderConversation() {
      const turns = conversation.length / 2;
      el.conversation.textContent = turns
        ? "Continuing a conversation of " + plural(turns, "earlier question") + "."
        : "New conversation.";
      el.newConversation.disabled = conversation.length === 0;
    }

    el.newConversation.addEventListener("click", function () {
      conversation = [];
      renderConversation();
      el.question.focus();
    });
    renderConversation();

    el.question.addEventListener("keydown", function (ev) {
      if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing && ev.keyCode !== 229) {
        ev.preventDefault();
        el.askForm.requestSubmit();
      }
    });

    el.askForm.addEventListener("submit", function (ev) {
      ev.preventDefault();
      if (current) return; // one answer at a time
      let params;
      try {
        params = readAskParams();
      } catch (err) {
        setState("error");
        setStatus("Error: " + err.message, "error");
        return;
      }
      ask(params);
    });

    el.stop.addEventListener("click", function () {
      if (current) current.controller.abort();
    });

    function readAskParams() {
      const question = el.question.value.trim();
      if (!question) { el.question.focus(); throw new Error("Type a question first."); }
      const body = {
        question: question,
        top_k: readNumber(el.topK, "top_k", { required: true, integer: true, min: 1, max: 50 }),
        mode: el.mode.value === "naive" ? "naive" : "turbo",
        positions: el.positions.value === "composite" ? "composite" : "reordered",
        stream: true,
        max_new_tokens: readNumber(el.maxNewTokens, "Max new tokens", { required: true, integer: true, min: 1 }),
      };
      const temperature = readNumber(el.temperature, "Temperature", { min: 0 });
      const topP = readNumber(el.topP, "top_p", { min: 0, max: 1 });
      const seed = readNumber(el.seed, "Seed", { integer: true });
      if (temperature !== undefined) body.temperature = temperature;
      if (topP !== undefined) body.top_p = topP;
      if (seed !== undefined) body.seed = seed;
      if (conversation.length) body.history = conversation.slice();
      return body;
    }

    function resetAnswer() {
      el.answer.textContent = "";
      el.answer.dataset.tokens = "0";
      el.ttft.textContent = "TTFT —";
      delete el.ttft.dataset.ms;
      el.ttftClient.textContent = "";
      el.outputTokens.textContent = "";
      el.tiers.textContent = "KV tiers —";
      el.timings.replaceChildren();
      el.sources.replaceChildren();
      el.sourcesEmpty.hidden = false;
      el.sourcesEmpty.textContent = "Retrieving…";
    }

    function setBusy(busy) {
      el.ask.disabled = busy;
      el.stop.disabled = !busy;
      el.newConversation.disabled = busy || conversation.length === 0;
      el.answer.setAttribute("aria-busy", busy ? "true" : "false");
    }

    async function ask(params) {
      const controller = new AbortController();
      const answerText = document.createTextNode("");
      resetAnswer();
      el.answer.appendChild(answerText);
      current = { controller: controller, params: params, started: performance.now(), firstTokenAt: null,
                  tokens: 0, answerText: answerText, finished: false };
      setBusy(true);
      setState("streaming");
      setStatus("streaming…", "streaming");

      try {
        const res = await guarded(fetch(url("ask"), {
          method: "POST",
          headers: headers({ "Content-Type": "application/json", "Accept": "text/event-stream" }),
          body: JSON.stringify(params),
          signal: controller.signal,
          cache: "no-store",
        }), "asking");
        if (!res.ok) throw await httpError(res);
        const type = res.headers.get("Content-Type") || "";
        if (type.indexOf("text/event-stream") === -1) {
          throw new Error("Expected an event stream from /ask but got " + (type || "no content type") + ".");
        }
        if (!res.body) throw new Error("This browser cannot stream response bodies.");
        await readStream(res.body);
        if (!current.finished) throw new Error("The stream ended before the answer was done.");
      } catch (err) {
        if (err && err.name === "AbortError" && !current.finished) {
          setState("idle");
          setStatus("Stopped after " + current.tokens + " tokens.", "idle");
          el.sourcesEmpty.textContent = el.sources.childElementCount ? "" : "No sources received.";
        } else if (!current.finished) {
          fail(describeFailure(err));
        }
      } finally {
        controller.abort(); // closes the connection if we stopped reading early; a no-op once it has ended
        setBusy(false);
        current = null;
      }
    }

    async function readStream(body) {
      const reader = body.getReader();
      const decoder = new TextDecoder("utf-8");
      const parser = new SSEParser(handleEvent);
      let ended = false;
      try {
        while (!current.finished) {
          const chunk = await guarded(reader.read(), "streaming the answer");
          if (chunk.done) { ended = true; parser.push(decoder.decode()); parser.end(); break; }
          parser.push(decoder.decode(chunk.value, { stream: true }));
        }
      } finally {
        // after `done` or `error` (or a bad event) nothing more is ours to read
        if (!ended) reader.cancel().catch(function () { /* already closed */ });
      }
    }

    function parseData(ev) {
      try { return JSON.parse(ev.data); } catch (_) {
        throw new Error("The server sent a malformed '" + ev.type + "' event.");
      }
    }

    function handleEvent(ev) {
      if (!current || current.finished) return;
      switch (ev.type) {
        case "retrieval": {
          const found = parseData(ev) || {};
          renderSources(found.chunks, typeof found.note === "string" ? found.note : "");
          break;
        }
        case "token": onToken(parseData(ev)); break;
        case "done": onDone(parseData(ev)); break;
        case "error": {
          let message = ev.data;
          try { const d = JSON.parse(ev.data); message = (d && (d.message || describeDetail(d))) || ev.data; } catch (_) { /* plain text */ }
          fail("Server error: " + message);
          break;
        }
        default: break; // keep-alives and future event types
      }
    }

    function onToken(data) {
      const text = data && typeof data.text === "string" ? data.text : "";
      if (current.firstTokenAt === null) {
        current.firstTokenAt = performance.now();
        el.ttftClient.textContent = "first token after " + fmtMs(current.firstTokenAt - current.started) + " ms in the browser";
      }
      current.tokens += 1;
      el.answer.dataset.tokens = String(current.tokens);
      const stick = el.answer.scrollHeight - el.answer.scrollTop - el.answer.clientHeight < 24;
      current.answerText.appendData(text);
      if (stick) el.answer.scrollTop = el.answer.scrollHeight;
    }

    function onDone(data) {
      current.finished = true;
      data = data || {};
      const ttft = data.ttft_ms;
      el.ttft.textContent = "TTFT " + fmtMs(ttft) + " ms";
      if (isNum(ttft)) el.ttft.dataset.ms = String(ttft);
      el.ttft.dataset.mode = data.mode || current.params.mode;
      const timings = data.timings_ms || {};
      const outTokens = isNum(data.output_tokens) ? data.output_tokens : current.tokens;
      let tokLine = outTokens + " tokens";
      if (isNum(timings.decode) && timings.decode > 0 && outTokens > 1) {
        tokLine += " · " + ((outTokens - 1) / (timings.decode / 1000)).toFixed(1) + " tok/s";
      }
      el.outputTokens.textContent = tokLine;
      el.tiers.textContent = tierLine(data.kv);
      renderTimings(timings);
      if (!el.sources.childElementCount) el.sourcesEmpty.textContent = "No sources were retrieved.";
      setState("done");
      setStatus("done", "done");
      conversation = conversation.concat([
        { role: "user", content: current.params.question },
        { role: "assistant", content: current.answerText.data },
      ]).slice(-CONVERSATION_LIMIT);
      renderConversation();
      addHistory({
        mode: data.mode || current.params.mode,
        positions: data.positions || current.params.positions,
        top_k: current.params.top_k,
        ttft_ms: isNum(ttft) ? ttft : null,
        output_tokens: outTokens,
        kv: data.kv || null,
        question: current.params.question,
        answer: current.answerText.data,
        at: Date.now(),
      });
    }

    function fail(message) {
      if (current) current.finished = true;
      setState("error");
      setStatus("Error: " + message, "error");
      if (!el.sources.childElementCount) el.sourcesEmpty.textContent = "No sources received.";
    }

    // Where a chunk sits: its document's title, the innermost heading, its page(s) (PDF).
    function sourcePlace(c) {
      const parts = [];
      if (typeof c.title === "string" && c.title) parts.push(c.title);
      if (Array.isArray(c.headings) && c.headings.length) parts.push(String(c.headings[c.headings.length - 1]));
      if (isNum(c.page)) parts.push(isNum(c.last_page) && c.last_page !== c.page ? "pp. " + c.page + "–" + c.last_page : "p. " + c.page);
      return parts.join(" · ");
    }

    function renderSources(chunks, note) {
      el.sources.replaceChildren();
      if (!Array.isArray(chunks) || chunks.length === 0) {
        el.sourcesEmpty.hidden = false;
        el.sourcesEmpty.textContent = note || "No chunks matched the question.";
        return;
      }
      el.sourcesEmpty.hidden = true;
      chunks.forEach(function (c, i) {
        c = c || {};
        const li = document.createElement("li");
        li.className = "source";
        li.dataset.chunkId = c.id === undefined ? "" : String(c.id);
        li.dataset.docId = c.doc_id === undefined ? "" : String(c.doc_id);

        const head = document.createElement("div");
        head.className = "source-head";
        const doc = sourceName(document, c);
        const score = document.createElement("span");
        score.className = "score";
        score.textContent = "score " + (isNum(c.score) ? c.score.toFixed(3) : "—");
        const tokens = document.createElement("span");
        tokens.className = "tokens";
        tokens.textContent = fmtCount(c.tokens) + " tokens";
        head.append(doc, score, tokens);
        const where = sourcePlace(c);
        if (where) {
          const place = document.createElement("span");
          place.className = "place";
          place.textContent = where;
          head.append(place);
        }

        const details = document.createElement("details");
        const summary = document.createElement("summary");
        summary.textContent = "Chunk text" + (c.id !== undefined ? " (" + c.id + ")" : "");
        const body = document.createElement("pre");
        body.className = "chunk-text";
        body.textContent = typeof c.text === "string" ? c.text : "";
        details.append(summary, body);

        li.append(head, details);
        li.setAttribute("aria-label", "Source " + (i + 1) + ": " + doc.textContent + ", " + score.textContent);
        el.sources.appendChild(li);
      });
    }

    function renderTimings(timings) {
      el.timings.replaceChildren();
      const stages = TIMING_STAGES.filter(function (s) { return isNum(timings[s]); });
      if (stages.length === 0) return;

      // The stacked bar shows what the time to first token is made of (decode comes after it).
      const before = stages.filter(function (s) { return s !== "decode"; });
      const total = before.reduce(function (sum, s) { return sum + Math.max(0, timings[s]); }, 0);
      if (total > 0) {
        const bar = document.createElement("div");
        bar.className = "timing-bar";
        bar.setAttribute("aria-hidden", "true");
        before.forEach(function (s) {
          const seg = document.createElement("span");
          seg.className = "seg seg-" + s;
          seg.style.flexGrow = String(Math.max(0, timings[s]));
          seg.title = s + " " + fmtMs(timings[s]) + " ms";
          bar.appendChild(seg);
        });
        el.timings.appendChild(bar);
      }
      const list = document.createElement("ul");
      list.className = "timing-list";
      stages.forEach(function (s) {
        const li = document.createElement("li");
        const swatch = document.createElement("span");
        swatch.className = "swatch seg-" + s;
        swatch.setAttribute("aria-hidden", "true");
        li.append(swatch, document.createTextNode(s + " " + fmtMs(timings[s]) + " ms"));
        list.appendChild(li);
      });
      el.timings.appendChild(list);
    }

    // -------- history

    let history = [];
    try {
      const stored = JSON.parse(load(HISTORY_STORAGE, "[]"));
      if (Array.isArray(stored)) history = stored.slice(0, HISTORY_LIMIT);
    } catch (_) { history = []; }

    function addHistory(entry) {
      history.unshift(entry);
      history = history.slice(0, HISTORY_LIMIT);
      save(HISTORY_STORAGE, JSON.stringify(history));
      renderHistory();
    }

    el.historyClear.addEventListener("click", function () {
      history = [];
      save(HISTORY_STORAGE, "");
      renderHistory();
    });

    function renderHistory() {
      const tbody = el.history.tBodies[0];
      tbody.replaceChildren();
      el.history.hidden = history.length === 0;
      el.historyClear.hidden = history.length === 0;
      history.forEach(function (h) {
        const tr = document.createElement("tr");
        tr.dataset.mode = h.mode;
        const kv = h.kv ? TIERS.map(function (t) { return fmtCount(h.kv[t]); }).join("/") : "—";
        const cells = [
          [h.mode, "mode mode-" + h.mode],
          [h.positions, ""],
          [fmtCount(h.top_k), "num"],
          [fmtMs(h.ttft_ms), "num"],
          [fmtCount(h.output_tokens), "num"],
          [kv, "kv"],
        ];
        cells.forEach(function (cell) {
          const td = document.createElement("td");
          td.textContent = cell[0];
          if (cell[1]) td.className = cell[1];
          tr.appendChild(td);
        });
        const q = document.createElement("td");
        q.className = "question-cell";
        const details = document.createElement("details");
        const summary = document.createElement("summary");
        summary.textContent = h.question;
        const answer = document.createElement("p");
        answer.className = "history-answer";
        answer.textContent = h.answer || "(empty answer)";
        details.append(summary, answer);
        q.appendChild(details);
        tr.appendChild(q);
        tbody.appendChild(tr);
      });
      el.historySummary.textContent = summarizeHistory();
    }

    function summarizeHistory() {
      if (history.length === 0) return "Previous answers with their mode and TTFT appear here.";
      const byMode = {};
      history.forEach(function (h) {
        if (!isNum(h.ttft_ms)) return;
        (byMode[h.mode] = byMode[h.mode] || []).push(h.ttft_ms);
      });
      const parts = Object.keys(byMode).sort().map(function (m) {
        return m + ": median TTFT " + fmtMs(median(byMode[m])) + " ms over " + byMode[m].length;
      });
      if (byMode.turbo && byMode.naive) {
        const t = median(byMode.turbo), n = median(byMode.naive);
        if (t > 0) parts.push("naive / turbo = " + (n / t).toFixed(1) + "×");
      }
      return parts.length ? parts.join(" · ") : "No TTFT measured yet.";
    }

    renderHistory();

    // ================================================================ ingest

    let pollToken = 0; // a newer job supersedes the one being polled

    el.ingestForm.addEventListener("submit", function (ev) {
      ev.preventDefault();
      ingest();
    });

    function setIngest(text, state) {
      el.ingestStatus.textContent = text;
      el.ingestStatus.dataset.state = state;
    }

    // Pasted text goes as JSON to /ingest; files (text, Markdown, HTML, PDF) as multipart to /ingest/files, where
    // the server tells each file's kind by its bytes.
    function collectIngest() {
      const text = el.ingestText.value;
      const id = el.ingestId.value.trim();
      const files = Array.prototype.slice.call(el.ingestFiles.files || []);
      if (text.trim() !== "" && files.length) throw new Error("Ingest the pasted text and the files one at a time.");
      if (files.length) {
        const form = new FormData();
        files.forEach(function (f) { form.append("files", f, f.name); });
        return { path: "ingest/files", body: form, count: files.length, json: false };
      }
      if (text.trim() === "") {
        if (id) { el.ingestText.focus(); throw new Error("Paste the text of document '" + id + "'."); }
        throw new Error("Paste some text or choose files to ingest.");
      }
      if (!id) { el.ingestId.focus(); throw new Error("Give the pasted document an id."); }
      const doc = { id: id, text: text, metadata: { source: "paste" }, format: el.ingestFormat.value === "markdown" ? "markdown" : "text" };
      return { path: "ingest", body: JSON.stringify({ documents: [doc] }), count: 1, json: true };
    }

    async function ingest() {
      const token = ++pollToken;
      el.ingestProgress.hidden = true;
      el.ingestSubmit.disabled = true;
      try {
        setIngest("Reading…", "sending");
        const send = collectIngest();
        setIngest("Sending " + plural(send.count, "document") + "…", "sending");
        const kind = send.json ? { "Content-Type": "application/json", "Accept": "application/json" } : { "Accept": "application/json" };
        const res = await guarded(fetch(url(send.path), {
          method: "POST",
          headers: headers(kind),
          body: send.body,
          cache: "no-store",
        }), "sending the documents");
        if (!res.ok) throw await httpError(res);
        const body = await res.json();
        if (!body || typeof body.job_id !== "string") throw new Error("The server accepted the job but sent no job_id.");
        setIngest("Job " + body.job_id + " queued.", "queued");
        el.ingestStatus.dataset.jobId = body.job_id;
        poll(body.job_id, token, 0);
      } catch (err) {
        setIngest("Error: " + describeFailure(err), "error");
      } finally {
        el.ingestSubmit.disabled = false;
      }
    }

    async function poll(jobId, token, failures) {
      if (token !== pollToken) return;
      let next = failures;
      try {
        const res = await guarded(fetch(url("ingest/" + encodeURIComponent(jobId)), {
          headers: headers({ "Accept": "application/json" }),
          cache: "no-store",
        }), "polling the job");
        if (!res.ok) throw await httpError(res);
        const job = await res.json();
        if (token !== pollToken) return;
        showJob(job, jobId);
        if (job.status === "done" || job.status === "failed" || job.status === "cancelled") return;
        next = 0;
      } catch (err) {
        if (token !== pollToken) return;
        const fatal = typeof err.status === "number" && err.status !== 429 && err.status < 500;
        next = failures + 1;
        if (fatal || next >= POLL_MAX_FAILURES) {
          setIngest("Error while polling job " + jobId + ": " + describeFailure(err), "error");
          return;
        }
      }
      window.setTimeout(function () { poll(jobId, token, next); }, POLL_MS);
    }

    function showJob(job, jobId) {
      const status = typeof job.status === "string" ? job.status : "unknown";
      const counts = [
        plural(job.documents, "document"),
        plural(job.chunks, "chunk"),
        fmtCount(job.chunks_precomputed) + " precomputed",
        fmtCount(job.chunks_reused) + " reused",
      ].join(" · ");
      let text = "Job " + (job.job_id || jobId) + ": " + status + " — " + counts;
      if (status === "failed") text += ". Error: " + (job.error || "unknown");
      setIngest(text, status);
      const done = isNum(job.chunks_done) ? job.chunks_done : (isNum(job.chunks_precomputed) ? job.chunks_precomputed : 0) + (isNum(job.chunks_reused) ? job.chunks_reused : 0);
      if (isNum(job.chunks) && job.chunks > 0) {
        el.ingestProgress.hidden = false;
        el.ingestProgress.max = job.chunks;
        el.ingestProgress.value = Math.min(done, job.chunks);
      } else {
        el.ingestProgress.hidden = status !== "done";
        if (status === "done") { el.ingestProgress.max = 1; el.ingestProgress.value = 1; }
      }
    }

    setState("idle");
  }

  if (typeof module === "object" && module.exports) {
    module.exports = {
      SSEParser: SSEParser, describeDetail: describeDetail, median: median, tierLine: tierLine,
      sourceLink: sourceLink, sourceName: sourceName,
    };
  } else if (typeof document !== "undefined") {
    if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init);
    else init();
  }
})();
