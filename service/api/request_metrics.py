"""Counting every HTTP request by route template and status, as a plain ASGI middleware.

A plain ASGI middleware, not Starlette's `@app.middleware("http")`: that one runs the route behind a task group
whose cancellation-checked `receive` hides the client's disconnect from `Request.is_disconnected()`, so a
non-streaming answer could not notice its client giving up; it also costs a task per request.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class RequestCounter:
    """Calls `count(route template, status)` once per HTTP request: the route's template, a mounted app's path
    (`/static` for the chat page's files), or `unmatched` when nothing matched."""

    def __init__(self, app: ASGIApp, count: Callable[[str, int], None]) -> None:
        self.app = app
        self.count = count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # what the server answers when the app raises before starting a response
        root_path = scope.get("root_path", "")

        async def watched_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, watched_send)
        finally:
            # The route's template (`/ingest/{job_id}`), not the raw path, so label values stay few.
            self.count(route_label(scope, root_path), status)


def route_label(scope: Scope, root_path: str) -> str:
    """The template of the route that answered. A mount (StaticFiles) leaves no route in the scope, but routing
    extends `root_path` by the mount's path, so what was added is the label."""
    route = getattr(scope.get("route"), "path", None)
    if route is not None:
        return str(route)
    mounted = str(scope.get("root_path", ""))
    if mounted != root_path and mounted.startswith(root_path):
        return mounted[len(root_path) :]
    return "unmatched"
