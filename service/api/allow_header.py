"""405 answers whose `Allow` names every method the path is served with.

Starlette's router answers a method it has no route for with the methods of the first route whose path matched
(`GET` for `/documents/x`, though `DELETE` is served there too). This middleware asks every route of the app,
as routing would, which methods it serves the path with, and puts them all in `Allow`.
"""

from __future__ import annotations

from starlette.datastructures import MutableHeaders
from starlette.routing import Match, Mount
from starlette.types import ASGIApp, Message, Receive, Scope, Send

METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")


class AllowHeader:
    """ASGI middleware: on a 405, `Allow` lists the methods of every route matching the path."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_allow(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] == 405:
                methods = allowed_methods(scope)
                if methods:
                    MutableHeaders(scope=message)["Allow"] = ", ".join(methods)
            await send(message)

        await self.app(scope, receive, send_with_allow)


def allowed_methods(scope: Scope) -> list[str]:
    """The methods served at the request's path, sorted: those for which some route matches fully, asked of the
    app's routes as routing asks them (included routers answer for the routes they hold)."""
    # A mount (the chat page's files) matches its whole subtree for every method: its app answers for itself.
    routes = [route for route in scope["app"].router.routes if not isinstance(route, Mount)]
    return [
        method
        for method in METHODS
        if any(route.matches({**scope, "method": method})[0] is Match.FULL for route in routes)
    ]
