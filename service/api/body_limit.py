"""A request body limit enforced while the body is read, whether or not its length is declared.

A `Content-Length` over the limit is refused at the first read, before a byte of the body is taken (so a client
sending `Expect: 100-continue` is never asked for it). A chunked body has no declared length: its
`http.request` messages are counted as they arrive and the read fails as soon as the count passes the limit, so
a huge upload costs one limit's worth of memory, not its whole size.

The refusal is an `HTTPException(413)` raised from `receive`: FastAPI passes HTTP exceptions from a body read
through to the app's handlers (which answer in the route's error shape, OpenAI's under /v1). Anything else
that reads the body and lets the exception out gets a plain 413 here, if no response has started.
"""

from __future__ import annotations

from fastapi import HTTPException, status
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyTooLarge(HTTPException):
    def __init__(self, detail: str) -> None:
        super().__init__(status.HTTP_413_CONTENT_TOO_LARGE, detail=detail)


class BodyLimit:
    """ASGI middleware: 413 for a request body over `max_bytes`, declared or counted."""

    def __init__(self, app: ASGIApp, max_bytes: int, detail: str) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.detail = detail

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _declared_length(scope)
        received = 0
        started = False

        async def counted_receive() -> Message:
            nonlocal received
            if declared is not None and declared > self.max_bytes:
                raise BodyTooLarge(self.detail)
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.detail)
            return message

        async def watched_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, watched_send)
        except BodyTooLarge as refused:
            if started:
                raise
            await JSONResponse({"detail": refused.detail}, status_code=refused.status_code)(scope, receive, send)


def _declared_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
