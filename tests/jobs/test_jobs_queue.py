"""The job queue over Redis Streams and in process: delivery, at-least-once, retries and dead letters."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from service.jobs.queue import InProcessQueue, JobQueue, RedisStreamQueue
from service.jobs.sqlite import SqliteJobQueue

QueueFactory = Callable[..., JobQueue]


@pytest.fixture(params=["redis", "in-process", "sqlite"])
def make_queue(request: pytest.FixtureRequest) -> Iterator[QueueFactory]:
    """Opens queues over one (initially empty) stream; several calls act like several processes."""
    opened: list[JobQueue] = []
    if request.param == "redis":
        url, prefix = request.getfixturevalue("redis_url"), request.getfixturevalue("redis_prefix")

        def make(max_attempts: int = 3) -> JobQueue:
            opened.append(
                RedisStreamQueue(
                    url,
                    stream=f"{prefix}:ingest",
                    group="workers",
                    dead_letter=f"{prefix}:ingest:dead",
                    max_attempts=max_attempts,
                )
            )
            return opened[-1]

    elif request.param == "sqlite":
        # One handle per file, as in the one process of the embedded form.
        root: Path = request.getfixturevalue("tmp_path")
        files: dict[int, SqliteJobQueue] = {}

        def make(max_attempts: int = 3) -> JobQueue:
            if max_attempts not in files:
                files[max_attempts] = SqliteJobQueue(root / f"jobs-{max_attempts}.sqlite3", max_attempts=max_attempts)
            opened.append(files[max_attempts])
            return opened[-1]

    else:
        shared: dict[int, InProcessQueue] = {}

        def make(max_attempts: int = 3) -> JobQueue:
            shared.setdefault(max_attempts, InProcessQueue(max_attempts=max_attempts))
            opened.append(shared[max_attempts])
            return opened[-1]

    yield make
    for queue in set(opened):
        queue.close()


@pytest.fixture
def queue(make_queue: QueueFactory) -> JobQueue:
    return make_queue()


def test_enqueued_jobs_are_consumed_in_order_and_acked(queue: JobQueue) -> None:
    first = queue.enqueue({"job_id": "j1", "documents": [{"id": "a", "text": "é 🙂"}]})
    second = queue.enqueue({"job_id": "j2"})
    assert first != second
    assert queue.pending_count() == 2

    deliveries = queue.consume("worker-1", block_ms=100, count=10)

    assert [d.message_id for d in deliveries] == [first, second]
    assert deliveries[0].payload == {"job_id": "j1", "documents": [{"id": "a", "text": "é 🙂"}]}
    assert [(d.attempt, d.consumer, d.last_error) for d in deliveries] == [(1, "worker-1", None)] * 2
    assert queue.pending_count() == 2  # delivered is not done
    queue.ack(deliveries[0])
    assert queue.pending_count() == 1
    queue.ack(deliveries[1])
    assert queue.pending_count() == 0
    assert queue.consume("worker-1", block_ms=0) == []


def test_consume_takes_at_most_count(queue: JobQueue) -> None:
    for n in range(3):
        queue.enqueue({"n": n})
    assert [d.payload["n"] for d in queue.consume("w", block_ms=0, count=2)] == [0, 1]
    assert [d.payload["n"] for d in queue.consume("w", block_ms=0, count=2)] == [2]
    with pytest.raises(ValueError, match="count must be at least 1"):
        queue.consume("w", block_ms=0, count=0)


def test_consume_waits_for_a_job_up_to_block_ms(queue: JobQueue) -> None:
    started = time.monotonic()
    assert queue.consume("w", block_ms=150) == []
    assert time.monotonic() - started >= 0.12

    late = threading.Timer(0.1, lambda: queue.enqueue({"late": True}))
    late.start()
    started = time.monotonic()
    (delivery,) = queue.consume("w", block_ms=5000)
    waited = time.monotonic() - started
    # The consumer can wake before the producer has read its own reply: closing the queue under it (the fixture,
    # at teardown) would end that thread with an error, reported against the next test.
    late.join(5)
    assert delivery.payload == {"late": True}
    assert waited < 2.0  # woken by the job, not by the timeout


def test_an_unacked_job_is_claimed_by_another_consumer_after_idle(make_queue: QueueFactory) -> None:
    producer, dying_worker, live_worker = make_queue(), make_queue(), make_queue()
    message_id = producer.enqueue({"job_id": "j1"})
    (taken,) = dying_worker.consume("worker-a", block_ms=100)

    assert live_worker.consume("worker-b", block_ms=0) == []  # not redelivered as new
    assert live_worker.claim_stale("worker-b", min_idle_ms=60_000) == []  # not idle long enough
    time.sleep(0.12)
    (claimed,) = live_worker.claim_stale("worker-b", min_idle_ms=100)

    assert (claimed.message_id, claimed.payload) == (message_id, taken.payload)
    assert (claimed.attempt, claimed.consumer) == (2, "worker-b")
    live_worker.ack(claimed)
    assert live_worker.pending_count() == 0
    time.sleep(0.12)
    assert live_worker.claim_stale("worker-c", min_idle_ms=100) == []


def test_failed_jobs_are_retried_then_dead_lettered_with_the_error(queue: JobQueue) -> None:
    payload = {"job_id": "j1", "doc": "x"}
    queue.enqueue(payload)
    errors: list[str | None] = []
    outcomes: list[bool] = []
    for n in range(1, 4):
        (delivery,) = queue.consume("w", block_ms=100)
        assert (delivery.attempt, delivery.payload) == (n, payload)
        errors.append(delivery.last_error)
        outcomes.append(queue.fail(delivery, f"boom {n}"))

    assert outcomes == [False, False, True]
    assert errors == [None, "boom 1", "boom 2"]
    assert queue.pending_count() == 0
    assert queue.consume("w", block_ms=0) == []
    (dead,) = queue.dead_letters()
    assert (dead.error, dead.attempts, json.loads(dead.payload)) == ("boom 3", 3, payload)
    assert dead.original_id == delivery.message_id
    assert dead.failed_at > 0


def test_a_job_that_keeps_killing_its_worker_is_dead_lettered(make_queue: QueueFactory) -> None:
    queue = make_queue(max_attempts=2)
    queue.enqueue({"job_id": "poison"})
    queue.consume("worker-a", block_ms=100)  # worker-a dies without ack or fail
    time.sleep(0.06)
    (second,) = queue.claim_stale("worker-b", min_idle_ms=50)
    assert second.attempt == 2  # worker-b dies too
    time.sleep(0.06)

    assert queue.claim_stale("worker-c", min_idle_ms=50) == []

    (dead,) = queue.dead_letters()
    assert "delivered 2 times without an ack" in dead.error
    assert (dead.attempts, json.loads(dead.payload)) == (2, {"job_id": "poison"})
    assert queue.pending_count() == 0


def test_a_late_failure_of_a_job_finished_elsewhere_changes_nothing(queue: JobQueue) -> None:
    queue.enqueue({"job_id": "j1"})
    (slow,) = queue.consume("worker-a", block_ms=100)
    time.sleep(0.06)
    (claimed,) = queue.claim_stale("worker-b", min_idle_ms=50)
    queue.ack(claimed)

    assert queue.fail(slow, "timed out") is False

    assert queue.pending_count() == 0
    assert queue.consume("worker-a", block_ms=0) == []
    assert queue.dead_letters() == []


def test_payloads_that_are_not_json_objects_are_refused_at_enqueue(queue: JobQueue) -> None:
    with pytest.raises(TypeError, match="must be a mapping"):
        queue.enqueue([1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not JSON-serializable"):
        queue.enqueue({"when": object()})
    with pytest.raises(ValueError, match="not JSON-serializable"):
        queue.enqueue({"score": float("nan")})
    assert queue.pending_count() == 0


def test_each_job_goes_to_one_of_many_concurrent_consumers(queue: JobQueue) -> None:
    for n in range(40):
        queue.enqueue({"n": n})
    seen: list[int] = []
    lock = threading.Lock()

    def work(name: str) -> None:
        while deliveries := queue.consume(name, block_ms=50, count=3):
            for delivery in deliveries:
                with lock:
                    seen.append(delivery.payload["n"])
                queue.ack(delivery)

    threads = [threading.Thread(target=work, args=(f"w{i}",)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(seen) == list(range(40))
    assert queue.pending_count() == 0


# ---- Redis only: what other writers can put in a shared stream ---------------------------------------------


def test_malformed_messages_are_dead_lettered_not_raised(redis_url: str, redis_prefix: str) -> None:
    stream = f"{redis_prefix}:ingest"
    queue = RedisStreamQueue(redis_url, stream=stream, group="workers", dead_letter=f"{redis_prefix}:dead")
    raw = redis.Redis.from_url(redis_url)
    raw.xadd(stream, {"payload": "{not json"})
    raw.xadd(stream, {"payload": "[1, 2]"})
    raw.xadd(stream, {"other": "field"})
    raw.xadd(stream, {"payload": b"\xff\xfe"})
    good = queue.enqueue({"job_id": "fine"})
    raw.close()

    deliveries = queue.consume("w", block_ms=100, count=10)

    assert [d.message_id for d in deliveries] == [good]
    errors = [d.error for d in queue.dead_letters()]
    assert errors[0].startswith("malformed message: payload is not valid JSON")
    assert errors[1] == "malformed message: payload is a JSON list, not an object"
    assert errors[2] == "malformed message: it has no payload field"
    assert errors[3] == "malformed message: payload is not UTF-8 text (invalid start byte at byte 0)"
    assert queue.dead_letters()[0].payload == "{not json"
    assert queue.pending_count() == 1
    queue.close()


def test_consumers_recover_when_the_stream_is_deleted(redis_url: str, redis_prefix: str) -> None:
    stream = f"{redis_prefix}:ingest"
    queue = RedisStreamQueue(redis_url, stream=stream, group="workers", dead_letter=f"{redis_prefix}:dead")
    raw = redis.Redis.from_url(redis_url)
    raw.delete(stream)  # a flush or a reset while workers run
    raw.close()
    assert queue.claim_stale("w", min_idle_ms=0) == []  # a worker's turn starts with this call
    assert queue.consume("w", block_ms=0) == []
    queue.enqueue({"after": "reset"})
    assert [d.payload for d in queue.consume("w", block_ms=100)] == [{"after": "reset"}]
    queue.close()


def test_invalid_max_attempts_is_refused() -> None:
    with pytest.raises(ValueError, match="max_attempts must be at least 1"):
        InProcessQueue(max_attempts=0)


def test_closing_an_in_process_queue_wakes_a_blocked_consumer() -> None:
    queue = InProcessQueue()
    threading.Timer(0.05, queue.close).start()
    started = time.monotonic()
    assert queue.consume("w", block_ms=5000) == []
    assert time.monotonic() - started < 2.0


def test_a_released_job_is_handed_out_again_without_spending_an_attempt(queue: JobQueue) -> None:
    queue.enqueue({"job_id": "j1"})
    (first,) = queue.consume("w", block_ms=100)
    assert queue.fail(first, "boom") is False
    (second,) = queue.consume("w", block_ms=100)
    assert second.attempt == 2

    queue.release(second)  # its worker is shutting down

    (again,) = queue.consume("w", block_ms=100)
    assert (again.attempt, again.last_error, again.payload) == (2, "boom", {"job_id": "j1"})
    assert queue.pending_count() == 1
    queue.ack(again)
    assert queue.pending_count() == 0


# ---- taking turns (issue 15) -------------------------------------------------------------------------------


def test_a_job_released_with_its_rest_goes_behind_the_waiting_jobs(queue: JobQueue) -> None:
    queue.enqueue({"job_id": "big", "documents": ["d1", "d2", "d3"]})
    assert queue.waiting_count() == 1
    [big] = queue.consume("worker-1", block_ms=100)
    assert queue.waiting_count() == 0 and queue.pending_count() == 1
    queue.enqueue({"job_id": "small"})
    assert queue.waiting_count() == 1

    queue.release(big, {"job_id": "big", "documents": ["d3"], "progress": {"documents_done": 2}})

    assert queue.waiting_count() == 2 and queue.pending_count() == 2
    first, second = (queue.consume("worker-1", block_ms=100)[0] for _ in range(2))
    assert first.payload == {"job_id": "small"}
    assert second.payload == {"job_id": "big", "documents": ["d3"], "progress": {"documents_done": 2}}
    assert second.attempt == 1  # a turn given up is not an attempt
    assert queue.waiting_count() == 0
