"""Stops, failures and restarts of ingest jobs in process: a stopping worker hands its job back, a job given up on
is cleaned, and the embedded form's start sweeps what a dead process left, or resumes it."""

from __future__ import annotations

from typing import Any

import pytest
from ingest_support import OpenRuntime, expected_chunks, run_job
from qdrant_client import models

from service.jobs.queue import Delivery
from service.jobs.submit import submit_delete, submit_ingest
from service.retrieval.collection import ChunkCollection
from service.serving.runtime import Runtime
from tests.workers.test_workers_sigkill import corpus
from workers.worker import IngestWorker, runtime_worker

DOCUMENTS = corpus(12)  # several document groups at the test chunk and batch sizes
EMBEDDED: dict[str, Any] = {}


def visible_counts(collection: ChunkCollection, doc_ids: list[str]) -> dict[str, int]:
    return {doc_id: sum(p.visible for p in collection.document_state(doc_id)) for doc_id in doc_ids}


def chunk_counts(runtime: Runtime) -> dict[str, int]:
    counts: dict[str, int] = {}
    for chunk in expected_chunks(runtime, DOCUMENTS):
        counts[chunk.doc_id] = counts.get(chunk.doc_id, 0) + 1
    return counts


def stop_after_first_group(worker: IngestWorker, monkeypatch: pytest.MonkeyPatch) -> None:
    report = worker._progress

    def report_then_stop(delivery: Delivery, job_id: str, counts: Any) -> None:
        report(delivery, job_id, counts)
        worker.stop()

    monkeypatch.setattr(worker, "_progress", report_then_stop)


def test_a_stopping_worker_hands_its_job_back_between_groups(runtime: Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    job_id = submit_ingest(runtime.queue, runtime.jobs, runtime.order, DOCUMENTS)
    worker = runtime_worker(runtime, poll_ms=10)
    stop_after_first_group(worker, monkeypatch)

    assert worker.run_once() == 1

    status = runtime.jobs.get(job_id)
    assert status is not None and status.status == "queued"
    assert 1 <= status.documents_done < len(DOCUMENTS)
    assert (
        status.error
        == f"interrupted after {status.documents_done} of {len(DOCUMENTS)} documents (the worker stopped); queued again"
    )
    assert runtime.queue.pending_count() == 1
    counts, chunks = visible_counts(runtime.collection, [d.id for d in DOCUMENTS]), chunk_counts(runtime)
    assert {d: n for d, n in counts.items() if n not in (0, chunks[d])} == {}  # whole documents only
    assert sum(1 for d, n in counts.items() if n == chunks[d]) == status.documents_done

    (again,) = runtime.queue.consume("next", block_ms=100)
    assert again.attempt == 1  # handed back, not failed: the attempt is not spent
    runtime_worker(runtime, poll_ms=10).handle(again)

    final = runtime.jobs.get(job_id)
    assert final is not None
    assert (final.status, final.error, final.documents_done) == ("done", None, len(DOCUMENTS))
    # Only the rest was handed back (with the counts so far): the groups done are neither redone nor recounted.
    assert again.payload["documents"] == [d.to_json() for d in DOCUMENTS[status.documents_done :]]
    assert (final.chunks, final.chunks_precomputed, final.chunks_reused) == (
        sum(chunks.values()),
        sum(chunks.values()),
        0,
    )
    assert visible_counts(runtime.collection, list(chunks)) == chunks
    assert runtime.queue.pending_count() == 0


def test_a_job_given_up_on_leaves_no_unpublished_point_and_no_unnamed_block(
    open_test_runtime: OpenRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = open_test_runtime(job_max_attempts=1)
    publish = runtime.collection.publish
    broken = DOCUMENTS[1].id

    def fails_for_one_document(doc_id: str, version: str) -> int:
        if doc_id == broken:
            raise OSError("disk full")
        return publish(doc_id, version)

    monkeypatch.setattr(runtime.collection, "publish", fails_for_one_document)

    status = run_job(runtime, DOCUMENTS)

    assert status.status == "failed" and "disk full" in (status.error or "")
    counts = visible_counts(runtime.collection, [d.id for d in DOCUMENTS])
    assert counts[DOCUMENTS[0].id] == chunk_counts(runtime)[DOCUMENTS[0].id]  # published before the failure: kept
    assert counts[broken] == 0
    assert runtime.collection.invisible_points() == []
    named = {key for doc in DOCUMENTS for key in runtime.collection.document_kv_keys(doc.id)}
    assert set(runtime.index.keys()) == named  # blocks of the documents never published are released


@pytest.mark.parametrize("backend", [EMBEDDED])
def test_the_embedded_start_sweeps_what_no_queued_job_will_redo(
    open_test_runtime: OpenRuntime, backend: dict[str, Any]
) -> None:
    runtime = open_test_runtime()
    run_job(runtime, DOCUMENTS[:2])
    unpublish(runtime, DOCUMENTS[0].id)  # as a process killed before its publish leaves it
    kept_keys = runtime.collection.document_kv_keys(DOCUMENTS[1].id)

    reopened = open_test_runtime()

    assert visible_counts(reopened.collection, [DOCUMENTS[0].id]) == {DOCUMENTS[0].id: 0}
    assert reopened.collection.invisible_points() == []
    assert set(reopened.index.keys()) == kept_keys


@pytest.mark.parametrize("backend", [EMBEDDED])
def test_the_embedded_start_resumes_a_job_that_will_redo_its_unpublished_points(
    open_test_runtime: OpenRuntime, backend: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = open_test_runtime()
    job_id = submit_ingest(runtime.queue, runtime.jobs, runtime.order, DOCUMENTS)
    worker = runtime_worker(runtime, poll_ms=10)
    stop_after_first_group(worker, monkeypatch)
    worker.run_once()  # handed back: still queued when the process stops
    first = runtime.jobs.get(job_id)
    assert first is not None and first.status == "queued"

    reopened = open_test_runtime()

    resumed = reopened.jobs.get(job_id)
    assert resumed is not None and (resumed.status, resumed.documents_done) == ("queued", first.documents_done)
    runtime_worker(reopened, poll_ms=10).run_once()
    final = reopened.jobs.get(job_id)
    assert final is not None and (final.status, final.documents_done) == ("done", len(DOCUMENTS))
    assert visible_counts(reopened.collection, list(chunk_counts(reopened))) == chunk_counts(reopened)


def unpublish(runtime: Runtime, doc_id: str) -> None:
    collection = runtime.collection
    selector = models.Filter(must=[models.FieldCondition(key="doc_id", match=models.MatchValue(value=doc_id))])
    collection._client.set_payload(collection.name, payload={"visible": False}, points=selector)


def test_kv_computed_for_a_document_a_later_job_made_moot_is_released(runtime: Runtime) -> None:
    doc = DOCUMENTS[0]
    ingest_id = submit_ingest(runtime.queue, runtime.jobs, runtime.order, [doc])
    submit_delete(runtime.queue, runtime.jobs, runtime.order, doc.id)  # submitted later: the ingest must not apply
    worker = runtime_worker(runtime, poll_ms=10)

    worker.run_once()

    status = runtime.jobs.get(ingest_id)
    assert status is not None and (status.status, status.chunks_precomputed) == ("done", status.chunks)
    assert status.chunks >= 2
    assert runtime.collection.document_state(doc.id) == []
    assert runtime.index.keys() == []  # its blocks were computed (grouped before the check), then released
