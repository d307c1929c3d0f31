"""Jobs under control (issue 15): jobs take document groups in turns, so a small job sent behind a large one
finishes first; a cancelled job, queued or running, leaves each of its documents whole or absent and no block
that no point names. Both forms: the embedded one (SQLite queue) and Redis (stream, statuses, order)."""

from __future__ import annotations

import pytest
from ingest_support import expected_chunks
from test_workers_durable import visible_counts

from service.jobs.documents import Document
from service.jobs.job_status import JobStatus
from service.jobs.submit import submit_ingest
from service.serving.runtime import Runtime
from tests.workers.test_workers_sigkill import corpus
from workers.worker import IngestWorker, runtime_worker

LARGE = corpus(24)  # many document groups at the test chunk and batch sizes
SMALL = [Document("small.txt", "A short note about otters and their favourite stones.")]


def status_of(runtime: Runtime, job_id: str) -> JobStatus:
    status = runtime.jobs.get(job_id)
    assert status is not None
    return status


def work_until_finished(runtime: Runtime, worker: IngestWorker, job_ids: list[str], turns: int = 60) -> list[str]:
    """Run the worker turn by turn until the jobs finished and the queue is empty; the job ids in the order they
    finished (a cancelled job counts when its status says so, its message may still wait to be dropped)."""
    finished: list[str] = []
    for _ in range(turns):
        worker.run_once()
        for job_id in job_ids:
            if job_id not in finished and status_of(runtime, job_id).status in ("done", "failed", "cancelled"):
                finished.append(job_id)
        if len(finished) == len(job_ids) and runtime.queue.pending_count() == 0:
            return finished
    raise AssertionError(f"jobs not finished after {turns} turns: {[status_of(runtime, j) for j in job_ids]}")


def chunk_counts(runtime: Runtime, documents: list[Document]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for chunk in expected_chunks(runtime, documents):
        counts[chunk.doc_id] = counts.get(chunk.doc_id, 0) + 1
    return counts


def assert_no_orphans(runtime: Runtime, documents: list[Document]) -> None:
    """No unpublished point, and every stored KV block is named by some point."""
    assert runtime.collection.invisible_points() == []
    named = {key for doc in documents for key in runtime.collection.document_kv_keys(doc.id)}
    assert set(runtime.index.keys()) == named


# ---- fairness ----------------------------------------------------------------------------------------------


def test_a_small_job_sent_after_a_large_one_finishes_first(runtime: Runtime) -> None:
    large = submit_ingest(runtime.queue, runtime.jobs, runtime.order, LARGE)
    small = submit_ingest(runtime.queue, runtime.jobs, runtime.order, SMALL)
    worker = runtime_worker(runtime, poll_ms=10)

    turns_for_small = 0
    while status_of(runtime, small).status != "done":
        worker.run_once()
        turns_for_small += 1
        assert turns_for_small <= 3  # one group of the large job, then the small job: not the whole large job
    assert status_of(runtime, large).status == "running"  # still going: it gave the small one its turn
    assert status_of(runtime, large).documents_done < len(LARGE)

    assert work_until_finished(runtime, worker, [large]) == [large]
    done_large, done_small = status_of(runtime, large), status_of(runtime, small)
    assert done_small.finished_at is not None and done_large.finished_at is not None
    assert done_small.finished_at < done_large.finished_at
    # Taking turns lost nothing and did nothing twice: the large job's counts are those of one whole run.
    expected = chunk_counts(runtime, LARGE)
    assert (done_large.documents, done_large.documents_done) == (len(LARGE), len(LARGE))
    assert (done_large.chunks, done_large.chunks_precomputed) == (sum(expected.values()), sum(expected.values()))
    assert visible_counts(runtime.collection, list(expected)) == expected
    assert runtime.queue.pending_count() == 0
    assert_no_orphans(runtime, [*LARGE, *SMALL])


def test_three_jobs_take_groups_round_robin(runtime: Runtime) -> None:
    a = submit_ingest(runtime.queue, runtime.jobs, runtime.order, LARGE[:12])
    b = submit_ingest(runtime.queue, runtime.jobs, runtime.order, LARGE[12:])
    c = submit_ingest(runtime.queue, runtime.jobs, runtime.order, SMALL)
    worker = runtime_worker(runtime, poll_ms=10)

    worker.run_once()  # a's first group; b and c wait, so a goes behind them
    first_a = status_of(runtime, a)
    assert (first_a.status, status_of(runtime, b).documents_done) == ("running", 0)
    assert 0 < first_a.documents_done < 12
    worker.run_once()  # b's first group
    assert 0 < status_of(runtime, b).documents_done < 12 and status_of(runtime, c).status == "queued"
    worker.run_once()  # c, whole
    assert status_of(runtime, c).status == "done"
    assert status_of(runtime, a).documents_done == first_a.documents_done  # a waited for its next turn
    assert set(work_until_finished(runtime, worker, [a, b])) == {a, b}
    assert_no_orphans(runtime, LARGE + SMALL)


# ---- cancelling --------------------------------------------------------------------------------------------


def test_a_job_cancelled_while_running_keeps_whole_documents_and_releases_the_rest(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_id = submit_ingest(runtime.queue, runtime.jobs, runtime.order, LARGE)
    publish = runtime.collection.publish
    published: list[str] = []

    def publish_then_cancel(doc_id: str, version: str) -> int:
        result = publish(doc_id, version)
        published.append(doc_id)
        assert runtime.jobs.cancel(job_id) is True  # mid-group: the group's KV is stored, its later documents not
        return result  # yet published

    monkeypatch.setattr(runtime.collection, "publish", publish_then_cancel)
    assert runtime_worker(runtime, poll_ms=10).run_once() == 1

    status = status_of(runtime, job_id)
    assert (status.status, status.documents_done, published) == ("cancelled", 1, [LARGE[0].id])
    assert status.chunks > chunk_counts(runtime, LARGE[:1])[LARGE[0].id]  # the group held more than one document
    assert status.blocks_released > 0  # the KV stored for the group's unpublished documents
    expected = chunk_counts(runtime, LARGE)
    visible = visible_counts(runtime.collection, list(expected))
    assert {d for d, n in visible.items() if n} == set(published)
    assert all(visible[d] == expected[d] for d in published)  # finished documents are whole
    assert_no_orphans(runtime, LARGE)
    assert runtime.queue.pending_count() == 0  # acked: never run again
    assert not any(runtime.order.pending(d.id) for d in LARGE)  # nothing waits for the cancelled documents


def test_a_job_cancelled_while_waiting_for_its_turn_is_dropped_and_leaves_nothing(runtime: Runtime) -> None:
    large = submit_ingest(runtime.queue, runtime.jobs, runtime.order, LARGE)
    small = submit_ingest(runtime.queue, runtime.jobs, runtime.order, SMALL)
    worker = runtime_worker(runtime, poll_ms=10)
    worker.run_once()  # the large job's first group, then its rest goes behind the small job
    done_first = status_of(runtime, large).documents_done
    assert 0 < done_first < len(LARGE)

    assert runtime.jobs.cancel(large) is True
    assert work_until_finished(runtime, worker, [small, large]) == [small, large]

    status = status_of(runtime, large)
    assert (status.status, status.documents_done) == ("cancelled", done_first)
    visible = visible_counts(runtime.collection, [d.id for d in LARGE])
    assert sum(1 for n in visible.values() if n) == done_first
    assert runtime.queue.pending_count() == 0
    assert_no_orphans(runtime, [*LARGE, *SMALL])


def test_a_queued_job_cancelled_before_any_turn_never_runs(runtime: Runtime) -> None:
    job_id = submit_ingest(runtime.queue, runtime.jobs, runtime.order, SMALL)
    assert runtime.jobs.cancel(job_id) is True
    assert runtime_worker(runtime, poll_ms=10).run_once() == 1

    status = status_of(runtime, job_id)
    assert (status.status, status.documents_done, status.chunks) == ("cancelled", 0, 0)
    assert runtime.collection.document_points(SMALL[0].id) == []
    assert runtime.index.keys() == [] and runtime.queue.pending_count() == 0
    assert not runtime.order.pending(SMALL[0].id)
