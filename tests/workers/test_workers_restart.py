"""`kvstitch serve` in the embedded form, stopped in the middle of an ingest job and started again on the same
data dir: by SIGKILL (no document is left partly visible; the job is resumed and ends done) and by SIGTERM (the
process exits within the shutdown timeout; the job is handed back and ends done after the restart). In both,
`GET /ingest/{id}` keeps answering for the job, and no KV block is left that no point names.

Real processes over the tiny model; Qdrant's local files are read only while no server holds them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx
import pytest

from service.devtools.ports import free_port
from service.engine.engine import StitchEngine
from service.jobs.documents import Document
from service.jobs.sqlite import SqliteJobStatusStore, jobs_path
from service.kvcache.fileformat import BLOCK_SUFFIX
from service.kvcache.index import SQLITE_FILENAME, SqliteIndex
from service.settings import Settings
from tests.workers.test_workers_sigkill import CHUNK_OVERLAP, CHUNK_SIZE, corpus, expected_points, stored_points

pytestmark = pytest.mark.slow

DOCUMENTS = 60  # ~600 chunks: seconds of work left after the first progress report
SHUTDOWN_TIMEOUT_S = 8.0
START_TIMEOUT_S = 240.0
FINISH_TIMEOUT_S = 240.0
SERVE_SETTINGS = {
    "CHUNK_CONTEXT": "alone",  # the chunk context of the test's own engine, which keys the expected blocks
    "DEVICE": "cpu",
    "CHUNK_SIZE": str(CHUNK_SIZE),
    "CHUNK_OVERLAP": str(CHUNK_OVERLAP),
    "MAX_PRECOMPUTE_TOKENS": "256",  # a document group every few documents: progress, and stop points
    "GPU_CACHE_MB": "0",
    "HOST_CACHE_MB": "4",
    "DISK_CACHE_MB": "1024",
    "SHUTDOWN_TIMEOUT_S": str(SHUTDOWN_TIMEOUT_S),
}


@dataclass
class Serve:
    """One `kvstitch serve` process and its log."""

    process: subprocess.Popen[bytes]
    url: str
    log: Path

    def alive(self) -> bool:
        return self.process.poll() is None

    def terminate(self, timeout_s: float = 60) -> float:
        """SIGTERM, then wait for a graceful exit (uvicorn re-raises the signal once shut down); the seconds it
        took."""
        signalled = time.monotonic()
        self.process.send_signal(signal.SIGTERM)
        assert self.process.wait(timeout=timeout_s) in (0, -signal.SIGTERM)
        assert "Application shutdown complete" in self.log.read_text(errors="replace")
        return time.monotonic() - signalled

    def job(self, job_id: str) -> httpx.Response:
        return httpx.get(f"{self.url}/ingest/{job_id}", timeout=10)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.alive(), f"kvstitch serve exited early:\n{self.log.read_text()}"
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise AssertionError(f"kvstitch serve did not become ready:\n{self.log.read_text()}")

    def wait_job(self, job_id: str, done: Callable[[dict[str, Any]], bool], timeout_s: float) -> dict[str, Any]:
        """The first status of the job that satisfies `done`; every answer on the way must be 200."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.alive(), f"kvstitch serve exited:\n{self.log.read_text()}"
            answer = self.job(job_id)
            assert answer.status_code == 200, answer.text
            status: dict[str, Any] = answer.json()
            if done(status):
                return status
            time.sleep(0.02)
        raise AssertionError(f"after {timeout_s} s: {self.job(job_id).json()}")


StartServe = Callable[[], Serve]


@pytest.fixture
def start_serve(tmp_path: Path, tiny_model_dirs: dict[str, Path]) -> Iterator[StartServe]:
    """Starts `kvstitch serve` processes on one data dir, one at a time; kills what is left at teardown and prints
    the logs (shown when the test fails)."""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("KVSTITCH_")}
    env.update({f"KVSTITCH_{name}": value for name, value in SERVE_SETTINGS.items()})
    env.update({"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"})
    started: list[Serve] = []
    files: list[IO[bytes]] = []

    def start() -> Serve:
        port = free_port()
        log = tmp_path / f"serve-{len(started)}.log"
        files.append(log.open("wb"))
        command = [sys.executable, "-m", "service", "serve", "--model", str(tiny_model_dirs["qwen2"]),
                   "--data-dir", str(tmp_path / "data"), "--port", str(port)]  # fmt: skip
        process = subprocess.Popen(command, env=env, cwd=tmp_path, stdout=files[-1], stderr=subprocess.STDOUT)
        started.append(Serve(process, f"http://127.0.0.1:{port}", log))
        started[-1].wait_ready()
        return started[-1]

    yield start
    for serve in started:
        if serve.alive():
            serve.process.kill()
            serve.process.wait(timeout=30)
    for file in files:
        file.close()
    for serve in started:
        print(f"---- {serve.log.name} ----\n{serve.log.read_text(errors='replace')}")


def submit(serve: Serve, documents: list[Document]) -> str:
    body = {"documents": [{"id": d.id, "text": d.text, "metadata": d.metadata} for d in documents]}
    answer = httpx.post(f"{serve.url}/ingest", json=body, timeout=30)
    assert answer.status_code == 202, answer.text
    job_id: str = answer.json()["job_id"]
    return job_id


def progressed(status: dict[str, Any]) -> bool:
    return status["status"] == "running" and status["documents_done"] >= 1


def finished(status: dict[str, Any]) -> bool:
    return status["status"] in ("done", "failed")


def chunks_per_document(engine: StitchEngine, documents: list[Document]) -> dict[str, int]:
    return dict(Counter(p.doc_id for p in expected_points(engine, documents)))


def visible_per_document(data_dir: Path) -> tuple[dict[str, int], list[dict[str, Any]]]:
    """Visible points per document, and every point, as Qdrant's local files hold them."""
    points = stored_points(data_dir / "qdrant", Settings().collection)
    return dict(Counter(p["doc_id"] for p in points if p.get("visible") is not False)), points


def assert_complete(data_dir: Path, engine: StitchEngine, documents: list[Document]) -> None:
    """Every document whole and visible, nothing unpublished, and every KV block named by some point."""
    expected = expected_points(engine, documents)
    visible, points = visible_per_document(data_dir)
    assert visible == chunks_per_document(engine, documents)
    assert len(points) == len(expected)  # no unpublished point left over
    named = {p["kv_key"] for p in points}
    assert named == {p.kv_key for p in expected}
    index = SqliteIndex(data_dir / SQLITE_FILENAME)
    try:
        assert set(index.keys()) == named  # no block indexed that no point names
    finally:
        index.close()
    files = {p.name.removesuffix(BLOCK_SUFFIX) for p in (data_dir / "kv").rglob(f"*{BLOCK_SUFFIX}")}
    assert files == named  # no block file that no point names


def test_a_sigkilled_serve_resumes_its_job_and_no_document_was_ever_partly_visible(
    tmp_path: Path, start_serve: StartServe, get_engine: Callable[[str, str], StitchEngine]
) -> None:
    data_dir = tmp_path / "data"
    documents = corpus(DOCUMENTS)
    engine = get_engine("qwen2", "cpu")
    chunks = chunks_per_document(engine, documents)
    first = start_serve()
    job_id = submit(first, documents)

    at_kill = first.wait_job(job_id, progressed, START_TIMEOUT_S)
    os.kill(first.process.pid, signal.SIGKILL)
    assert first.process.wait(timeout=30) == -signal.SIGKILL

    # On disk right after the kill: each document has all of its chunks visible or none.
    visible, _ = visible_per_document(data_dir)
    assert {doc: n for doc, n in visible.items() if n != chunks[doc]} == {}
    assert 1 <= len(visible) < DOCUMENTS, "the job finished before the kill: make it longer"
    assert at_kill["documents_done"] < DOCUMENTS
    statuses = SqliteJobStatusStore(jobs_path(data_dir))
    left = statuses.get(job_id)
    statuses.close()
    assert left is not None and left.status == "running"

    second = start_serve()
    assert second.job(job_id).status_code == 200  # the accepted job is still known after the restart
    final = second.wait_job(job_id, finished, FINISH_TIMEOUT_S)
    second.terminate()

    assert (final["status"], final["error"]) == ("done", None)
    assert (final["documents"], final["documents_done"]) == (DOCUMENTS, DOCUMENTS)
    assert final["chunks_reused"] >= 1  # the KV stored before the kill was used, not recomputed
    assert_complete(data_dir, engine, documents)


def test_sigterm_stops_serve_within_the_timeout_and_the_job_ends_done_after_a_restart(
    tmp_path: Path, start_serve: StartServe, get_engine: Callable[[str, str], StitchEngine]
) -> None:
    data_dir = tmp_path / "data"
    documents = corpus(DOCUMENTS)
    first = start_serve()
    job_id = submit(first, documents)
    first.wait_job(job_id, progressed, START_TIMEOUT_S)

    took = first.terminate()

    assert took < SHUTDOWN_TIMEOUT_S, f"exit took {took:.1f} s"
    statuses = SqliteJobStatusStore(jobs_path(data_dir))
    handed_back = statuses.get(job_id)
    statuses.close()
    assert handed_back is not None and handed_back.status == "queued"
    assert handed_back.error is not None and "interrupted after" in handed_back.error
    assert handed_back.documents_done < DOCUMENTS, "the job finished before the signal: make it longer"

    second = start_serve()
    final = second.wait_job(job_id, finished, FINISH_TIMEOUT_S)
    second.terminate()

    assert (final["status"], final["error"], final["documents_done"]) == ("done", None, DOCUMENTS)
    # The rest of the job was handed back with its counts: nothing done before the stop is redone or recounted.
    assert (final["chunks_reused"], final["chunks_precomputed"]) == (0, final["chunks"])
    assert_complete(data_dir, get_engine("qwen2", "cpu"), documents)
