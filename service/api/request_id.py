"""`X-Request-Id` on every answer, and one log line per request that carries it.

The client's id is kept when it is 1 to MAX_CHARS characters of a plain charset (letters, digits, `.`, `_`, `:`,
`-`), so it can go into a log line or a header unescaped; any other (or none) is replaced by a generated one. Routes
read it as `request.state.request_id`. A plain ASGI middleware for the reason `request_metrics.py` gives.
"""

from __future__ import annotations

import logging
import re
import time
import uuid

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("kvstitch.requests")

HEADER = b"x-request-id"
MAX_CHARS = 128
VALID = re.compile(rf"[A-Za-z0-9._:-]{{1,{MAX_CHARS}}}")


def request_id_of(request: Request) -> str:
    """The id the middleware gave this request (a route behind it always has one)."""
    return str(request.state.request_id)


def chosen_id(sent: bytes | None) -> str:
    """The client's id when it is valid, a generated one otherwise."""
    if sent is not None:
        text = sent.decode("latin-1")
        if VALID.fullmatch(text):
            return text
    return uuid.uuid4().hex


class RequestId:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = next((value for name, value in scope["headers"] if name == HEADER), None)
        request_id = chosen_id(sent)
        scope.setdefault("state", {})["request_id"] = request_id
        status = 500  # what the server answers when the app raises before starting a response
        began = time.perf_counter()

        async def tagged_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != HEADER]
                message = {**message, "headers": [*headers, (HEADER, request_id.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, tagged_send)
        finally:
            client = scope.get("client")
            where = f"{client[0]}:{client[1]}" if client else "-"
            elapsed_ms = (time.perf_counter() - began) * 1000
            log.info(
                '%s "%s %s" %d %.1f ms request_id=%s',
                where,
                scope["method"],
                scope["path"],
                status,
                elapsed_ms,
                request_id,
            )
