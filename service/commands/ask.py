"""`kvstitch ask "question"`: stream an answer from a running server to the terminal, then TTFT and tier hits."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from typing import Any, TextIO

import httpx

# Every control character (C0, DEL, C1) but newline and tab: an answer or a source name that comes with ESC or CR
# must not move the cursor, recolour or clear the user's terminal.
CONTROL_CHARACTERS = dict.fromkeys(c for c in (*range(0x20), *range(0x7F, 0xA0)) if chr(c) not in "\n\t")


def printable(text: str) -> str:
    """`text` without control characters (newlines and tabs kept)."""
    return text.translate(CONTROL_CHARACTERS)


class SseDecoder:
    """Turns the lines of a text/event-stream body into (event, data) pairs, one line at a time."""

    def __init__(self) -> None:
        self.event, self.data = "message", list[str]()

    def feed(self, line: str) -> tuple[str, str] | None:
        """The event a blank line completes, else None."""
        if not line:
            done = (self.event, "\n".join(self.data)) if self.data else None
            self.event, self.data = "message", []
            return done
        if not line.startswith(":"):  # ":" starts a comment (keep-alive pings)
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if name == "event":
                self.event = value
            elif name == "data":
                self.data.append(value)
        return None

    def finish(self) -> tuple[str, str] | None:
        """An event the body ended without a blank line after."""
        return self.feed("")


def sse_events(lines: Iterator[str]) -> Iterator[tuple[str, str]]:
    """(event, data) pairs of a text/event-stream body."""
    decoder = SseDecoder()
    for line in lines:
        event = decoder.feed(line)
        if event is not None:
            yield event
    last = decoder.finish()
    if last is not None:
        yield last


def ask(url: str, body: dict[str, Any], api_key: str | None, out: TextIO | None = None) -> int:
    """Print tokens as they arrive (to `out`, else the standard output of the moment of the call); 0 when `done`
    arrived, 1 on an `error` event or HTTP error."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with (
            httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=httpx.Timeout(30.0, read=300.0)) as client,
            client.stream("POST", "/ask", json={**body, "stream": True}) as reply,
        ):
            if reply.status_code >= 400:
                reply.read()
                print(printable(f"error: HTTP {reply.status_code}: {_detail(reply)}"), file=sys.stderr)
                return 1
            return print_events(sse_events(reply.iter_lines()), out or sys.stdout)
    except httpx.HTTPError as err:
        print(f"error: cannot talk to the server at {url}: {err}", file=sys.stderr)
        return 1


def print_events(events: Iterator[tuple[str, str]], out: TextIO) -> int:
    """Print an /ask event stream (sources, tokens, then TTFT and tiers), every control character stripped;
    0 after `done`, 1 after `error` or when the stream ends without `done`."""
    for name, data in events:
        payload = json.loads(data)
        if name == "retrieval":
            sources = ", ".join(f"{c['doc_id']} ({c['score']:.2f})" for c in payload["chunks"])
            print(printable(f"[sources: {sources or 'none'}]"), file=out, flush=True)
            if "note" in payload:
                print(printable(f"[{payload['note']}]"), file=out, flush=True)
        elif name == "token":
            out.write(printable(payload["text"]))
            out.flush()
        elif name == "done":
            kv = " ".join(f"{tier}={n}" for tier, n in payload["kv"].items())
            timings = " ".join(f"{k}={v:.1f}" for k, v in payload["timings_ms"].items())
            print(printable(f"\n\nTTFT {payload['ttft_ms']:.1f} ms ({payload['mode']}), KV tiers: {kv}"), file=out)
            print(printable(f"timings ms: {timings}; {payload['output_tokens']} tokens"), file=out)
            return 0
        elif name == "error":
            print(printable(f"\nerror: {payload['message']}"), file=sys.stderr)
            return 1
    print("\nerror: the stream ended without a done event", file=sys.stderr)
    return 1


def _detail(reply: httpx.Response) -> str:
    try:
        return str(reply.json().get("detail", reply.text))
    except ValueError:
        return reply.text
