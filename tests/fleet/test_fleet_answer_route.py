"""`POST /answer` as a plain ASGI app (`service.api.engine_answer`): the statuses and bodies FastAPI gave before it
(413, 422 shaped like FastAPI's validation errors, 503 with Retry-After), the lines of an answer, an error after the
start as an `error` line, and a gateway that goes away cancelling the answer it left."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from service.api import engine_answer
from service.api.engine_answer import AnswerRoute
from service.errors import BusyError
from service.facade.engine import EngineAnswerRequest, WireChunk, parse_event
from service.facade.types import AnswerEvent, DoneEvent, TokenEvent

REQUEST = EngineAnswerRequest("why?", (WireChunk("c1", "d1", 0.5, "text", (1, 2, 3)),), max_new_tokens=3)
DONE = DoneEvent("turbo", "reordered", 1.0, 2, "length", {}, {"gpu": 1}, "ab", 10, 3)


class Answer:
    """Events given up front, then (with `hang`) none until cancelled."""

    def __init__(self, events: list[AnswerEvent | Exception], hang: bool = False) -> None:
        self.events, self.hang = events, hang
        self.cancelled = asyncio.Event()

    def __aiter__(self) -> AsyncIterator[AnswerEvent]:
        return self._events()

    async def _events(self) -> AsyncIterator[AnswerEvent]:
        for event in self.events:
            if isinstance(event, Exception):
                raise event
            yield event
        if self.hang:
            await self.cancelled.wait()

    def cancel(self) -> None:
        self.cancelled.set()


class Engine:
    """The facade's `answer` only: the given answer, or the given refusal."""

    def __init__(self, answer: Answer | None = None, refusal: Exception | None = None) -> None:
        self.answer_given, self.refusal = answer, refusal
        self.requests: list[EngineAnswerRequest] = []

    async def answer(self, request: EngineAnswerRequest) -> Answer:
        self.requests.append(request)
        if self.refusal is not None:
            raise self.refusal
        assert self.answer_given is not None
        return self.answer_given


async def call(engine: Engine, body: bytes, disconnect_after_s: float | None = None) -> list[dict[str, Any]]:
    """The messages the route over `engine` sends for `body`."""
    return await drive(AnswerRoute(engine), body, disconnect_after_s)  # type: ignore[arg-type]


async def drive(route: Any, body: bytes, disconnect_after_s: float | None = None) -> list[dict[str, Any]]:
    """The messages `route` sends for `body` (in two parts); the gateway disconnects after `disconnect_after_s`
    (None: never, it waits for the answer)."""
    parts = [{"type": "http.request", "body": body[:5], "more_body": True}]
    parts.append({"type": "http.request", "body": body[5:], "more_body": False})
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if parts:
            return parts.pop(0)
        if disconnect_after_s is None:
            await asyncio.Event().wait()
        await asyncio.sleep(disconnect_after_s or 0.0)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await asyncio.wait_for(route({"type": "http", "method": "POST", "path": "/answer"}, receive, send), 5)
    return sent


def status_and_body(sent: list[dict[str, Any]]) -> tuple[int, dict[str, bytes], bytes]:
    start = sent[0]
    assert start["type"] == "http.response.start"
    assert sent[-1]["more_body"] is False
    return start["status"], dict(start["headers"]), b"".join(m["body"] for m in sent[1:])


def test_an_answer_streams_its_events_as_lines() -> None:
    engine = Engine(Answer([TokenEvent("a"), TokenEvent("b"), DONE]))
    status, headers, body = status_and_body(asyncio.run(call(engine, REQUEST.body())))

    assert status == 200 and headers[b"content-type"] == b"application/x-ndjson"
    assert [parse_event(line) for line in body.splitlines()] == [TokenEvent("a"), TokenEvent("b"), DONE]
    assert engine.requests == [REQUEST]


def test_an_error_after_the_start_is_an_error_line() -> None:
    engine = Engine(Answer([TokenEvent("a"), RuntimeError("device lost")]))
    status, _, body = status_and_body(asyncio.run(call(engine, REQUEST.body())))

    assert status == 200
    lines = body.splitlines()
    assert parse_event(lines[0]) == TokenEvent("a")
    assert json.loads(lines[1]) == {"event": "error", "message": "generation failed: RuntimeError: device lost"}


@pytest.mark.parametrize(
    ("body", "message"),
    [(b"not json", "not JSON"), (json.dumps({"question": "  "}).encode(), "question: blank")],
)
def test_a_bad_body_is_a_422_shaped_like_fastapis(body: bytes, message: str) -> None:
    engine = Engine(Answer([DONE]))
    status, headers, sent = status_and_body(asyncio.run(call(engine, body)))

    assert status == 422 and headers[b"content-type"] == b"application/json"
    (detail,) = json.loads(sent)["detail"]
    assert detail["loc"] == ["body", "body"] and message in detail["msg"] and detail["type"] == "value_error"
    assert engine.requests == []


def test_a_body_past_the_bound_is_a_413(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_answer, "MAX_BODY_BYTES", 64)
    engine = Engine(Answer([DONE]))
    status, _, sent = status_and_body(asyncio.run(call(engine, b"x" * 65)))

    assert status == 413 and "larger than" in json.loads(sent)["detail"]
    assert engine.requests == []


def test_a_busy_engine_says_when_to_retry() -> None:
    status, headers, sent = status_and_body(asyncio.run(call(Engine(refusal=BusyError("line full")), REQUEST.body())))

    assert status == 503 and headers[b"retry-after"] == b"2"
    assert json.loads(sent) == {"detail": "line full"}


def test_a_gateway_that_goes_away_cancels_its_answer() -> None:
    answer = Answer([TokenEvent("a")], hang=True)
    sent = asyncio.run(call(Engine(answer), REQUEST.body(), disconnect_after_s=0.05))

    assert answer.cancelled.is_set()
    assert sent[0]["status"] == 200 and parse_event(sent[1]["body"]) == TokenEvent("a")


def test_an_answer_whose_gateway_is_gone_before_the_first_byte_is_cancelled() -> None:
    """The send of the response's start fails (the connection closed): the answer is cancelled, nothing raised."""
    answer = Answer([TokenEvent("a")], hang=True)
    parts = [{"type": "http.request", "body": REQUEST.body(), "more_body": False}]

    async def receive() -> dict[str, Any]:
        if parts:
            return parts.pop(0)
        await asyncio.Event().wait()
        return {}

    async def send(message: dict[str, Any]) -> None:
        raise ConnectionResetError("gone")

    route = AnswerRoute(Engine(answer))  # type: ignore[arg-type]
    asyncio.run(asyncio.wait_for(route({"type": "http"}, receive, send), 5))
    assert answer.cancelled.is_set()
