"""The FastAPI app factory: routes, the chat page, request metrics, and the service's start and stop.

The app sees the service only through its facade (`service.facade.Facade`); the entry point builds the service
(`kvstitch serve`: `service.serving.server.Server`, with the in-process worker when the form needs one) and hands it
here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from service.api import openai_errors
from service.api.allow_header import AllowHeader
from service.api.auth import ApiKeyGuard
from service.api.body_limit import BodyLimit
from service.api.request_id import RequestId
from service.api.request_metrics import RequestCounter
from service.api.routes import ask, documents, health, ingest, ingest_files, openai, retrieve
from service.api.security_headers import SecurityHeaders
from service.facade import Facade

STATIC_DIR = Path(__file__).parent / "static"


def create_app(facade: Facade) -> FastAPI:
    """The app; the service's start-up (model, gate, worker) begins in the background when the server starts."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        facade.start()
        try:
            yield
        finally:
            facade.close()

    # No /docs or /redoc: FastAPI's pages load their scripts from a CDN, which an offline deployment cannot reach
    # and the pages' security policy refuses; /openapi.json (behind the key) feeds any OpenAPI viewer instead.
    app = FastAPI(title="kvstitch", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.facade = facade
    for module in (health, ingest, ingest_files, documents, ask, retrieve, openai):
        app.include_router(module.router)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    @app.get("/", include_in_schema=False)
    def chat_page() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html")

    openai_errors.install(app)
    openai.document_v1(app, [facade.model_name, *facade.model_aliases])

    # The last added runs first. Each one added before the counter runs inside it: refused requests (401, 413) are
    # counted under their route. The key is checked before the body limit so that nothing of an unauthenticated
    # body is read.
    app.add_middleware(AllowHeader)
    limit_bytes = facade.limits.max_request_bytes
    detail = f"request body larger than {limit_bytes >> 20} MiB (KVSTITCH_MAX_REQUEST_MB)"
    app.add_middleware(BodyLimit, max_bytes=limit_bytes, detail=detail)
    app.add_middleware(ApiKeyGuard, api_key=facade.limits.api_key)
    app.add_middleware(SecurityHeaders)

    app.add_middleware(RequestCounter, count=facade.count_request)
    # Outermost: every answer, refusals included, carries the request's id, and its log line is written here.
    app.add_middleware(RequestId)

    return app
