"""KV blocks a killed job left behind are released: by a cancel after the crash, and by the start-up sweep of
blocks no point names (past a grace period), counted in `kvstitch_kv_blocks_swept_total`."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from ingest_support import CORPUS, expected_chunks

from service.engine.engine import StitchEngine
from service.jobs.submit import submit_ingest
from service.retrieval.embedder import Embedder
from service.serving.runtime import Runtime
from service.serving.server import Server
from service.settings import Settings
from workers.worker import runtime_worker

OpenRuntime = Callable[..., Runtime]


class Killed(BaseException):
    """Stands for SIGKILL: nothing of the worker's own handling runs, the job stays pending."""


def kill_between_kv_and_points(runtime: Runtime, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a job that dies after storing its KV blocks and before writing any point; its id."""
    job_id = submit_ingest(runtime.queue, runtime.jobs, runtime.order, CORPUS)

    def die(*args: Any, **kwargs: Any) -> None:
        raise Killed

    with monkeypatch.context() as patched:
        patched.setattr(runtime.collection, "upsert", die)
        with pytest.raises(Killed):
            runtime_worker(runtime, poll_ms=10).run_once()
    return job_id


def unnamed_blocks(runtime: Runtime) -> set[str]:
    named = {key for doc in CORPUS for key in runtime.collection.document_kv_keys(doc.id)}
    return set(runtime.index.keys()) - named


def test_a_cancel_after_a_crash_releases_the_blocks_the_crashed_run_stored(
    open_test_runtime: OpenRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = open_test_runtime()
    job_id = kill_between_kv_and_points(runtime, monkeypatch)
    stored = unnamed_blocks(runtime)
    assert stored and stored == {chunk.kv_key for chunk in expected_chunks(runtime, CORPUS)}

    runtime = open_test_runtime(kv_sweep_grace_s=3600)  # the restart: its sweep leaves blocks this young
    assert set(runtime.index.keys()) == stored
    assert runtime.jobs.cancel(job_id) is True
    time.sleep(0.3)  # the Redis form: the dead consumer's job becomes claimable after JOB_CLAIM_IDLE_MS
    assert runtime_worker(runtime, poll_ms=10).run_once() == 1

    status = runtime.jobs.get(job_id)
    assert status is not None
    assert (status.status, status.blocks_released) == ("cancelled", len(stored))
    assert runtime.index.keys() == [] and not list((runtime.settings.kv_dir).rglob("*.kvblock"))
    assert runtime.collection.invisible_points() == []


def test_the_start_up_sweep_releases_unnamed_blocks_past_the_grace_and_the_job_still_finishes(
    open_test_runtime: OpenRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = open_test_runtime()
    job_id = kill_between_kv_and_points(runtime, monkeypatch)
    stored = unnamed_blocks(runtime)

    kept = open_test_runtime(kv_sweep_grace_s=3600)
    assert kept.blocks_swept == 0 and set(kept.index.keys()) == stored

    runtime = open_test_runtime(kv_sweep_grace_s=0)
    assert runtime.blocks_swept == len(stored) and runtime.index.keys() == []

    time.sleep(0.3)
    worker = runtime_worker(runtime, poll_ms=10)
    for _ in range(10):
        worker.run_once()
        status = runtime.jobs.get(job_id)
        if status is not None and status.status == "done":
            break
    assert status is not None and status.status == "done"
    assert unnamed_blocks(runtime) == set() and set(runtime.index.keys()) == stored  # recomputed, all named now


def test_the_sweep_is_counted_in_the_metrics(
    tmp_path: Path,
    tiny_model_dirs: dict[str, Path],
    get_engine: Callable[[str, str], StitchEngine],
    worker_embedder: Embedder,
    open_test_runtime: OpenRuntime,
    backend: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if backend:
        pytest.skip("one form is enough: the count comes from the same sweep")
    runtime = open_test_runtime()
    kill_between_kv_and_points(runtime, monkeypatch)
    stored = unnamed_blocks(runtime)
    runtime.close()

    settings = runtime.settings.model_copy(update={"kv_sweep_grace_s": 0.0, "gate_on_start": False})
    server = Server(Settings.model_validate(settings.model_dump()), get_engine("qwen2", "cpu"), worker_embedder)
    try:
        server.start_now()
        text = server.metrics_text().decode()
    finally:
        server.close()
    assert f"kvstitch_kv_blocks_swept_total {float(len(stored))}" in text
