"""The API key, checked from the request's headers before anything reads its body.

A plain ASGI middleware in front of routing: a route's dependency would run only after FastAPI has read and parsed
the body, so an unauthenticated client could make the server take a whole upload (or see its JSON refused with a 422)
before hearing 401. Here the refusal comes first, and a refused request that still has a body to send gets
`Connection: close`, so the server never reads that body.

Open to everyone: the probes and Prometheus (`/health`, `/healthz`, `/readyz`, `/metrics`), and the chat page with
its files (it asks for the key itself). Everything else, `/openapi.json` included, needs
`Authorization: Bearer <KVSTITCH_API_KEY>` when a key is set. Under /v1 the refusal comes in OpenAI's error shape.
"""

from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from service.api.openai_errors import error_body

OPEN_PATHS = frozenset({"/", "/health", "/healthz", "/readyz", "/metrics"})
OPEN_PREFIXES = ("/static/",)
MESSAGE = "missing or wrong API key: send Authorization: Bearer <KVSTITCH_API_KEY>"


class ApiKeyGuard:
    """ASGI middleware: 401 for a request without the right bearer token, before its body is read."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.expected = api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.expected is None or _is_open(scope) or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        await _refusal(scope)(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        assert self.expected is not None
        scheme, _, token = _header(scope, b"authorization").partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.expected)


def _is_open(scope: Scope) -> bool:
    path = _app_path(scope)
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)


def _app_path(scope: Scope) -> str:
    """The path below the app's mount point (a proxy's prefix, `root_path`, is not the app's)."""
    path, root = str(scope["path"]), str(scope.get("root_path", ""))
    return (path[len(root) :] if root and path.startswith(root) else path) or "/"


def _refusal(scope: Scope) -> JSONResponse:
    path = _app_path(scope)
    under_v1 = path == "/v1" or path.startswith("/v1/")
    body = error_body(401, MESSAGE, None) if under_v1 else {"detail": MESSAGE}
    headers = {"WWW-Authenticate": "Bearer"}
    if _has_body(scope):  # not read: the connection cannot carry another request after it
        headers["Connection"] = "close"
    return JSONResponse(body, status_code=401, headers=headers)


def _has_body(scope: Scope) -> bool:
    length = _header(scope, b"content-length")
    return bool(_header(scope, b"transfer-encoding")) or (length not in (b"", b"0"))


def _header(scope: Scope, name: bytes) -> bytes:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return b""
