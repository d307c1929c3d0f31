"""How the gateway reads an engine's JSON lines: tokens that arrived together leave as one event, none waits for
another, a line cut across reads is whole, and an error line still lets the tokens before it out."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import httpx

from service.facade.engine import EngineAnswerRequest, EngineStreamError, error_line, event_line
from service.facade.types import AnswerEvent, DoneEvent, Logprob, TokenEvent
from service.serving.remote_answer import _arrived_lines, _parsed, merged_tokens

DONE = DoneEvent("turbo", "reordered", 1.0, 3, "length", {}, {"gpu": 1}, "abc", 10, 5)


def body(parts: Sequence[bytes], pause_s: float) -> httpx.Response:
    async def chunks() -> AsyncIterator[bytes]:
        for part in parts:
            if pause_s:
                await asyncio.sleep(pause_s)
            yield part

    return httpx.Response(200, content=chunks())


def batches(parts: Sequence[bytes], pause_s: float = 0.0) -> list[list[bytes]]:
    async def read() -> list[list[bytes]]:
        return [batch async for batch in _arrived_lines(body(parts, pause_s))]

    return asyncio.run(read())


def test_consecutive_tokens_merge_with_their_log_probabilities_in_order() -> None:
    a, b = Logprob("a", -0.1, b"a"), Logprob("b", -0.2, b"b")
    events: list[AnswerEvent] = [TokenEvent("a", (a,)), TokenEvent("b", (b,)), TokenEvent("c"), DONE]

    assert merged_tokens(events) == [TokenEvent("abc", (a, b)), DONE]
    assert merged_tokens([DONE]) == [DONE]
    assert merged_tokens([]) == []


def test_lines_that_arrived_together_come_as_one_batch() -> None:
    lines = [event_line(TokenEvent(t)) for t in "abc"] + [event_line(DONE)]

    together = batches(lines)
    apart = batches(lines, pause_s=0.02)

    assert together == [[line.rstrip(b"\n") for line in lines]]
    assert apart == [[line.rstrip(b"\n")] for line in lines]


def test_a_line_cut_across_reads_is_read_whole_and_a_last_line_needs_no_newline() -> None:
    line = event_line(TokenEvent("hello"))

    cut = batches([line[:5], line[5:] + b"\n" + line.rstrip(b"\n")], pause_s=0.02)

    assert cut == [[line.rstrip(b"\n")], [line.rstrip(b"\n")]]


def test_a_read_error_ends_the_lines_after_the_ones_before_it() -> None:
    async def failing() -> AsyncIterator[bytes]:
        yield event_line(TokenEvent("a"))
        await asyncio.sleep(0.02)
        raise httpx.ReadError("engine gone")

    async def read() -> tuple[list[list[bytes]], str]:
        seen = []
        try:
            async for batch in _arrived_lines(httpx.Response(200, content=failing())):
                seen.append(batch)
        except httpx.ReadError as err:
            return seen, str(err)
        return seen, ""

    seen, error = asyncio.run(read())

    assert seen == [[event_line(TokenEvent("a")).rstrip(b"\n")]] and error == "engine gone"


def test_an_error_line_keeps_the_tokens_before_it() -> None:
    events, failure = _parsed([event_line(TokenEvent("a")).strip(), error_line("out of memory"), b"{}"])

    assert events == [TokenEvent("a")]
    assert isinstance(failure, EngineStreamError) and str(failure) == "out of memory"
    assert isinstance(_parsed([b"not json"])[1], ValueError)


def test_the_request_json_keeps_every_field() -> None:
    """`to_json` builds the body by hand (no `asdict`): it must still hold each field of the request."""
    request = EngineAnswerRequest("why?", ())

    assert set(request.to_json()) == set(EngineAnswerRequest.__dataclass_fields__)
