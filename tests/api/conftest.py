"""Fixtures of the HTTP tests: the real app over the tiny Qwen2 model, real MiniLM and local Qdrant, through
Starlette's TestClient (httpx, lifespan included) or a real uvicorn server on a free port."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from app_server import LiveServer, MakeApp, wait_ready
from fastapi import FastAPI
from fastapi.testclient import TestClient

from service.api.app import create_app
from service.engine.engine import StitchEngine
from service.engine.model import load_model
from service.retrieval.embedder import Embedder
from service.serving.server import Server
from service.settings import Settings
from workers.worker import in_process_worker

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


@pytest.fixture(scope="session")
def api_embedder() -> Embedder:
    return Embedder()


@pytest.fixture
def make_app(
    tmp_path: Path,
    tiny_model_dirs: dict[str, Path],
    get_engine: Callable[[str, str], StitchEngine],
    api_embedder: Embedder,
) -> MakeApp:
    """An app on a fresh data dir; keyword arguments override settings."""
    apps = itertools.count()

    def make(**overrides: Any) -> FastAPI:
        settings = Settings(
            data_dir=tmp_path / f"data-{next(apps)}",  # embedded Qdrant: one app per folder
            **{"model": str(tiny_model_dirs["qwen2"]), **API_SETTINGS, **overrides},
        )
        server = Server(settings, get_engine("qwen2", "cpu"), api_embedder, worker_factory=in_process_worker)
        return create_app(server)

    return make


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


@pytest.fixture(scope="module")
def make_module_app(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dirs: dict[str, Path], api_embedder: Embedder
) -> MakeApp:
    """Like `make_app`, for an app that serves a whole module (its own engine: `get_engine` is per test)."""
    engine = StitchEngine(load_model(tiny_model_dirs["qwen2"], device="cpu"))

    def make(**overrides: Any) -> FastAPI:
        settings = Settings(
            model=str(tiny_model_dirs["qwen2"]),
            data_dir=tmp_path_factory.mktemp("module-app"),
            **{**API_SETTINGS, **overrides},
        )
        return create_app(Server(settings, engine, api_embedder, worker_factory=in_process_worker))

    return make


@pytest.fixture(scope="module")
def module_client(make_module_app: MakeApp) -> Iterator[TestClient]:
    """One embedded app for a whole module, for tests that only send requests it refuses (nothing is stored), so
    dozens of cases do not each pay for a start-up."""
    app = make_module_app()
    with TestClient(app) as test_client:
        wait_ready(app)
        yield test_client


@pytest.fixture
def live_server(make_app: MakeApp) -> Callable[..., LiveServer]:
    return lambda **overrides: LiveServer(make_app(**overrides))
