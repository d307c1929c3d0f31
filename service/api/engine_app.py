"""`kvstitch engine`'s internal HTTP API: what a gateway calls, never a client (no key, no chat page).

- `POST /answer`: an already-retrieved question (`service.facade.engine.EngineAnswerRequest`); the answer as JSON
  lines (`token`..., then `done` or `error`). Refusals come before the first byte as statuses: 422 (bad request),
  503 + Retry-After (busy, not ready), so a gateway can retry elsewhere what never started.
- `POST /precompute`: `{"chunks": [[token ids], ...]}` brought into this engine's tiers.
- `GET /info`, `/load`, `/tiers`: identity and key space, running/waiting answers, blocks per tier.
- `GET /healthz` (alive), `/readyz` (model loaded, gate passed), `/metrics` (Prometheus).
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from service.api.deps import field_error, http_error
from service.api.engine_answer import MAX_BODY_BYTES, AnswerRoute
from service.facade.engine import MAX_CHUNK_TOKENS, MAX_CHUNKS, EngineFacade, EngineStatus

MAX_TIER_KEYS = 10_000


def engine_server_options() -> tuple[str, str]:
    """uvicorn's event loop and HTTP parser (`loop`, `http`) for an engine: uvloop and httptools where installed
    (dependencies, but uvloop has no Windows build), else asyncio and h11. The engine's event loop shares the GIL
    with the engine thread, and with h11 and asyncio it took as much of it as the engine thread's own host work
    under load: every running answer sends a line per token. (The public gateway keeps its guarded h11 protocol,
    `service.api.connections`: its bounds on slow and half-open clients are built on it.)"""
    loop = "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"
    http = "httptools" if importlib.util.find_spec("httptools") is not None else "h11"
    return loop, http


class EngineApp(FastAPI):
    """The engine's FastAPI app, except that `POST /answer` goes straight to its plain ASGI app (`engine_answer`).

    Every running answer streams a line per token, and each line sent through the framework's stack passes the
    send wrappers of its error middleware, a few coroutine calls apiece on the event loop that shares the GIL with
    the engine thread. The answer route handles its own errors, so it needs none of them.
    """

    def __init__(self, answer: ASGIApp, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._answer = answer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] == "/answer":
            await self._answer(scope, receive, send)
        else:
            await super().__call__(scope, receive, send)


def create_engine_app(engine: EngineFacade) -> FastAPI:
    """The engine's app; its start-up (model, gate, publisher) begins in the background when the server starts."""
    return engine_api(engine, AnswerRoute(engine))


def engine_api(engine: EngineStatus, answer: ASGIApp) -> FastAPI:
    """The engine's routes over `engine`, `POST /answer` answered by `answer` (in-process, or forwarded to the core
    process by the API process)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.close()

    app = EngineApp(answer, title="kvstitch engine", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        """The process is alive (it may still be loading the model)."""
        return {"status": "ok"}

    @app.get("/readyz")
    def readyz() -> Any:
        """Model loaded and gate passed; 503 naming what is not."""
        report = engine.readiness()
        return JSONResponse(report, status_code=200 if report["ready"] else 503)

    @app.get("/info")
    def info() -> dict[str, Any]:
        """Engine id, model, key space and load."""
        return engine.info()

    @app.get("/load")
    def load() -> dict[str, int]:
        """Answers running and waiting."""
        return engine.load()

    @app.get("/tiers")
    def tiers(limit: int = 1000) -> dict[str, Any]:
        """The blocks this engine holds per tier."""
        if not 0 <= limit <= MAX_TIER_KEYS:
            raise field_error("limit", f"0 to {MAX_TIER_KEYS}", where="query")
        return engine.tiers(limit)

    @app.get("/metrics")
    def metrics() -> Response:
        """Prometheus exposition."""
        return Response(engine.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    # EngineApp answers POST /answer itself; the route stays for what the router gives other methods (405)
    app.router.routes.append(Route("/answer", answer, methods=["POST"], include_in_schema=False))

    @app.post("/precompute")
    async def precompute(request: Request) -> dict[str, int]:
        """Bring chunks' KV into this engine's tiers; blocks by the tier they were found in."""
        body = await _json(request)
        chunks = body.get("chunks") if isinstance(body, dict) else None
        if not _token_lists(chunks):
            raise field_error("chunks", f"a list of at most {MAX_CHUNKS} lists of 1 to {MAX_CHUNK_TOKENS} token ids")
        try:
            return await engine.precompute(chunks)  # type: ignore[arg-type]
        except Exception as err:
            raise http_error(err) from err

    return app


async def _json(request: Request) -> Any:
    body = await request.body()
    if len(body) > MAX_BODY_BYTES:
        raise HTTPException(413, detail=f"request body larger than {MAX_BODY_BYTES >> 20} MiB")
    try:
        return json.loads(body)
    except ValueError as err:
        raise field_error("body", f"not JSON: {err}") from err


def _token_lists(value: Any) -> bool:
    if not isinstance(value, list) or not 0 < len(value) <= MAX_CHUNKS:
        return False
    return all(
        isinstance(ids, list)
        and 0 < len(ids) <= MAX_CHUNK_TOKENS
        and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 31 for t in ids)
        for ids in value
    )
