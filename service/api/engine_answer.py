"""`POST /answer` of an engine's internal API as a plain ASGI app, under the engine's FastAPI app (`engine_app`).

Every running answer streams a line per token, and the engine's event loop shares the GIL with the engine thread:
FastAPI's request machinery (dependency resolution, the response model) and `StreamingResponse` (an anyio task group
per response, a cancel scope and a timeout per line) cost that loop as much as the answer's own work. Here a request
is read, checked and answered with the same statuses and bodies the framework gave (`http_error`),
and the lines go to `send` directly; a watcher on `receive` cancels the answer when the gateway goes away, as
`StreamingResponse` did.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any, Protocol

from fastapi import HTTPException

from service.api.deps import http_error
from service.facade.engine import EngineAnswer, EngineFacade, event_line, failure_line, parse_answer_body

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

MAX_BODY_BYTES = 64 << 20  # 64 chunks of 64K token ids as JSON fit well within it
NDJSON = b"application/x-ndjson"


class Cancellable(Protocol):
    def cancel(self) -> None: ...


# An admitted answer and its response bodies, from the request's body; HTTPException for a refusal.
Admit = Callable[[bytes], Awaitable[tuple[Cancellable, AsyncIterator[bytes]]]]


class AnswerRoute:
    """The ASGI app of `POST /answer` over `engine` (the router checks the method and path)."""

    def __init__(self, engine: EngineFacade) -> None:
        self._engine = engine

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        await answer_request(receive, send, self._admit)

    async def _admit(self, body: bytes) -> tuple[EngineAnswer, AsyncIterator[bytes]]:
        try:
            stream = await self._engine.answer(parse_answer_body(body))
        except Exception as err:
            raise http_error(err) from err
        return stream, _lines(stream)


async def answer_request(receive: Receive, send: Send, admit: Admit) -> None:
    """`POST /answer` as both forms of the engine's API answer it: the body read (413 past `MAX_BODY_BYTES`), the
    answer admitted by `admit` or refused with its status, then its bodies streamed."""
    try:
        answer, bodies = await admit(await read_body(receive))
    except HTTPException as refused:
        await refuse(send, refused)
        return
    await stream_bodies(receive, send, answer, bodies)


async def stream_bodies(receive: Receive, send: Send, answer: Cancellable, bodies: AsyncIterator[bytes]) -> None:
    """An admitted answer's response: 200, then `bodies` as they come; `answer` cancelled when the gateway goes away
    (a watcher on `receive`) and once the response ends, however it ends."""
    watcher = asyncio.create_task(cancel_on_disconnect(receive, answer))
    try:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", NDJSON)]})
        async for body in bodies:
            await send({"type": "http.response.body", "body": body, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    except OSError:  # the gateway went away mid-answer (uvicorn's ClientDisconnected): nobody to tell
        pass
    finally:
        watcher.cancel()
        answer.cancel()


async def read_body(receive: Receive) -> bytes:
    """The whole request body; HTTPException 413 past MAX_BODY_BYTES, 400 when the client left first."""
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise HTTPException(400, detail="the client went away before its request arrived")
        part = message.get("body", b"")
        size += len(part)
        if size > MAX_BODY_BYTES:
            raise HTTPException(413, detail=f"request body larger than {MAX_BODY_BYTES >> 20} MiB")
        parts.append(part)
        if not message.get("more_body", False):
            return b"".join(parts)


async def refuse(send: Send, refused: HTTPException) -> None:
    """A refusal as FastAPI's own handler writes an HTTPException: its status, headers and `{"detail": ...}`."""
    body = json.dumps({"detail": refused.detail}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in (refused.headers or {}).items()]
    await send({"type": "http.response.start", "status": refused.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def cancel_on_disconnect(receive: Receive, stream: Cancellable) -> None:
    """Cancel the answer once the gateway disconnects (it gave up on the answer)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    stream.cancel()


async def _lines(stream: EngineAnswer) -> AsyncIterator[bytes]:
    """The answer's events as lines; an error after the start becomes an `error` line (the status is sent)."""
    try:
        async for event in stream:
            yield event_line(event)
    except Exception as err:
        yield failure_line(err)
