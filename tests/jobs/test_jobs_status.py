"""Job statuses in Redis and in memory: lifecycle, counts, timestamps and refusals."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import redis

from service.jobs.sqlite import SqliteJobStatusStore
from service.jobs.status import InMemoryJobStatusStore, JobStatusStore, RedisJobStatusStore


class FakeClock:
    """1000.0, 1001.0, 1002.0, … one second per call, so each timestamp says which call set it."""

    def __init__(self) -> None:
        self._ticks = itertools.count(1000)

    def __call__(self) -> float:
        return float(next(self._ticks))


@pytest.fixture(params=["redis", "in-memory", "sqlite"])
def store(request: pytest.FixtureRequest) -> Iterator[JobStatusStore]:
    opened: JobStatusStore
    if request.param == "redis":
        url, prefix = request.getfixturevalue("redis_url"), request.getfixturevalue("redis_prefix")
        opened = RedisJobStatusStore(url, prefix=f"{prefix}:job", ttl_s=3600, clock=FakeClock())
    elif request.param == "sqlite":
        opened = SqliteJobStatusStore(request.getfixturevalue("tmp_path") / "jobs.sqlite3", clock=FakeClock())
    else:
        opened = InMemoryJobStatusStore(clock=FakeClock())
    yield opened
    opened.close()


def test_a_new_job_is_queued_with_zero_counts(store: JobStatusStore) -> None:
    created = store.create("job-1", documents=3)
    assert created == store.get("job-1")
    assert (created.job_id, created.status, created.documents) == ("job-1", "queued", 3)
    assert (created.chunks, created.chunks_precomputed, created.chunks_reused) == (0, 0, 0)
    assert (created.created_at, created.updated_at) == (1000.0, 1000.0)
    assert (created.error, created.started_at, created.finished_at) == (None, None, None)
    assert store.get("job-2") is None


def test_a_job_runs_counts_and_finishes(store: JobStatusStore) -> None:
    store.create("job-1", documents=2)
    running = store.update("job-1", status="running")
    assert (running.status, running.started_at, running.updated_at) == ("running", 1001.0, 1001.0)

    store.update("job-1", chunks=10, chunks_precomputed=4)
    counted = store.increment("job-1", chunks_precomputed=3, chunks_reused=3)
    assert (counted.chunks, counted.chunks_precomputed, counted.chunks_reused) == (10, 7, 3)

    done = store.update("job-1", status="done")
    assert (done.status, done.finished_at, done.started_at, done.created_at) == ("done", 1004.0, 1001.0, 1000.0)
    assert store.get("job-1") == done


def test_a_failed_job_keeps_its_error(store: JobStatusStore) -> None:
    store.create("job-1", documents=1)
    failed = store.update("job-1", status="failed", error="document 'a' is empty")
    assert (failed.status, failed.error, failed.finished_at) == ("failed", "document 'a' is empty", 1001.0)
    cleared = store.update("job-1", status="queued", error=None)
    assert (cleared.status, cleared.error) == ("queued", None)


def test_bad_writes_are_refused(store: JobStatusStore) -> None:
    store.create("job-1", documents=1)
    with pytest.raises(ValueError, match="already exists"):
        store.create("job-1", documents=5)
    with pytest.raises(KeyError, match="unknown job 'nope'"):
        store.update("nope", status="running")
    with pytest.raises(KeyError, match="unknown job 'nope'"):
        store.increment("nope", chunks=1)
    with pytest.raises(ValueError, match="job status must be one of queued, running, done, failed"):
        store.update("job-1", status="paused")
    with pytest.raises(ValueError, match="unknown job status fields: colour"):
        store.update("job-1", colour="red")
    with pytest.raises(ValueError, match="chunks must be a non-negative int"):
        store.update("job-1", chunks=-1)
    with pytest.raises(ValueError, match="can be incremented"):
        store.increment("job-1", status=1)
    with pytest.raises(ValueError, match="documents must be a non-negative int"):
        store.create("job-2", documents=-3)
    job = store.get("job-1")
    assert job is not None and (job.status, job.documents, job.chunks) == ("queued", 1, 0)


def test_redis_statuses_expire(redis_url: str, redis_prefix: str) -> None:
    store = RedisJobStatusStore(redis_url, prefix=f"{redis_prefix}:job", ttl_s=120)
    store.create("job-1", documents=1)
    store.update("job-1", status="running")
    raw = redis.Redis.from_url(redis_url)
    assert 0 < raw.ttl(f"{redis_prefix}:job:job-1") <= 120
    raw.close()
    store.close()


def test_in_memory_store_uses_wall_clock_by_default() -> None:
    job = InMemoryJobStatusStore().create("job-1", documents=0)
    assert job.created_at > 1.6e9


# ---- cancelling (issue 15) ---------------------------------------------------------------------------------


@pytest.mark.parametrize("state", ["queued", "running"])
def test_a_queued_or_running_job_is_cancelled_and_cancelled_is_final(store: JobStatusStore, state: str) -> None:
    store.create("job-1", documents=4)
    if state == "running":
        store.update("job-1", status="running")

    assert store.cancel("job-1") is True
    cancelled = store.get("job-1")
    assert cancelled is not None and cancelled.status == "cancelled"
    assert cancelled.finished_at == cancelled.updated_at is not None

    # The worker's last write (it finished its step after the cancel) keeps the status and times, not the counts.
    after = store.update("job-1", status="done", documents_done=2, chunks=9)
    assert (after.status, after.documents_done, after.chunks) == ("cancelled", 2, 9)
    assert after.finished_at == cancelled.finished_at
    assert store.cancel("job-1") is False  # cancelled once: nothing left to cancel


@pytest.mark.parametrize("final", ["done", "failed"])
def test_a_finished_job_cannot_be_cancelled_and_an_unknown_one_is_none(store: JobStatusStore, final: str) -> None:
    store.create("job-1", documents=1)
    store.update("job-1", status=final)
    assert store.cancel("job-1") is False
    job = store.get("job-1")
    assert job is not None and job.status == final
    assert store.cancel("no-such-job") is None
    assert store.get("no-such-job") is None  # asking to cancel creates nothing
