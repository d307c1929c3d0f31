"""The FastAPI app factory: routes, the chat page, request metrics, and the gateway's start and stop."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request, Response
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from service.api.gateway import Gateway
from service.api.routes import ask, health, ingest, openai
from service.engine.engine import StitchEngine
from service.retrieval.embedder import Embedder
from service.settings import Settings

STATIC_DIR = Path(__file__).parent / "static"


def create_app(
    settings: Settings | None = None, engine: StitchEngine | None = None, embedder: Embedder | None = None
) -> FastAPI:
    """The app; start-up (model, gate, worker) begins when the server starts it and runs in the background."""
    gateway = Gateway(settings or Settings(), engine, embedder)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        gateway.start_in_background()
        try:
            yield
        finally:
            gateway.close()

    app = FastAPI(title="kvstitch", version="0.1.0", lifespan=lifespan)
    app.state.gateway = gateway
    for module in (health, ingest, ask, openai):
        app.include_router(module.router)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    @app.get("/", include_in_schema=False)
    def chat_page() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html")

    @app.middleware("http")
    async def count_requests(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        response = await call_next(request)
        route = request.scope.get("route")
        path = getattr(route, "path", "unmatched")
        gateway.metrics.requests.labels(path, str(response.status_code)).inc()
        return response

    return app
