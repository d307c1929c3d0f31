"""From an HTTP request to a stream of answer events, shared by `/ask` and `/v1/chat/completions`.

`open_answer` asks the facade for an admitted, retrieved question before any byte is sent, so its failures
become proper HTTP statuses (422, 503). `events` then starts generation (on the service's engine loop) and
hands each event to the event loop as it is made. When the client goes away the consumer stops iterating and
`events` cancels the session: the engine stops at the next token and gives up the place in line.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import weakref
from collections.abc import AsyncIterator
from typing import Any

from fastapi import HTTPException, Request
from fastapi.concurrency import run_in_threadpool

from service.api.deps import http_error
from service.facade import AnswerItem, AnswerRequest, AnswerSession, Facade
from service.usecases.answer import DoneEvent, TokenEvent

# How often a non-streaming answer checks that its client is still there.
DISCONNECT_POLL_S = 0.25
# nginx's status for a request its client gave up on (never seen by that client; shows in the request metrics).
CLIENT_CLOSED_REQUEST = 499


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


async def open_answer(facade: Facade, request: AnswerRequest) -> AnswerSession:
    """Check, admit and retrieve; raises HTTPException (422/503) before streaming starts."""
    try:
        return await run_in_threadpool(facade.open_answer, request)
    except Exception as err:
        raise http_error(err) from err


async def events(session: AnswerSession) -> AsyncIterator[TokenEvent | DoneEvent]:
    """Token events, then the done event; errors raised in the engine are raised here. Leaving the iteration
    early (the client went away) cancels the session."""
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


async def collect_text(session: AnswerSession, request: Request) -> str:
    """The whole answer, for the non-streaming forms; engine errors become HTTP errors (nothing was sent yet).

    The client is watched while the answer is made: one that went away (a timeout, a closed tab) cancels the
    answer as a stream's disconnect does, instead of leaving it to hold a place on the engine."""
    collecting = asyncio.ensure_future(_collect(session))
    while not collecting.done():
        await asyncio.wait({collecting}, timeout=DISCONNECT_POLL_S)
        gone = not collecting.done() and await request.is_disconnected()
        if gone:
            collecting.cancel()  # `events` cancels the session on its way out
            with contextlib.suppress(asyncio.CancelledError):
                await collecting
            raise HTTPException(CLIENT_CLOSED_REQUEST, detail="the client closed the request")
    return collecting.result()


async def _collect(session: AnswerSession) -> str:
    parts: list[str] = []
    try:
        async for event in events(session):
            if not isinstance(event, DoneEvent):
                parts.append(event.text)
    except HTTPException:
        raise
    except Exception as err:
        raise http_error(err) from err
    return "".join(parts)


def sources_and_summary(session: AnswerSession, done: DoneEvent) -> dict[str, Any]:
    """What both APIs report beside the text: the sources, the drops, timings and tier hits."""
    return {"sources": session.sources(), "dropped": session.retrieval.dropped, **done.summary()}
