"""The bridge behind `Facade.answer`: events made on another thread arrive, in order, as an async iterator; an
engine error is raised from it; leaving it early cancels the answer."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from service.facade.types import AnswerEvent, DoneEvent, TokenEvent
from service.serving.answer_session import AnswerItem
from service.serving.answer_stream import EventStream

DONE = DoneEvent("turbo", "reordered", 1.0, 2, "stop", {}, {}, "ab", 10, 5)


@dataclass
class Retrieval:
    dropped: int = 1


@dataclass
class FakeSession:
    """An answer session whose engine thread posts `items`, then waits for a cancel if told to."""

    items: list[AnswerItem]
    hold_open: bool = False
    done: DoneEvent | None = None
    retrieval: Retrieval = field(default_factory=Retrieval)
    cancels: int = 0
    cancelled: threading.Event = field(default_factory=threading.Event)
    posted_all: threading.Event = field(default_factory=threading.Event)  # the engine thread's last post is made

    def sources(self) -> list[dict[str, Any]]:
        return [{"id": "c1", "score": 0.5}]

    def start(self, listener: Callable[[AnswerItem], None]) -> None:
        def engine() -> None:
            for item in self.items:
                if isinstance(item, DoneEvent):
                    self.done = item
                listener(item)
            if self.hold_open:
                self.cancelled.wait(10)
                listener(None)
            self.posted_all.set()

        threading.Thread(target=engine, daemon=True).start()

    def cancel(self) -> None:
        self.cancels += 1
        self.cancelled.set()


async def collect(stream: EventStream, stop_after: int | None = None) -> list[AnswerEvent]:
    seen: list[AnswerEvent] = []
    async for event in stream:
        seen.append(event)
        if stop_after is not None and len(seen) == stop_after:
            break
    return seen


def test_events_from_the_engine_thread_arrive_in_order_then_the_stream_ends() -> None:
    session = FakeSession([TokenEvent("a"), TokenEvent("b"), DONE, None])
    stream = EventStream(session)  # type: ignore[arg-type]

    events = asyncio.run(collect(stream))

    assert events == [TokenEvent("a"), TokenEvent("b"), DONE]
    assert (stream.sources, stream.dropped, stream.done) == ([{"id": "c1", "score": 0.5}], 1, DONE)


def test_an_engine_error_is_raised_from_the_iteration() -> None:
    session = FakeSession([TokenEvent("a"), RuntimeError("kv index away"), None])

    with pytest.raises(RuntimeError, match="kv index away"):
        asyncio.run(collect(EventStream(session)))  # type: ignore[arg-type]


def test_leaving_the_iteration_early_cancels_the_answer() -> None:
    session = FakeSession([TokenEvent("a"), TokenEvent("b")], hold_open=True)

    async def leave_after_one() -> list[AnswerEvent]:
        stream = EventStream(session)  # type: ignore[arg-type]
        iterator = stream.__aiter__()
        first = await anext(iterator)
        await iterator.aclose()  # what the SSE response does when its client goes away
        # The server's loop outlives a client that left: the engine's last post lands on it (posted after the loop
        # had closed, it would cancel again, as a session posting into a shut-down server does).
        await asyncio.to_thread(session.posted_all.wait, 10)
        return [first]

    assert asyncio.run(leave_after_one()) == [TokenEvent("a")]
    assert session.cancels == 1 and session.done is None


def test_a_stream_is_iterated_once() -> None:
    stream = EventStream(FakeSession([None]))  # type: ignore[arg-type]
    asyncio.run(collect(stream))

    with pytest.raises(RuntimeError, match="iterated once"):
        stream.__aiter__()
