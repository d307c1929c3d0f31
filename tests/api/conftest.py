"""Fixtures of the HTTP tests: the real app over the tiny Qwen2 model, real MiniLM and local Qdrant, through
Starlette's TestClient (httpx, lifespan included) or a real uvicorn server on a free port."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient

from service.api.app import create_app
from service.api.gateway import Gateway
from service.engine.engine import StitchEngine
from service.retrieval.embedder import Embedder
from service.settings import Settings

API_SETTINGS: dict[str, Any] = {
    "chunk_size": 48,
    "chunk_overlap": 8,
    "max_precompute_tokens": 256,
    "gpu_cache_mb": 0,
    "host_cache_mb": 8,
    "disk_cache_mb": 512,
    "device": "cpu",
    "max_question_chars": 500,
    "max_new_tokens_limit": 1024,
    "default_max_new_tokens": 16,
    "max_document_chars": 5000,
}
READY_TIMEOUT_S = 120


@pytest.fixture(scope="session")
def api_embedder() -> Embedder:
    return Embedder()


MakeApp = Callable[..., FastAPI]


@pytest.fixture
def make_app(
    tmp_path: Path,
    tiny_model_dirs: dict[str, Path],
    get_engine: Callable[[str, str], StitchEngine],
    api_embedder: Embedder,
) -> MakeApp:
    """An app on a fresh data dir; keyword arguments override settings."""

    def make(**overrides: Any) -> FastAPI:
        settings = Settings(
            model=str(tiny_model_dirs["qwen2"]), data_dir=tmp_path / "data", **{**API_SETTINGS, **overrides}
        )
        return create_app(settings, engine=get_engine("qwen2", "cpu"), embedder=api_embedder)

    return make


def gateway_of(app: FastAPI) -> Gateway:
    gateway: Gateway = app.state.gateway
    return gateway


def wait_ready(app: FastAPI) -> None:
    gateway = gateway_of(app)
    assert gateway.started.wait(READY_TIMEOUT_S), "the gateway did not finish starting"
    assert gateway.ready, f"the gateway failed to start: {gateway.startup_error}"


@pytest.fixture(params=["embedded", "redis"])
def client(request: pytest.FixtureRequest, make_app: MakeApp) -> Iterator[TestClient]:
    """The app in the embedded form, and with Redis (index, ingest stream, job status; Qdrant stays local, so the
    gateway runs the worker itself)."""
    backend: dict[str, Any] = {}
    if request.param == "redis":
        backend = {
            "redis_url": request.getfixturevalue("redis_url"),
            "redis_prefix": request.getfixturevalue("redis_prefix"),
        }
    app = make_app(**backend)
    with TestClient(app) as test_client:
        wait_ready(app)
        yield test_client


class LiveServer:
    def __init__(self, app: FastAPI) -> None:
        self.app = app
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"the live server did not become ready: {gateway_of(self.app).readiness()}")

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture
def live_server(make_app: MakeApp) -> Callable[..., LiveServer]:
    return lambda **overrides: LiveServer(make_app(**overrides))
