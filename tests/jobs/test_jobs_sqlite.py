"""The embedded form's durable job stores: a restart (reopening the file) keeps queued and unacked jobs, dead
letters, statuses and document order; what a dead process had taken is handed out again at once."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from service.jobs.ordering import applying
from service.jobs.sqlite import SqliteDocumentOrder, SqliteJobQueue, SqliteJobStatusStore


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "jobs.sqlite3"


def test_queued_jobs_survive_a_restart_in_order(path: Path) -> None:
    before = SqliteJobQueue(path)
    ids = [before.enqueue({"job_id": f"j{n}"}) for n in range(3)]
    before.close()

    after = SqliteJobQueue(path)
    deliveries = after.consume("w", block_ms=0, count=5)

    assert [d.message_id for d in deliveries] == ids
    assert [(d.payload["job_id"], d.attempt) for d in deliveries] == [("j0", 1), ("j1", 1), ("j2", 1)]
    assert after.resumed == 0
    after.close()


def test_a_job_taken_by_a_dead_process_is_claimed_at_once_after_a_restart(path: Path) -> None:
    dead = SqliteJobQueue(path)
    message_id = dead.enqueue({"job_id": "j1"})
    (taken,) = dead.consume("in-process", block_ms=0)
    assert taken.attempt == 1
    # No ack, no close: the process was killed.

    restarted = SqliteJobQueue(path)
    assert restarted.resumed == 1
    assert restarted.consume("in-process", block_ms=0) == []  # not new: it is claimed, with its attempt counted
    (claimed,) = restarted.claim_stale("in-process", min_idle_ms=60_000)

    assert (claimed.message_id, claimed.attempt, claimed.payload) == (message_id, 2, {"job_id": "j1"})
    restarted.ack(claimed)
    assert restarted.pending_count() == 0
    restarted.close()
    dead.close()


def test_a_job_that_killed_every_process_is_dead_lettered_after_a_restart(path: Path) -> None:
    first = SqliteJobQueue(path, max_attempts=1)
    first.enqueue({"job_id": "poison"})
    first.consume("w", block_ms=0)

    second = SqliteJobQueue(path, max_attempts=1)
    told: list[tuple[str, str]] = []
    second.on_dead_letter = lambda data, error: told.append((data, error))

    assert second.claim_stale("w", min_idle_ms=60_000) == []
    (dead,) = second.dead_letters()
    assert (json.loads(dead.payload), dead.attempts) == ({"job_id": "poison"}, 1)
    assert "delivered 1 times without an ack" in dead.error
    assert [json.loads(data) for data, _ in told] == [{"job_id": "poison"}]
    second.close()

    assert SqliteJobQueue(path).dead_letters()[0].error == dead.error  # dead letters survive a restart too


def test_a_released_job_is_queued_again_after_a_restart(path: Path) -> None:
    queue = SqliteJobQueue(path)
    queue.enqueue({"job_id": "j1"})
    (taken,) = queue.consume("w", block_ms=0)
    queue.release(taken)
    queue.close()

    (again,) = SqliteJobQueue(path).consume("w", block_ms=0)
    assert (again.payload, again.attempt) == ({"job_id": "j1"}, 1)


def test_pending_payloads_list_what_will_still_run(path: Path) -> None:
    queue = SqliteJobQueue(path)
    queue.enqueue({"job_id": "a"})
    queue.enqueue({"job_id": "b"})
    (taken,) = queue.consume("w", block_ms=0)
    queue.ack(taken)
    assert queue.pending_payloads() == [{"job_id": "b"}]
    queue.close()


def test_close_wakes_a_blocked_consumer(path: Path) -> None:
    queue = SqliteJobQueue(path)
    got: list[object] = []
    thread = threading.Thread(target=lambda: got.append(queue.consume("w", block_ms=10_000)))
    thread.start()
    queue.close()
    thread.join(timeout=2)
    assert not thread.is_alive()
    assert got == [[]]


def test_statuses_survive_a_restart(path: Path) -> None:
    store = SqliteJobStatusStore(path)
    store.create("job-1", documents=2)
    store.update("job-1", status="running", chunks=8)
    store.increment("job-1", documents_done=1, chunks_precomputed=5)
    before = store.get("job-1")
    store.close()

    after = SqliteJobStatusStore(path).get("job-1")

    assert after == before
    assert after is not None
    assert (after.status, after.documents, after.documents_done, after.chunks, after.chunks_precomputed) == (
        "running",
        2,
        1,
        8,
        5,
    )
    assert after.started_at is not None and after.finished_at is None


def test_finished_statuses_expire_but_unfinished_ones_never_do(path: Path) -> None:
    now = [1000.0]
    store = SqliteJobStatusStore(path, ttl_s=100, clock=lambda: now[0])
    store.create("old-done", documents=1)
    store.update("old-done", status="done")
    store.create("old-queued", documents=1)
    now[0] = 1200.0

    store.create("new", documents=1)  # each create drops what finished more than ttl_s ago

    assert store.get("old-done") is None
    queued = store.get("old-queued")
    assert queued is not None and queued.status == "queued"
    store.close()


def test_document_order_survives_a_restart(path: Path) -> None:
    order = SqliteDocumentOrder(path)
    assert order.claim(["a", "b"]) == {"a": 1, "b": 1}
    with applying(order, "a", {"a": 1}) as current:
        assert current
    order.claim(["b"])
    order.close()

    reopened = SqliteDocumentOrder(path)

    assert (reopened.latest("a"), reopened.latest("b")) == (1, 2)
    assert (reopened.pending("a"), reopened.pending("b")) == (False, True)
    assert reopened.claim(["a"]) == {"a": 2}
    with applying(reopened, "b", {"b": 1}) as current:
        assert not current  # the delete queued before the restart still wins over the older ingest
    reopened.close()


def test_the_three_stores_share_one_file(path: Path) -> None:
    queue, statuses, order = SqliteJobQueue(path), SqliteJobStatusStore(path), SqliteDocumentOrder(path)
    statuses.create("j", documents=1)
    queue.enqueue({"job_id": "j", "sequence": order.claim(["d"])})
    assert [p["sequence"] for p in queue.pending_payloads()] == [{"d": 1}]
    for store in (queue, statuses, order):
        store.close()
    assert sorted(p.name for p in path.parent.iterdir() if p.name.startswith("jobs"))[0] == "jobs.sqlite3"
