"""Fixtures of the KV cache tests: specs, blocks, a tiny model folder and the local Redis."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kv_support import BASE_SPEC, BlockFactory, IndexOpener, SpecFactory, random_kv

from service.engine.kv_layout import KVBlock, ModelSpec, block_shape
from service.kvcache.index import SQLITE_FILENAME, KVIndex, RedisIndex, SqliteIndex


@pytest.fixture
def make_spec() -> SpecFactory:
    """BASE_SPEC with some fields replaced."""

    def make(**changes: Any) -> ModelSpec:
        return dataclasses.replace(BASE_SPEC, **changes)

    return make


@pytest.fixture
def make_block() -> BlockFactory:
    """A block of `num_tokens` tokens for `spec`, with ids and values drawn from `seed`."""

    def make(spec: ModelSpec, num_tokens: int = 24, seed: int = 0) -> KVBlock:
        ids = tuple(range(seed * 1000 + 1, seed * 1000 + 1 + num_tokens))
        return KVBlock(token_ids=ids, kv=random_kv(block_shape(spec, num_tokens), spec.dtype, seed))

    return make


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model_dirs: dict[str, Path]) -> Path:
    """The session's tiny Llama folder (built by the top-level conftest); tests copy it before changing it."""
    return tiny_model_dirs["llama"]


@pytest.fixture(params=["redis", "sqlite"])
def index_opener(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[IndexOpener]:
    """Opens the same index (Redis under a unique prefix, or one SQLite file) on each call, as a restart would.

    Everything opened is closed afterwards and the Redis prefix is deleted.
    """
    opened: list[KVIndex] = []
    if request.param == "redis":
        url, prefix = request.getfixturevalue("redis_url"), request.getfixturevalue("redis_prefix")

    def make() -> KVIndex:
        if request.param == "redis":
            opened.append(RedisIndex(url, prefix=prefix))
        else:
            opened.append(SqliteIndex(tmp_path / "index" / SQLITE_FILENAME))
        return opened[-1]

    yield make
    for index in opened:
        index.close()  # before redis_prefix's teardown deletes the keys
