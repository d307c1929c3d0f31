"""From an admitted answer session on the engine thread to an async iterator of events on the event loop.

`AnswerSession.start` makes its events on the engine thread; `EventStream` hands each to the asyncio queue of the
iteration that asked for them, so `Facade.answer` gives the HTTP layer what vLLM's `EngineClient.generate` gives
its API server: an async iterator of events. When the consumer stops iterating early (the client went away) the
stream cancels the session: the engine stops at the next token and gives up the place in line.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import AsyncIterator

from service.facade.types import AnswerEvent, DoneEvent, Source
from service.serving.answer_session import AnswerItem, AnswerSession


class Mailbox:
    """Hands items from the engine thread to asyncio queues of one event loop, waking the loop once per burst.

    A decode step emits a token for every running answer; waking the event loop for each would cost a
    `call_soon_threadsafe` (a self-pipe write) and a loop iteration apiece, all holding the GIL the engine thread
    needs to launch the next step. Items posted while a delivery is pending join it, so a step's tokens arrive
    together, in order per queue.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue[AnswerItem], AnswerItem]] = []
        self._scheduled = False

    def post(self, queue: asyncio.Queue[AnswerItem], item: AnswerItem) -> None:
        """From any thread; raises RuntimeError once the event loop is closed."""
        with self._lock:
            self._items.append((queue, item))
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:
            with self._lock:
                self._scheduled = False
            raise

    def _deliver(self) -> None:
        with self._lock:
            items, self._items = self._items, []
            self._scheduled = False
        for queue, item in items:
            queue.put_nowait(item)


_mailboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Mailbox] = weakref.WeakKeyDictionary()


def mailbox(loop: asyncio.AbstractEventLoop) -> Mailbox:
    """The event loop's mailbox (made on first use, from that loop's thread)."""
    box = _mailboxes.get(loop)
    if box is None:
        box = _mailboxes[loop] = Mailbox(loop)
    return box


class EventStream:
    """One answer session as `service.facade.AnswerStream`: iterated once, on the event loop that iterates it."""

    def __init__(self, session: AnswerSession) -> None:
        self._session = session
        self._sources = session.sources()
        self._iterated = False

    @property
    def sources(self) -> list[Source]:
        return self._sources

    @property
    def dropped(self) -> int:
        return self._session.retrieval.dropped

    @property
    def done(self) -> DoneEvent | None:
        return self._session.done

    def __aiter__(self) -> AsyncIterator[AnswerEvent]:
        if self._iterated:
            raise RuntimeError("an answer stream is iterated once")
        self._iterated = True
        return self._events()

    def cancel(self) -> None:
        self._session.cancel()

    async def _events(self) -> AsyncIterator[AnswerEvent]:
        """Token events, then the done event; errors raised in the engine are raised here. Leaving the iteration
        early (the client went away) cancels the session."""
        session = self._session
        box = mailbox(asyncio.get_running_loop())
        queue: asyncio.Queue[AnswerItem] = asyncio.Queue()

        def listener(item: AnswerItem) -> None:  # runs on the engine thread
            try:
                box.post(queue, item)
            except RuntimeError:  # the event loop is gone (shutdown): nobody is listening any more
                session.cancel()

        session.start(listener)
        try:
            while (item := await queue.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            session.cancel()  # a no-op once done; otherwise the client left mid-answer
