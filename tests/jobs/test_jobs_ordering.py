"""Per-document job order: sequence numbers, supersession, pending, and the exclusive hold — in memory and in
Redis."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from service.jobs.ordering import DocumentOrder, InMemoryDocumentOrder, RedisDocumentOrder, applying, superseded
from service.jobs.sqlite import SqliteDocumentOrder


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
