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
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from service.api.deps import field_error, http_error
from service.facade.engine import (
    MAX_CHUNK_TOKENS,
    MAX_CHUNKS,
    EngineAnswer,
    EngineFacade,
    error_line,
    event_line,
    parse_answer_request,
)
from service.facade.errors import UnavailableError

MAX_BODY_BYTES = 64 << 20  # 64 chunks of 64K token ids as JSON fit well within it
MAX_TIER_KEYS = 10_000
NDJSON = "application/x-ndjson"


def engine_server_options() -> tuple[str, str]:
    """uvicorn's event loop and HTTP parser (`loop`, `http`) for an engine: uvloop and httptools where installed
    (dependencies, but uvloop has no Windows build), else asyncio and h11. The engine's event loop shares the GIL
    with the engine thread, and with h11 and asyncio it took as much of it as the engine thread's own host work
    under load: every running answer sends a line per token. (The public gateway keeps its guarded h11 protocol,
    `service.api.connections`: its bounds on slow and half-open clients are built on it.)"""
    loop = "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"
    http = "httptools" if importlib.util.find_spec("httptools") is not None else "h11"
    return loop, http


def create_engine_app(engine: EngineFacade) -> FastAPI:
    """The engine's app; its start-up (model, gate, publisher) begins in the background when the server starts."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.close()

    app = FastAPI(title="kvstitch engine", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)

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

    @app.post("/answer", response_model=None)
    async def answer(request: Request) -> Any:
        """Stream the answer to an already-retrieved question as JSON lines."""
        try:
            parsed = parse_answer_request(await _json(request))
        except ValueError as err:
            raise field_error("body", str(err)) from err
        try:
            stream = await engine.answer(parsed)
        except Exception as err:
            raise http_error(err) from err
        return StreamingResponse(_lines(stream), media_type=NDJSON)

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


async def _lines(stream: EngineAnswer) -> AsyncIterator[bytes]:
    """The answer's events as lines; an error after the start becomes an `error` line (the status is sent). A gateway
    that closes the connection ends the iteration, which cancels the answer."""
    try:
        async for event in stream:
            yield event_line(event)
    except UnavailableError as err:
        yield error_line(str(err))
    except Exception as err:
        yield error_line(f"generation failed: {type(err).__name__}: {err}")
    finally:
        stream.cancel()
