"""Per-document job order: sequence numbers, supersession, pending, and the exclusive hold — in memory and in
Redis."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from service.jobs.ordering import DocumentOrder, InMemoryDocumentOrder, RedisDocumentOrder, applying, superseded
from service.jobs.sqlite import SqliteDocumentOrder
from service.serving.runtime import open_jobs
from service.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["in-memory", "redis", "sqlite"])
def order(request: pytest.FixtureRequest) -> Iterator[DocumentOrder]:
    if request.param == "in-memory":
        made: DocumentOrder = InMemoryDocumentOrder()
    elif request.param == "sqlite":
        made = SqliteDocumentOrder(request.getfixturevalue("tmp_path") / "jobs.sqlite3")
    else:
        url, prefix = request.getfixturevalue("redis_url"), request.getfixturevalue("redis_prefix")
        made = RedisDocumentOrder(url, prefix=f"{prefix}:doc", lock_ttl_ms=5_000)
    yield made
    made.close()


def test_claims_number_each_document_on_its_own(order: DocumentOrder) -> None:
    assert order.latest("a") == 0
    assert order.claim(["a", "b"]) == {"a": 1, "b": 1}
    assert order.claim(["a"]) == {"a": 2}
    assert (order.latest("a"), order.latest("b"), order.latest("c")) == (2, 1, 0)


def test_a_job_is_superseded_only_by_a_later_submit_for_the_same_document(order: DocumentOrder) -> None:
    first = order.claim(["a", "b"])
    assert not superseded(order, "a", first)
    order.claim(["a"])
    assert superseded(order, "a", first)
    assert not superseded(order, "b", first)
    assert not superseded(order, "a", {})  # an unordered (old) message always applies


def test_applying_in_any_order_leaves_the_latest_job_effective(order: DocumentOrder) -> None:
    """Ingest (1) then delete (2) submitted; the delete runs first: the ingest must then be skipped."""
    ingest, delete = order.claim(["doc"]), order.claim(["doc"])
    assert order.pending("doc")
    with applying(order, "doc", delete) as current:
        assert current
    assert not order.pending("doc")
    with applying(order, "doc", ingest) as current:
        assert not current
    assert not order.pending("doc")


def test_a_failed_application_stays_pending(order: DocumentOrder) -> None:
    job = order.claim(["doc"])
    with pytest.raises(RuntimeError), applying(order, "doc", job):
        raise RuntimeError("qdrant went away")
    assert order.pending("doc")
    with applying(order, "doc", job) as current:  # the retry
        assert current
    assert not order.pending("doc")


def test_hold_is_exclusive_per_document(order: DocumentOrder) -> None:
    inside: list[str] = []
    entered = threading.Event()

    def other() -> None:
        with order.hold("doc"):
            inside.append("other")

    with order.hold("doc"):
        thread = threading.Thread(target=other)
        thread.start()
        with order.hold("another"):  # a different document is not blocked
            entered.set()
        time.sleep(0.2)
        assert inside == []
        inside.append("first")
    thread.join(timeout=10)
    assert entered.is_set() and inside == ["first", "other"]


# ---- the lock's expiry (Redis form) ------------------------------------------------------------------------------

HOLD_AND_WAIT = """
import sys, time
from service.serving.runtime import open_jobs
from service.settings import Settings
settings = Settings(redis_url=sys.argv[1], redis_prefix=sys.argv[2], job_claim_idle_ms=1000)
order = open_jobs(settings)[2]
with order.hold("doc"):
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_dead_workers_document_lock_is_free_by_the_time_its_job_is_claimed(
    redis_url: str, redis_prefix: str, tmp_path: Path
) -> None:
    """A worker killed while it holds a document's lock: with a claim idle time of 1 s the document is free again
    within about that (the lock's expiry follows KVSTITCH_JOB_CLAIM_IDLE_MS), not after a fixed two minutes."""
    args = [sys.executable, "-c", HOLD_AND_WAIT, redis_url, redis_prefix]
    worker = subprocess.Popen(
        args, stdout=subprocess.PIPE, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    try:
        assert worker.stdout is not None and worker.stdout.readline() == "held\n"
    finally:
        worker.kill()
        worker.wait()
    killed = time.monotonic()
    order = open_jobs(
        Settings(redis_url=redis_url, redis_prefix=redis_prefix, job_claim_idle_ms=1000, data_dir=tmp_path)
    )[2]
    got = threading.Event()

    def take() -> None:
        with order.hold("doc"):
            got.set()

    taker = threading.Thread(target=take, daemon=True)
    taker.start()
    assert got.wait(10), "the dead worker's lock still held the document after 10 s"
    assert time.monotonic() - killed < 1.5
    taker.join(5)  # its release must finish before the connection closes under it
    order.close()


def test_a_live_holder_keeps_its_lock_past_the_expiry(redis_url: str, redis_prefix: str) -> None:
    holder = RedisDocumentOrder(redis_url, prefix=f"{redis_prefix}:doc", lock_ttl_ms=300)
    other = RedisDocumentOrder(redis_url, prefix=f"{redis_prefix}:doc", lock_ttl_ms=300)
    events: list[str] = []

    def wait_for_it() -> None:
        with other.hold("a"):
            events.append("other")

    with holder.hold("a"):
        waiter = threading.Thread(target=wait_for_it)
        waiter.start()
        time.sleep(1.2)  # four expiries: renewed, so still the holder's
        events.append("holder done")
    waiter.join(5)
    assert events == ["holder done", "other"]
    holder.close()
    other.close()


def test_the_lock_expiry_is_tied_to_the_claim_idle_time() -> None:
    assert Settings(job_claim_idle_ms=10_000).doc_lock_ttl == 5_000
    assert Settings(job_claim_idle_ms=10_000, doc_lock_ttl_ms=8_000).doc_lock_ttl == 8_000
    with pytest.raises(ValidationError, match="at most job_claim_idle_ms"):
        Settings(job_claim_idle_ms=10_000, doc_lock_ttl_ms=20_000)
