"""Ingest jobs end to end through the worker loop: chunks in Qdrant, KV on disk, versions, deletion, reuse."""

from __future__ import annotations

import time

import pytest
import torch
from ingest_support import CORPUS, OpenRuntime, expected_chunks, run_job

from service.jobs.documents import DeleteJob, Document
from service.jobs.submit import submit_ingest
from service.kvcache.store import Tier
from service.serving.runtime import Runtime
from workers.worker import runtime_worker


def test_a_job_makes_every_chunk_retrievable_with_its_kv_stored(runtime: Runtime) -> None:
    status = run_job(runtime, CORPUS)
    expected = expected_chunks(runtime, CORPUS)

    assert status.status == "done" and status.error is None
    assert (status.documents, status.documents_done, status.chunks) == (len(CORPUS), len(CORPUS), len(expected))
    assert status.chunks_precomputed == len({c.kv_key for c in expected}) and status.chunks_reused == 0
    assert runtime.collection.count() == len(expected)
    for chunk in expected:
        best = runtime.collection.search(runtime.embedder.embed_query(chunk.text), top_k=1)[0]
        found = (best.doc_id, best.index, best.text, best.token_ids, best.kv_key)
        assert found == (chunk.doc_id, chunk.index, chunk.text, chunk.token_ids, chunk.kv_key)
        assert runtime.store.disk.contains(chunk.kv_key)


def test_stored_kv_equals_a_fresh_precompute_of_the_same_block(runtime: Runtime) -> None:
    run_job(runtime, CORPUS[:1])
    blocks = [runtime.engine.template.chunk_block(c.token_ids) for c in expected_chunks(runtime, CORPUS[:1])]
    block_ids = blocks[0]

    fetched = runtime.store.fetch([block_ids])

    assert fetched.sources == [Tier.DISK]
    # Computed as the worker computed it: in one padded batch with the document's other blocks (a CPU matmul
    # over another padded shape may differ in the last bit, which is not what this test is about).
    fresh = runtime.engine.precompute(blocks)[0]
    torch.testing.assert_close(fetched.blocks[0].kv, fresh.kv, rtol=0, atol=0)


def test_ingesting_unchanged_documents_again_recomputes_and_embeds_nothing(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = run_job(runtime, CORPUS)
    calls = {"embed": 0, "precompute": 0}
    _count_calls(runtime, calls, monkeypatch)

    second = run_job(runtime, CORPUS)

    assert second.status == "done"
    assert (second.chunks, second.chunks_precomputed, second.chunks_reused) == (first.chunks, 0, first.chunks)
    assert calls == {"embed": 0, "precompute": 0}
    assert runtime.collection.count() == first.chunks


def test_the_same_text_under_two_ids_is_stored_once(runtime: Runtime) -> None:
    text = CORPUS[0].text
    status = run_job(runtime, [Document("copy-a", text), Document("copy-b", text)])

    per_doc = len(expected_chunks(runtime, [Document("copy-a", text)]))
    assert status.chunks == 2 * per_doc
    assert (status.chunks_precomputed, status.chunks_reused) == (per_doc, per_doc)
    assert len(runtime.index.keys()) == per_doc
    assert runtime.collection.count() == 2 * per_doc


def test_reingesting_a_changed_document_replaces_its_version_and_releases_unused_blocks(runtime: Runtime) -> None:
    doc = CORPUS[0]
    run_job(runtime, [doc])
    old_keys = {c.kv_key for c in expected_chunks(runtime, [doc])}
    kept = "\n\n".join(doc.text.split("\n\n")[:2])
    changed = Document(doc.id, kept + "\n\nA brand new closing paragraph about sea otters.", doc.metadata, doc.format)
    new_keys = {c.kv_key for c in expected_chunks(runtime, [changed])}
    assert old_keys & new_keys and old_keys - new_keys  # the first paragraph's chunk is shared

    status = run_job(runtime, [changed])

    assert status.status == "done"
    assert len(runtime.collection.document_versions(doc.id)) == 1
    assert runtime.collection.count() == len(expected_chunks(runtime, [changed]))
    assert runtime.collection.document_kv_keys(doc.id) == new_keys
    assert set(runtime.index.keys()) == new_keys
    assert status.chunks_reused == len(old_keys & new_keys)


def test_deleting_a_document_removes_its_points_and_blocks_but_keeps_shared_ones(runtime: Runtime) -> None:
    shared = CORPUS[0].text
    keep, drop = Document("keep", shared), Document("drop", shared + "\n\nOnly the dropped one says this.")
    run_job(runtime, [keep, drop])
    kept_keys = {c.kv_key for c in expected_chunks(runtime, [keep])}
    drop_keys = {c.kv_key for c in expected_chunks(runtime, [drop])}
    assert kept_keys & drop_keys and drop_keys - kept_keys

    counts = runtime.ingestor().delete(DeleteJob("delete-drop", "drop"))

    assert (counts.chunks_deleted, counts.blocks_released) == (len(drop_keys), len(drop_keys - kept_keys))
    assert runtime.collection.document_versions("drop") == set()
    assert set(runtime.index.keys()) == kept_keys
    assert runtime.collection.count() == len(kept_keys)


def test_a_restarted_runtime_finds_the_ingested_documents_and_kv(open_test_runtime: OpenRuntime) -> None:
    first = open_test_runtime()
    status = run_job(first, CORPUS)

    again = open_test_runtime()  # closes the first one

    assert again.collection.count() == status.chunks
    assert len(again.index.keys()) == status.chunks_precomputed
    repeat = run_job(again, CORPUS)
    assert repeat.chunks_precomputed == 0


def test_a_failing_step_is_retried_and_then_succeeds(runtime: Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    real_embed = runtime.embedder.embed_documents
    failures = iter([RuntimeError("embedding server hiccup")])

    def flaky(texts: list[str]) -> list[list[float]]:
        error = next(failures, None)
        if error is not None:
            raise error
        return real_embed(texts)

    monkeypatch.setattr(runtime.embedder, "embed_documents", flaky)
    job_id = submit_ingest(runtime.queue, runtime.jobs, runtime.order, CORPUS[:1])
    worker = runtime_worker(runtime, poll_ms=10)

    worker.run_once()
    retrying = runtime.jobs.get(job_id)
    assert retrying is not None and retrying.status == "queued"
    assert retrying.error is not None and "embedding server hiccup" in retrying.error
    worker.run_once()
    done = runtime.jobs.get(job_id)
    assert done is not None and done.status == "done" and done.error is None
    assert runtime.queue.pending_count() == 0


def test_a_job_failing_every_attempt_ends_failed_in_the_dead_letters(
    open_test_runtime: OpenRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = open_test_runtime(job_max_attempts=2)

    def broken(texts: list[str]) -> list[list[float]]:
        raise RuntimeError("disk full")

    monkeypatch.setattr(runtime.embedder, "embed_documents", broken)
    job_id = submit_ingest(runtime.queue, runtime.jobs, runtime.order, CORPUS[:1])
    worker = runtime_worker(runtime, poll_ms=10)
    worker.run_once()
    worker.run_once()

    failed = runtime.jobs.get(job_id)
    assert failed is not None and failed.status == "failed"
    assert failed.error is not None and "after 2 attempts" in failed.error and "disk full" in failed.error
    dead = runtime.queue.dead_letters()
    assert len(dead) == 1 and "disk full" in dead[0].error
    assert runtime.queue.pending_count() == 0


def _count_calls(runtime: Runtime, calls: dict[str, int], monkeypatch: pytest.MonkeyPatch) -> None:
    embed, precompute = runtime.embedder.embed_documents, runtime.engine.precompute

    def counting_embed(texts: list[str]) -> list[list[float]]:
        calls["embed"] += 1
        return embed(texts)

    def counting_precompute(blocks: list[tuple[int, ...]]) -> list[object]:
        calls["precompute"] += 1
        return list(precompute(blocks))

    monkeypatch.setattr(runtime.embedder, "embed_documents", counting_embed)
    monkeypatch.setattr(runtime.engine, "precompute", counting_precompute)


def test_a_job_whose_workers_keep_dying_ends_failed_not_running(open_test_runtime: OpenRuntime) -> None:
    runtime = open_test_runtime(job_max_attempts=1)
    job_id = submit_ingest(runtime.queue, runtime.jobs, runtime.order, CORPUS[:1])
    taken = runtime.queue.consume("doomed-worker", block_ms=10)  # a worker takes the job and dies: no ack
    assert len(taken) == 1
    runtime.jobs.update(job_id, status="running")
    worker = runtime_worker(runtime, poll_ms=10)
    outcomes: list[str] = []
    worker.on_job_finished = lambda outcome, counts: outcomes.append(outcome)

    time.sleep(0.3)  # past job_claim_idle_ms (200 ms in these tests)
    worker.run_once()

    status = runtime.jobs.get(job_id)
    assert status is not None and status.status == "failed"
    assert status.error is not None and "without an ack" in status.error
    assert [d.original_id for d in runtime.queue.dead_letters()] == [taken[0].message_id]
    assert outcomes == ["failed"] and runtime.queue.pending_count() == 0


def test_ingested_points_are_found_by_the_words_of_their_title_with_hybrid_search(
    open_test_runtime: OpenRuntime,
) -> None:
    # The sparse vector is made of what is embedded (the title in front of the chunk), not of the chunk text alone.
    titled = Document("notes.txt", "Sea otters hold hands while they sleep.", {"title": "Zorblax field notes"})
    runtime = open_test_runtime(hybrid_search=True)  # embedded Qdrant: hybrid only when asked for
    run_job(runtime, [*CORPUS, titled])
    question = "zorblax"
    knight = runtime.embedder.embed_query("which chess piece can jump over others")

    assert runtime.collection.hybrid
    best = runtime.collection.search_many([knight], [3], [question])[0][0]  # both rankings hold every chunk
    assert (best.doc_id, best.text) == ("notes.txt", "Sea otters hold hands while they sleep.")
    assert runtime.collection.search(knight, top_k=1)[0].doc_id == "chess.txt"  # dense alone

    off = open_test_runtime(hybrid_search=False)  # KVSTITCH_HYBRID_SEARCH=false: the same points, dense only
    assert (off.collection.sparse, off.collection.hybrid) == (True, False)
    assert off.collection.search_many([knight], [1], [question])[0][0].doc_id == "chess.txt"
