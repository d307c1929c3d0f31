"""An engine that costs nothing, for measuring the gateway alone (`loadtest.bench_gateway`).

`CannedEngine` is an `EngineFacade` served by `kvstitch engine`'s own app (`service.api.engine_app`: the same routes
and JSON-lines encoder): always ready, in the key space it is given (the gateway's, so the gateway routes to it),
every chunk "on its GPU", and every question answered with `tokens` copies of `CANNED_TOKEN`, at once or one every
`token_interval_s`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import uvicorn

from service.api.engine_app import create_engine_app, engine_server_options
from service.facade.engine import ENGINE_KEEP_ALIVE_S, EngineAnswerRequest
from service.facade.types import AnswerEvent, DoneEvent, TokenEvent
from service.kvcache.keys import KeySpace

CANNED_TOKEN = " token"


@dataclass(frozen=True)
class CannedConfig:
    key_space: dict[str, str]  # the gateway's, so it routes here
    tokens: int
    token_interval_s: float


class CannedAnswer:
    """An answer of `tokens` canned tokens, all at once or one per interval."""

    def __init__(self, request: EngineAnswerRequest, config: CannedConfig) -> None:
        self._request = request
        self._config = config

    def __aiter__(self) -> AsyncIterator[AnswerEvent]:
        return self._events()

    async def _events(self) -> AsyncIterator[AnswerEvent]:
        tokens = min(self._config.tokens, self._request.max_new_tokens)
        began, first_at = time.perf_counter(), None
        for _ in range(tokens):
            if self._config.token_interval_s > 0:
                await asyncio.sleep(self._config.token_interval_s)
            first_at = first_at or time.perf_counter()
            yield TokenEvent(CANNED_TOKEN)
        yield self._done(tokens, (first_at - began) * 1e3 if first_at else 0.0)

    def _done(self, tokens: int, ttft_ms: float) -> DoneEvent:
        context = sum(len(c.token_ids) for c in self._request.chunks)
        return DoneEvent(
            mode=self._request.mode,
            positions=self._request.positions,
            ttft_ms=ttft_ms,  # as an engine reports it: its own, from the answer's start there
            output_tokens=tokens,
            finish_reason="length",
            timings_ms={"queue": 0.0, "prefill": 0.0, "decode": 0.0},
            kv={"gpu": len(self._request.chunks), "host": 0, "disk": 0, "miss": 0},
            answer=CANNED_TOKEN * tokens,
            prompt_tokens=context + 16,
            context_tokens=context,
        )

    def cancel(self) -> None:
        pass  # nothing runs between its events


class CannedEngine:
    """`EngineFacade` that is always ready, holds every chunk on its "GPU" and answers at once."""

    def __init__(self, config: CannedConfig, url: str) -> None:
        self.config = config
        self.url = url

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass

    def readiness(self) -> dict[str, Any]:
        return {"ready": True, "checks": {"startup": "ok"}, "engine_id": "canned"}

    def info(self) -> dict[str, Any]:
        space = KeySpace(**self.config.key_space)
        return {
            "engine_id": "canned",
            "url": self.url,
            "model": "canned",
            "ready": True,
            "key_space": {**asdict(space), "digest": space.digest()},
            **self.load(),
        }

    def load(self) -> dict[str, int]:
        return {"running": 0, "waiting": 0}

    def tiers(self, limit: int) -> dict[str, Any]:
        return {tier: {"blocks": 0, "keys": []} for tier in ("gpu", "host", "disk")}

    async def answer(self, request: EngineAnswerRequest) -> CannedAnswer:
        return CannedAnswer(request, self.config)

    async def precompute(self, chunks: Sequence[Sequence[int]]) -> dict[str, int]:
        return {"gpu": len(chunks), "host": 0, "disk": 0, "miss": 0}

    def metrics_text(self) -> bytes:
        return b""


def serve_canned_engine(config: CannedConfig, port: int) -> None:
    """The canned engine's process: its API on 127.0.0.1:`port` until terminated."""
    serve_engine_app(create_engine_app(CannedEngine(config, f"http://127.0.0.1:{port}")), port)


def serve_engine_app(app: Any, port: int) -> None:
    """An engine's app on 127.0.0.1:`port`, served as `kvstitch engine` serves it, until terminated."""
    loop, http = engine_server_options()
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        access_log=False,
        timeout_keep_alive=ENGINE_KEEP_ALIVE_S,
        loop=loop,
        http=http,
    )
