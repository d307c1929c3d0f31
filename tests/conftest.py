"""Shared fixtures: tiny random-weight models of each supported family, built once per session.

They are written with `save_pretrained` and loaded back through the production `load_model` path.
Where CUDA exists, engine tests also run in bf16 on the GPU (marked `gpu`).
"""

from __future__ import annotations

import gc
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from service.devtools.tiny_model import ARCHITECTURES, build_tiny_model
from service.engine.engine import StitchEngine
from service.engine.model import load_model
from service.kvcache.index import SqliteIndex
from service.kvcache.store import KVStore, TierBudgets
from service.serving.kv_source import kv_store_for

# The servers tests start must not freeze the test process's heap out of the garbage collector (every earlier
# test's leftovers would stay): the tests that check the freeze turn it on themselves.
os.environ.setdefault("KVSTITCH_GC_FREEZE", "false")
# Python's own youngest-generation threshold: a ready server in one test must not change the whole run's GC.
os.environ.setdefault("KVSTITCH_GC_GEN0_THRESHOLD", "700")
# Shadow answers are drawn at random (1 % of turbo answers by default): a server under test runs none unless the test
# asks (tests/api/test_api_shadow.py), so no test's engine steps or metrics change by chance.
os.environ.setdefault("KVSTITCH_SHADOW_SHARE", "0")
# Test prompts are a few hundred tokens: the servers tests start recompute them as asked, not by a full prefill
# (tests/test_engine_recompute.py checks that rule itself).
os.environ.setdefault("KVSTITCH_RECOMPUTE_FULL_BELOW", "0")
# The tests' own engines use the engine's default chunk context (alone); the servers and workers they start in
# other processes must precompute and key chunk KV the same way, or the tests' expected KV keys would not match.
# tests/test_engine_chunk_context.py and the CLI tests cover the served default (prefix).
os.environ.setdefault("KVSTITCH_CHUNK_CONTEXT", "alone")

HAS_CUDA = torch.cuda.is_available()
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device here")]),
]


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: build_tiny_model(arch, root / arch) for arch in ARCHITECTURES}


_ENGINES: dict[tuple[str, str], StitchEngine] = {}


def engine_for(dirs: dict[str, Path], arch: str, device: str) -> StitchEngine:
    """One engine per (arch, device) for the whole session: loading is the slow part."""
    key = (arch, device)
    if key not in _ENGINES:
        _ENGINES[key] = StitchEngine(load_model(dirs[arch], device=device))
    return _ENGINES[key]


@pytest.fixture
def get_engine(tiny_model_dirs: dict[str, Path]) -> Callable[[str, str], StitchEngine]:
    """engine(arch, device) for tests that pick a family themselves."""
    return lambda arch, device="cpu": engine_for(tiny_model_dirs, arch, device)


@pytest.fixture
def qwen2_kv_store(get_engine: Callable[[str, str], StitchEngine], tmp_path: Path) -> Iterator[KVStore]:
    """A real KV store over the tiny qwen2 engine, its device tier (the CPU here) large enough to hold every chunk."""
    engine = get_engine("qwen2", "cpu")
    index = SqliteIndex(tmp_path / "index.sqlite")
    try:
        with kv_store_for(engine, tmp_path / "cache", index, TierBudgets(1 << 24, 1 << 24, 1 << 26)) as opened:
            yield opened
    finally:
        index.close()


@pytest.fixture(params=ARCHITECTURES)
def arch(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def engine(tiny_model_dirs: dict[str, Path], arch: str, device: str) -> StitchEngine:
    return engine_for(tiny_model_dirs, arch, device)


REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture(scope="session")
def redis_url() -> str:
    """The local Redis, or a skip naming why the Redis variants cannot run."""
    redis = pytest.importorskip("redis")  # the GPU machine runs the engine tests without the redis package
    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1.0)
    try:
        client.ping()
    except redis.RedisError as err:
        pytest.skip(f"Redis at {REDIS_URL} does not answer ({err}); the Redis variants need it")
    finally:
        client.close()
    return REDIS_URL


@pytest.fixture
def redis_prefix(redis_url: str) -> Iterator[str]:
    """A key prefix no other test uses; every key under it is deleted after the test."""
    prefix = f"kvstitch-test:{uuid.uuid4().hex}"
    yield prefix
    import redis

    client = redis.Redis.from_url(redis_url)
    leftovers = list(client.scan_iter(match=f"{prefix}:*"))
    if leftovers:
        client.delete(*leftovers)
    client.close()


@pytest.fixture
def no_collector() -> Iterator[None]:
    """The cyclic collector off (after a full collection): only reference counting frees anything, so what a cycle
    holds stays visible as alive (`gc_alive.py`)."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
