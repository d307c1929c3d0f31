"""Fixtures of the ingestion tests: a runtime over the tiny Qwen2 model, real MiniLM, local Qdrant, and either
the embedded form (SQLite index, in-process queue) or the distributed one (Redis index, stream and statuses)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from service.engine.engine import StitchEngine
from service.retrieval.embedder import Embedder
from service.serving.runtime import Runtime, open_runtime
from service.settings import Settings

# Small chunks, so a few paragraphs make several chunks and batches.
TEST_SETTINGS: dict[str, Any] = {
    "chunk_size": 48,
    "chunk_overlap": 8,
    "max_precompute_tokens": 256,
    "gpu_cache_mb": 0,
    "host_cache_mb": 4,
    "disk_cache_mb": 512,
    "device": "cpu",
    "job_claim_idle_ms": 200,
}


@pytest.fixture(scope="session")
def worker_embedder() -> Embedder:
    return Embedder()


@pytest.fixture(params=["embedded", "redis"])
def backend(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The settings that pick the embedded or the Redis form."""
    if request.param == "embedded":
        return {}
    return {"redis_url": request.getfixturevalue("redis_url"), "redis_prefix": request.getfixturevalue("redis_prefix")}


OpenRuntime = Callable[..., Runtime]


@pytest.fixture
def open_test_runtime(
    tmp_path: Path,
    tiny_model_dirs: dict[str, Path],
    get_engine: Callable[[str, str], StitchEngine],
    worker_embedder: Embedder,
    backend: dict[str, Any],
) -> Iterator[OpenRuntime]:
    """Opens runtimes on one data dir (closing the previous one: embedded Qdrant allows one client)."""
    opened: list[Runtime] = []

    def open_one(**overrides: Any) -> Runtime:
        for runtime in opened:
            runtime.close()
        settings = Settings(
            model=str(tiny_model_dirs["qwen2"]), data_dir=tmp_path / "data", **{**TEST_SETTINGS, **backend, **overrides}
        )
        runtime = open_runtime(settings, engine=get_engine("qwen2", "cpu"), embedder=worker_embedder)
        opened.append(runtime)
        return runtime

    yield open_one
    for runtime in opened:
        runtime.close()


@pytest.fixture
def runtime(open_test_runtime: OpenRuntime) -> Runtime:
    return open_test_runtime()
