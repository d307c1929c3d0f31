"""The FastAPI app factory: routes, the chat page, request metrics, and the service's start and stop.

The app sees the service only through its facade (`service.facade.Facade`); the entry point builds the service
(`kvstitch serve`: `service.server.Server` with the in-process worker when the form needs one) and hands it here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request, Response
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException

from service.api.body_limit import BodyLimit
from service.api.request_metrics import RequestCounter
from service.api.routes import ask, documents, health, ingest, ingest_files, openai
from service.api.validation import safe_errors
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

    app = FastAPI(title="kvstitch", version="0.1.0", lifespan=lifespan)
    app.state.facade = facade
    for module in (health, ingest, ingest_files, documents, ask, openai):
        app.include_router(module.router)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    @app.get("/", include_in_schema=False)
    def chat_page() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html")

    _openai_errors(app)

    # Added before the counter below, so it runs inside it: refused bodies are counted under their route as 413s.
    limit_bytes = facade.limits.max_request_bytes
    detail = f"request body larger than {limit_bytes >> 20} MiB (KVSTITCH_MAX_REQUEST_MB)"
    app.add_middleware(BodyLimit, max_bytes=limit_bytes, detail=detail)

    app.add_middleware(RequestCounter, count=facade.count_request)

    return app


def _openai_errors(app: FastAPI) -> None:
    """Under /v1, errors look like OpenAI's (`{"error": {"message", "type", "param", "code"}}`), which is what
    OpenAI clients read; elsewhere FastAPI's own `{"detail": ...}` stays."""

    def openai_body(status_code: int, message: str, param: str | None) -> JSONResponse:
        error = {"message": message, "type": "invalid_request_error", "param": param, "code": status_code}
        return JSONResponse({"error": error}, status_code=status_code)

    # Starlette's HTTPException, the parent of FastAPI's: FastAPI raises the parent itself for a body it cannot
    # parse (400), and so does routing (404, 405), and those must come in OpenAI's shape under /v1 too.
    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        if not request.url.path.startswith("/v1/"):
            return await http_exception_handler(request, exc)
        message, param = _message_of(exc.detail)
        reply = openai_body(exc.status_code, message, param)
        reply.headers.update(exc.headers or {})
        return reply

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        # FastAPI's own handler echoes the refused input, which may be NaN or a lone surrogate: a 500 from the
        # JSON encoder instead of the 422. These errors are made writable first.
        errors = safe_errors(exc.errors())
        if not request.url.path.startswith("/v1/"):
            return JSONResponse({"detail": errors}, status_code=422)
        message, param = _message_of(errors)
        return openai_body(422, message, param)


def _message_of(detail: object) -> tuple[str, str | None]:
    """A readable message (and the field) from a FastAPI detail: a string or a list of {loc, msg}."""
    if isinstance(detail, list) and detail and isinstance(detail[0], dict):
        first = detail[0]
        field = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return "; ".join(f"{'.'.join(map(str, e.get('loc', ())[1:]))}: {e.get('msg')}" for e in detail), field
    return str(detail), None
