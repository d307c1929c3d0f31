"""Fixtures of the worker tests: the local Redis and a unique key prefix per test, cleaned up afterwards."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis

REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture(scope="session")
def redis_url() -> str:
    """The local Redis, or a skip naming why the Redis variants cannot run."""
    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1.0)
    try:
        client.ping()
    except redis.RedisError as err:
        pytest.skip(f"Redis at {REDIS_URL} does not answer ({err}); the Redis queue tests need it")
    finally:
        client.close()
    return REDIS_URL


@pytest.fixture
def redis_prefix(redis_url: str) -> Iterator[str]:
    """A key prefix no other test uses; every key under it is deleted after the test."""
    prefix = f"kvstitch-test:{uuid.uuid4().hex}"
    yield prefix
    client = redis.Redis.from_url(redis_url)
    leftovers = list(client.scan_iter(match=f"{prefix}:*"))
    if leftovers:
        client.delete(*leftovers)
    client.close()
