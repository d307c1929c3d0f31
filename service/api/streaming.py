"""From an HTTP request to a stream of answer events, shared by `/ask` and `/v1/chat/completions`.

`open_answer` asks the facade for an admitted, retrieved question before any byte is sent, so its failures
become proper HTTP statuses (422, 503). `events` then starts generation (on the service's engine loop) and
hands each event to the event loop as it is made. When the client goes away the consumer stops iterating and
`events` cancels the session: the engine stops at the next token and gives up the place in line.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import HTTPException
from fastapi.concurrency import run_in_threadpool

from service.answer import DoneEvent, TokenEvent
from service.api.deps import http_error
from service.facade import AnswerItem, AnswerRequest, AnswerSession, Facade


async def open_answer(facade: Facade, request: AnswerRequest) -> AnswerSession:
    """Check, admit and retrieve; raises HTTPException (422/503) before streaming starts."""
    try:
        return await run_in_threadpool(facade.open_answer, request)
    except Exception as err:
        raise http_error(err) from err


async def events(session: AnswerSession) -> AsyncIterator[TokenEvent | DoneEvent]:
    """Token events, then the done event; errors raised in the engine are raised here. Leaving the iteration
    early (the client went away) cancels the session."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[AnswerItem] = asyncio.Queue()

    def listener(item: AnswerItem) -> None:  # runs on the engine thread
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
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


async def collect_text(session: AnswerSession) -> str:
    """The whole answer, for the non-streaming forms; engine errors become HTTP errors (nothing was sent yet)."""
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
