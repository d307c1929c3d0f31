"""The chat page in real headless Chromium against a real uvicorn server (tiny Qwen2 model, MiniLM, local Qdrant).

The page ingests documents (pasted and uploaded), then asks: tokens must arrive while the answer streams, and
the TTFT, the KV tier counts and the sources must be shown once it is done. A MutationObserver installed before
each ask records every change of `body[data-state]` and `#answer[data-tokens]` in order, so "tokens arrived before
`done`" is checked from the page's own history rather than by racing it with polls.

Skipped only where Debian's chromium or chromedriver is absent (the README's set-up installs both).
"""

from __future__ import annotations

import base64
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from app_server import LiveServer
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.ui import Select, WebDriverWait

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (CHROMIUM.is_file() and CHROMEDRIVER.is_file()),
        reason=f"the chat-page test drives Debian's chromium: {CHROMIUM} or {CHROMEDRIVER} is missing "
        "(apt-get install -y chromium chromium-driver)",
    ),
]

# Generous: two CPU cores load MiniLM, run the start-up gate, embed and precompute while Chromium runs too.
INGEST_TIMEOUT_S = 180
ASK_TIMEOUT_S = 180

PAGE_SETTINGS: dict[str, Any] = {
    "redis_url": None,  # embedded index, queue and in-process worker, whatever the environment says
    "default_max_new_tokens": 256,
}
API_KEY = "page-test-key-0123"

OTTERS = (
    "Sea otters hold hands while they sleep so that they do not drift apart on the water.\n\n"
    "Each otter keeps a favourite stone in a pouch of loose skin under its forearm and uses it to crack shells."
)
VOLCANOES = (
    "Shield volcanoes are built almost entirely of fluid lava flows. Mauna Loa on Hawaii is the largest active "
    "volcano on Earth by volume, and its eruptions are rarely explosive."
)
BREAD = "# Sourdough\n\nSourdough bread rises because wild yeast and lactic acid bacteria ferment the flour slowly."
QUESTION = "Why do sea otters hold hands while they sleep?"
MAX_NEW_TOKENS = 24
TIMING_STAGES = ("retrieve", "queue", "load", "h2d", "precompute", "stitch", "prefill", "decode")

TTFT_RE = re.compile(r"TTFT (\d+(?:\.\d+)?) ms")
BROWSER_TTFT_RE = re.compile(r"first token after (\d+(?:\.\d+)?) ms in the browser")
OUTPUT_TOKENS_RE = re.compile(r"(\d+) tokens?\b")
TIMING_RE = re.compile(r"(\w+) (\d+(?:\.\d+)?) ms")
TIERS_RE = re.compile(r"KV tiers: gpu (\d+) · host (\d+) · disk (\d+) · miss (\d+)")

# Records, in order, every change of body[data-state] and #answer[data-tokens] from now on.
INSTALL_TRACE_JS = """
const log = [];
const push = function (r) { log.push([r.target === document.body ? "state" : "tokens", r.oldValue]); };
const observer = new MutationObserver(function (records) { records.forEach(push); });
observer.observe(document.body, { attributes: true, attributeFilter: ["data-state"], attributeOldValue: true });
observer.observe(document.getElementById("answer"),
                 { attributes: true, attributeFilter: ["data-tokens"], attributeOldValue: true });
window.__chatTrace = { log: log, observer: observer, push: push };
"""
# The trace as [what, new value] pairs: a record's new value is the next record's old value (or the current one).
READ_TRACE_JS = """
const t = window.__chatTrace;
t.observer.takeRecords().forEach(t.push);
const now = { state: document.body.dataset.state, tokens: document.getElementById("answer").dataset.tokens };
return t.log.map(function (entry, i) {
  const next = t.log.slice(i + 1).find(function (later) { return later[0] === entry[0]; });
  return [entry[0], next === undefined ? now[entry[0]] : next[1]];
});
"""


# ---------------------------------------------------------------------------------------------------- fixtures


StartServer = Callable[..., LiveServer]


@pytest.fixture
def chat_page_server(live_server: Callable[..., LiveServer]) -> Iterator[StartServer]:
    """Starts real uvicorn servers (tests/api/app_server.py) with the page's settings; stops them afterwards."""
    started: list[LiveServer] = []

    def start(**overrides: Any) -> LiveServer:
        server = live_server(**{**PAGE_SETTINGS, "api_key": None, **overrides})
        started.append(server.__enter__())
        return server

    yield start
    for server in reversed(started):
        server.__exit__(None, None, None)


@pytest.fixture
def chat_browser(chat_page_server: StartServer) -> Iterator[WebDriver]:
    """Headless Debian chromium through Debian's chromedriver (Selenium Manager is never asked to download).

    It depends on the server fixture so that it quits first: no stream is left open while the server stops.
    """
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,1600"):
        options.add_argument(argument)
    driver = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


# ---------------------------------------------------------------------------------------------------- the page


@dataclass
class AskOutcome:
    state: str
    status: str
    tokens: int
    tokens_while_streaming: int
    states: list[str]
    answer: str
    ttft_ms: float
    ttft_text: str
    browser_ttft_text: str
    output_tokens: int
    tiers: dict[str, int]
    doc_ids: list[str]
    timings: dict[str, float]


class ChatPage:
    """What a person does on the page, by the element ids the page promises."""

    def __init__(self, driver: WebDriver, url: str) -> None:
        self.driver = driver
        self.url = url
        driver.get(url + "/")
        self.wait(lambda d: d.execute_script("return document.body.dataset.state") == "idle", 60, "the page to load")

    def wait(self, condition: Callable[[WebDriver], Any], timeout_s: float, what: str) -> Any:
        return WebDriverWait(self.driver, timeout_s, poll_frequency=0.1).until(
            condition, message=f"waited {timeout_s} s for {what}"
        )

    def by_id(self, element_id: str) -> WebElement:
        return self.driver.find_element(By.ID, element_id)

    def type_into(self, element_id: str, text: str) -> None:
        field = self.by_id(element_id)
        field.clear()
        if text:
            field.send_keys(text)

    def text(self, element_id: str) -> str:
        return str(self.by_id(element_id).get_attribute("textContent") or "").strip()

    def attribute(self, element_id: str, name: str) -> str:
        return str(self.by_id(element_id).get_attribute(name) or "")

    # ---- ingest

    def ingest(self, doc_id: str = "", text: str = "", upload: Path | None = None) -> str:
        """Submits the ingest form and waits for its job to end; returns the final status line."""
        previous_job = self.attribute("ingest-status", "data-job-id")
        self.type_into("ingest-id", doc_id)
        self.type_into("ingest-text", text)
        files = self.by_id("ingest-files")
        files.clear()
        if upload is not None:
            files.send_keys(str(upload))
        # forget the previous outcome, so an earlier "error" or "done" cannot be taken for this job's
        self.driver.execute_script("document.getElementById('ingest-status').dataset.state = 'submitting';")
        self.by_id("ingest-submit").click()

        def finished(_: WebDriver) -> str | None:
            state = self.attribute("ingest-status", "data-state")
            if state == "error":
                return state
            new_job = self.attribute("ingest-status", "data-job-id") not in ("", previous_job)
            return state if new_job and state in ("done", "failed") else None

        state = self.wait(finished, INGEST_TIMEOUT_S, f"the ingest job of {doc_id or upload} to finish")
        status = self.text("ingest-status")
        assert state == "done", status
        return status

    # ---- ask

    def ask(self, question: str, mode: str = "turbo", expect: str = "done") -> AskOutcome:
        Select(self.by_id("mode")).select_by_value(mode)
        self.type_into("max-new-tokens", str(MAX_NEW_TOKENS))
        self.type_into("question", question)
        self.driver.execute_script(INSTALL_TRACE_JS)
        self.by_id("ask").click()

        def left_streaming(driver: WebDriver) -> list[list[str]] | None:
            trace: list[list[str]] = driver.execute_script(READ_TRACE_JS)
            states = [value for what, value in trace if what == "state"]
            if "streaming" in states and states[-1] != "streaming":
                return trace
            return None

        trace = self.wait(left_streaming, ASK_TIMEOUT_S, f"the {mode} answer to end")
        state = str(self.driver.execute_script("return document.body.dataset.state"))
        status = self.text("status")
        assert state == expect, f"the ask ended in state {state!r}: {status}"

        tokens_while_streaming, current_state = 0, ""
        for what, value in trace:
            if what == "state":
                current_state = value
            elif current_state == "streaming":
                tokens_while_streaming = max(tokens_while_streaming, int(value))
        ttft_text = self.text("ttft")
        ttft = TTFT_RE.fullmatch(ttft_text)
        output = OUTPUT_TOKENS_RE.match(self.text("output-tokens"))
        tiers = TIERS_RE.fullmatch(self.text("tiers"))
        sources = self.driver.find_elements(By.CSS_SELECTOR, "#sources li.source")
        return AskOutcome(
            state=state,
            status=status,
            tokens=int(self.attribute("answer", "data-tokens")),
            tokens_while_streaming=tokens_while_streaming,
            states=[value for what, value in trace if what == "state"],
            answer=str(self.by_id("answer").get_attribute("textContent") or ""),
            ttft_ms=float(ttft.group(1)) if ttft else float("nan"),
            ttft_text=ttft_text,
            browser_ttft_text=self.text("ttft-client"),
            output_tokens=int(output.group(1)) if output else -1,
            tiers=dict(zip(("gpu", "host", "disk", "miss"), map(int, tiers.groups()), strict=True)) if tiers else {},
            doc_ids=[str(s.get_attribute("data-doc-id")) for s in sources],
            timings=self.timings(),
        )

    def timings(self) -> dict[str, float]:
        """The timings breakdown under the answer, stage by stage."""
        shown: dict[str, float] = {}
        for item in self.driver.find_elements(By.CSS_SELECTOR, "#timings li"):
            entry = TIMING_RE.fullmatch(str(item.get_attribute("textContent") or ""))
            assert entry is not None, item.get_attribute("textContent")
            shown[entry.group(1)] = float(entry.group(2))
        return shown

    def new_conversation(self) -> None:
        self.by_id("new-conversation").click()
        assert self.text("conversation") == "New conversation."

    def history_modes(self) -> list[str]:
        rows = self.driver.find_elements(By.CSS_SELECTOR, "#history tbody tr")
        return [str(row.get_attribute("data-mode")) for row in rows]


def assert_answered(outcome: AskOutcome, mode: str) -> None:
    """Done, tokens seen while streaming, TTFT shown, and the sources led by the otter document."""
    assert outcome.states[0] == "streaming" and outcome.states[-1] == "done", outcome.states
    assert outcome.status == "done"
    assert outcome.tokens_while_streaming > 0, f"no token was shown before `done`: {outcome.states}"
    assert outcome.tokens == outcome.tokens_while_streaming  # nothing counted after `done`
    assert outcome.answer != ""
    # one token event per text delta: an EOS, or bytes of a character still incomplete, make no delta of their own
    assert 0 < outcome.tokens <= outcome.output_tokens <= MAX_NEW_TOKENS, (outcome.tokens, outcome.output_tokens)
    assert outcome.ttft_ms > 0, outcome.ttft_text
    browser_ttft = BROWSER_TTFT_RE.fullmatch(outcome.browser_ttft_text)
    assert browser_ttft is not None and float(browser_ttft.group(1)) > 0, outcome.browser_ttft_text
    assert outcome.doc_ids[0] == "otters", outcome.doc_ids
    assert set(outcome.doc_ids) <= {"otters", "volcanoes", "sourdough.md"}
    # every stage of the `done` event is shown, the ones that make up the TTFT included (queue, precompute)
    assert list(outcome.timings) == list(TIMING_STAGES), outcome.timings
    assert outcome.timings["retrieve"] > 0 and outcome.timings["prefill"] > 0, outcome.timings
    assert outcome.timings["precompute"] == 0, "no chunk KV was computed at question time (naive: none is used)"
    assert set(outcome.tiers) == {"gpu", "host", "disk", "miss"}, outcome.tiers
    if mode == "naive":
        assert outcome.tiers == {"gpu": 0, "host": 0, "disk": 0, "miss": 0}, "naive mode must use no chunk KV"
        assert outcome.timings["load"] == outcome.timings["h2d"] == outcome.timings["stitch"] == 0, outcome.timings
    else:
        # every retrieved chunk's KV came from a cache tier: the worker precomputed them at ingest
        assert outcome.tiers["miss"] == 0, outcome.tiers
        assert outcome.tiers["gpu"] + outcome.tiers["host"] + outcome.tiers["disk"] == len(outcome.doc_ids)


def ingest_corpus(page: ChatPage, tmp_path: Path) -> None:
    for doc_id, text in (("otters", OTTERS), ("volcanoes", VOLCANOES)):
        status = page.ingest(doc_id, text)
        assert re.search(r": done — 1 document · [1-9]\d* chunks? · \d+ precomputed · \d+ reused", status), status
    upload = tmp_path / "sourdough.md"
    upload.write_text(BREAD, encoding="utf-8")
    assert ": done — 1 document" in page.ingest(upload=upload)


# ---------------------------------------------------------------------------------------------------- tests


def test_chat_page_streams_answers_with_ttft_tiers_and_sources(
    chat_page_server: StartServer, chat_browser: WebDriver, tmp_path: Path
) -> None:
    page = ChatPage(chat_browser, chat_page_server().url)
    assert page.text("status") == "Ready."
    ingest_corpus(page, tmp_path)

    first = page.ask(QUESTION)
    assert_answered(first, "turbo")

    page.new_conversation()  # the same question afresh, not as a follow-up
    second = page.ask(QUESTION)
    assert_answered(second, "turbo")
    # the first ask read the blocks the worker wrote to disk and kept them in the pinned host pool
    assert page.text("tiers") == f"KV tiers: gpu 0 · host {len(second.doc_ids)} · disk 0 · miss 0"
    assert second.doc_ids == first.doc_ids
    assert second.answer == first.answer  # greedy decoding over the same stitched KV

    # the text the page assembled from the token events is the server's answer, byte for byte
    reply = httpx.post(
        f"{page.url}/ask", json={"question": QUESTION, "max_new_tokens": MAX_NEW_TOKENS, "stream": False}, timeout=120
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["answer"] == first.answer
    assert reply.json()["output_tokens"] == first.output_tokens

    page.new_conversation()
    naive = page.ask(QUESTION, mode="naive")
    assert_answered(naive, "naive")
    assert naive.doc_ids == first.doc_ids
    assert page.attribute("ttft", "data-mode") == "naive"

    assert page.history_modes() == ["naive", "turbo", "turbo"]
    assert "naive / turbo = " in page.text("history-summary")
    assert_whole_at_each_width(page, tmp_path / "screenshots")


# Records the JSON body of every /ask the page sends from now on.
RECORD_ASKS_JS = """
window.__asks = [];
const plain = window.fetch;
window.fetch = function (resource, init) {
  if (String(resource).endsWith("/ask") && init && init.body) window.__asks.push(JSON.parse(init.body));
  return plain.apply(this, arguments);
};
"""
FOLLOW_UP = "And where do they keep their favourite stone?"


def test_chat_page_keeps_a_conversation_until_a_new_one_is_started(
    chat_page_server: StartServer, chat_browser: WebDriver, tmp_path: Path
) -> None:
    page = ChatPage(chat_browser, chat_page_server().url)
    ingest_corpus(page, tmp_path)
    chat_browser.execute_script(RECORD_ASKS_JS)
    assert page.text("conversation") == "New conversation."
    assert page.attribute("new-conversation", "disabled") == "true"

    first = page.ask(QUESTION)
    assert page.text("conversation") == "Continuing a conversation of 1 earlier question."
    second = page.ask(FOLLOW_UP)
    assert_answered(first, "turbo")
    assert second.state == "done" and second.answer != "" and second.doc_ids
    page.new_conversation()
    third = page.ask(FOLLOW_UP)

    asks = chat_browser.execute_script("return window.__asks;")
    assert [a["question"] for a in asks] == [QUESTION, FOLLOW_UP, FOLLOW_UP]
    assert "history" not in asks[0] and "history" not in asks[2]  # the button started afresh
    assert asks[1]["history"] == [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": first.answer},
    ]
    # the server answers the second turn as it answers the same conversation sent by hand
    body = {"question": FOLLOW_UP, "history": asks[1]["history"], "max_new_tokens": MAX_NEW_TOKENS, "stream": False}
    reply = httpx.post(f"{page.url}/ask", json=body, timeout=120).json()
    assert reply["answer"] == second.answer
    alone = httpx.post(f"{page.url}/ask", json={**body, "history": []}, timeout=120).json()
    assert reply["prompt_tokens"] > alone["prompt_tokens"] and alone["answer"] == third.answer
    assert page.text("conversation") == "Continuing a conversation of 1 earlier question."


def test_chat_page_asks_for_the_api_key_then_works_with_it(
    chat_page_server: StartServer, chat_browser: WebDriver, tmp_path: Path
) -> None:
    page = ChatPage(chat_browser, chat_page_server(api_key=API_KEY).url)
    assert page.attribute("api-key", "value") == ""

    refused = page.ask(QUESTION, expect="error")
    assert refused.status.startswith("Error: HTTP 401"), refused.status
    assert "API key" in refused.status
    assert refused.tokens == 0 and refused.doc_ids == []
    assert page.attribute("status", "data-kind") == "error"

    page.type_into("ingest-id", "otters")
    page.type_into("ingest-text", OTTERS)
    page.by_id("ingest-submit").click()
    page.wait(lambda _: page.attribute("ingest-status", "data-state") == "error", 60, "the refused ingest")
    assert page.text("ingest-status").startswith("Error: HTTP 401"), page.text("ingest-status")
    assert "API key" in page.text("ingest-status")

    page.type_into("api-key", "wrong-key")
    assert "API key" in page.ask(QUESTION, expect="error").status

    page.type_into("api-key", API_KEY)
    ingest_corpus(page, tmp_path)
    assert_answered(page.ask(QUESTION), "turbo")
    stored = "return [window.sessionStorage.getItem('kvstitch.apiKey'), window.localStorage.getItem('kvstitch.apiKey')]"
    assert chat_browser.execute_script(stored) == [API_KEY, None]  # this tab's session only, not kept for good

    # the key is kept for this tab (sessionStorage): after a reload the page still answers
    page = ChatPage(chat_browser, page.url)
    assert page.attribute("api-key", "value") == API_KEY
    assert_answered(page.ask(QUESTION), "turbo")


# ---------------------------------------------------------------------------------------------------- layout

# Every laid-out element's box, the page's scroll width, the panels' boxes and the history table against its wrapper.
MEASURE_LAYOUT_JS = """
const width = document.documentElement.clientWidth;
const describe = function (el) {
  return el.tagName.toLowerCase() + (el.id ? "#" + el.id : "") + (el.className ? "." + el.className : "");
};
const outside = [];
document.body.querySelectorAll("*").forEach(function (el) {
  if (el.closest(".visually-hidden, .skip-link, [hidden]")) return;
  const r = el.getBoundingClientRect();
  if (r.width === 0 && r.height === 0) return;
  if (r.left < -0.5 || r.right > width + 0.5) outside.push(describe(el) + " " + r.left + ".." + r.right);
});
const box = function (el) { const r = el.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
const wrap = document.querySelector(".table-wrap");
const table = document.getElementById("history");
const shown = function (el) { const r = el.getBoundingClientRect(); return r.width > 0 || r.height > 0; };
const cells = Array.from(table.querySelectorAll("th, td")).filter(shown).map(box);
return {
  width: width,
  scrollWidth: document.documentElement.scrollWidth,
  outside: outside,
  ask: box(document.querySelector(".ask-panel")),
  side: box(document.querySelector(".side")),
  wrap: box(wrap),
  wrapScroll: [wrap.scrollWidth, wrap.clientWidth],
  cells: cells,
  rows: table.tBodies[0].rows.length,
};
"""


def layout_at(page: ChatPage, width: int, screenshot: Path) -> dict[str, Any]:
    """The page laid out `width` CSS pixels wide (device metrics, as a phone or a window would give), measured,
    and a screenshot of all of it written to `screenshot`. The viewport is made as tall as the page, so there is
    no scroll bar: what is measured is what the screenshot shows."""

    def resize(height: int) -> None:
        metrics = {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}
        page.driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", metrics)
        page.wait(lambda d: d.execute_script("return window.innerWidth") == width, 10, f"the page at {width} px")

    resize(800)
    resize(int(page.driver.execute_script("return document.documentElement.scrollHeight")))
    layout: dict[str, Any] = page.driver.execute_script(MEASURE_LAYOUT_JS)
    shot = page.driver.execute_cdp_cmd("Page.captureScreenshot", {"format": "png"})
    screenshot.parent.mkdir(parents=True, exist_ok=True)
    screenshot.write_bytes(base64.b64decode(shot["data"]))
    return layout


def assert_whole_at_each_width(page: ChatPage, shots: Path) -> None:
    """1280 px: the two columns side by side and the history table whole. 400 px: one column, nothing wider than
    the screen, the table whole too. Screenshots of both go to `shots` (docs/chat-page-*.png are such shots)."""
    try:
        wide = layout_at(page, 1280, shots / "chat-page-1280.png")
        narrow = layout_at(page, 400, shots / "chat-page-400.png")
    finally:
        page.driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
    # columns shown: all 7 when wide; on a phone mode, TTFT, KV tiers and the question
    for name, layout, columns in (("1280", wide, 7), ("400", narrow, 4)):
        assert layout["rows"] == 3, name  # the three answers above are in the table
        assert len(layout["cells"]) == 4 * columns, name  # the header and three rows
        assert layout["width"] == int(name)
        assert layout["scrollWidth"] <= layout["width"], f"{name} px: the page scrolls sideways"
        assert layout["outside"] == [], f"{name} px: elements outside the viewport"
        scroll_width, client_width = layout["wrapScroll"]
        assert scroll_width <= client_width, (
            f"{name} px: the history table is clipped ({scroll_width} > {client_width})"
        )
        left, _, right, _ = layout["wrap"]
        assert all(left - 0.5 <= cell[0] and cell[2] <= right + 0.5 for cell in layout["cells"]), name
        assert (shots / f"chat-page-{name}.png").stat().st_size > 10_000
    # side by side when wide: the history beside the answer; stacked when narrow: the history under it
    assert wide["side"][0] >= wide["ask"][2] and wide["side"][1] == pytest.approx(wide["ask"][1], abs=1)
    assert narrow["side"][0] == pytest.approx(narrow["ask"][0], abs=1) and narrow["side"][1] >= narrow["ask"][3]
