"""What `/ask` and `/v1/chat/completions` share: opening an answer before any byte is sent, and the whole answer
for the non-streaming forms.

`open_answer` checks the request and awaits `Facade.answer`, which refuses a request (422, 503) before the first
event, so those refusals become proper HTTP statuses. A stream then yields the answer's events; leaving its
iteration early (the client went away) cancels the answer in the service.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from fastapi import HTTPException, Request

from service.api.deps import http_error
from service.facade import AnswerStream, Facade
from service.facade.types import AnswerLimits, AnswerRequest, DoneEvent

# How often a non-streaming answer checks that its client is still there.
DISCONNECT_POLL_S = 0.25
# nginx's status for a request its client gave up on (never seen by that client; shows in the request metrics).
CLIENT_CLOSED_REQUEST = 499


async def open_answer(facade: Facade, build: Callable[[AnswerLimits], AnswerRequest]) -> AnswerStream:
    """The request checked within the deployment's limits (`build`, as `validation.answer_request` does), then
    admitted and retrieved; raises HTTPException (422/503) before streaming starts."""
    try:
        return await facade.answer(build(facade.limits.answer))
    except Exception as err:
        raise http_error(err) from err


async def collect_text(stream: AnswerStream, request: Request) -> str:
    """The whole answer, for the non-streaming forms; errors while generating become HTTP errors (nothing was
    sent yet).

    The client is watched while the answer is made: one that went away (a timeout, a closed tab) cancels the
    answer as a stream's disconnect does, instead of leaving it to hold a place on the engine."""
    collecting = asyncio.ensure_future(_collect(stream))
    while not collecting.done():
        await asyncio.wait({collecting}, timeout=DISCONNECT_POLL_S)
        gone = not collecting.done() and await request.is_disconnected()
        if gone:
            collecting.cancel()  # the stream cancels the answer on its way out
            with contextlib.suppress(asyncio.CancelledError):
                await collecting
            raise HTTPException(CLIENT_CLOSED_REQUEST, detail="the client closed the request")
    return collecting.result()


async def _collect(stream: AnswerStream) -> str:
    parts: list[str] = []
    try:
        async for event in stream:
            if not isinstance(event, DoneEvent):
                parts.append(event.text)
    except HTTPException:
        raise
    except Exception as err:
        raise http_error(err) from err
    return "".join(parts)


# What an answer whose filter matched no chunk says beside its empty sources (the model answered without them).
NO_MATCH_NOTE = "no chunk matches the filter: the answer has no sources"


def sources_and_summary(stream: AnswerStream, done: DoneEvent, filtered: bool = False) -> dict[str, Any]:
    """What both APIs report beside the text: the sources, the drops, timings and tier hits (and the note of a
    filter that matched nothing)."""
    return {"sources": stream.sources, "dropped": stream.dropped, **done.summary(), **filter_note(stream, filtered)}


def filter_note(stream: AnswerStream, filtered: bool) -> dict[str, str]:
    """`{"note": ...}` when the request's filter matched no chunk, else nothing."""
    return {"note": NO_MATCH_NOTE} if filtered and not stream.sources and not stream.dropped else {}
