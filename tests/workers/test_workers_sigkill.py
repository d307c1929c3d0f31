"""A real worker process killed with SIGKILL in the middle of a job: another worker finishes the job, and no chunk
is lost or stored twice, in Qdrant or in the KV store.

Two `python -m workers` processes over the Redis queue (the test's own key prefix) and one data dir with embedded
Qdrant. Embedded Qdrant lets one process at a time open a folder, so worker B starts only after A is dead, and the
test opens the collection only after B has stopped. A worker stopped by SIGTERM instead exits within
`KVSTITCH_SHUTDOWN_TIMEOUT_S` and hands its job back to the stream.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import pytest
import redis
from qdrant_client import QdrantClient

from service.engine.engine import StitchEngine
from service.jobs.documents import Document, document_version
from service.jobs.job_status import JobStatus
from service.jobs.ordering import RedisDocumentOrder
from service.jobs.queue import RedisStreamQueue
from service.jobs.status import RedisJobStatusStore
from service.jobs.submit import submit_ingest
from service.kvcache.fileformat import BLOCK_SUFFIX, block_relpath, is_temp_file, read_block
from service.kvcache.index import RedisIndex
from service.kvcache.keys import block_key, model_fingerprint
from service.retrieval.chunker import Chunker, ChunkerConfig
from service.retrieval.collection import point_id, unpack_token_ids
from service.settings import Settings
from service.usecases.ingest import EMBED_FORM

pytestmark = pytest.mark.slow

CHUNK_SIZE, CHUNK_OVERLAP = 48, 8
WORKER_SETTINGS = {
    "CHUNK_CONTEXT": "alone",  # the chunk context of the test's own engine, which keys the expected blocks
    "DEVICE": "cpu",
    "CHUNK_SIZE": str(CHUNK_SIZE),
    "CHUNK_OVERLAP": str(CHUNK_OVERLAP),
    "MAX_PRECOMPUTE_TOKENS": "256",  # a document group is ~4x this: progress, and a kill point, every few documents
    "JOB_CLAIM_IDLE_MS": "1000",
    "GPU_CACHE_MB": "0",
    "HOST_CACHE_MB": "4",
    "DISK_CACHE_MB": "1024",
}
DOCUMENTS = 60  # 120 paragraphs, ~600 chunks: seconds of work left after the first progress report
START_TIMEOUT_S = 240.0  # model, MiniLM and Qdrant imports on a loaded 2-core machine
FINISH_TIMEOUT_S = 240.0


# ---- the corpus ----------------------------------------------------------------------------------------------

SUBJECTS = ("The lighthouse keeper", "A marine biologist", "The old ferry", "Our night watchman", "The glacier")
VERBS = ("recorded", "counted", "painted", "repaired", "photographed", "described")
OBJECTS = ("storm petrels", "copper kettles", "tide pools", "signal flags", "whale bones", "lantern wicks")


def corpus(documents: int, paragraphs: int = 2, sentences: int = 4, seed: int = 7) -> list[Document]:
    """Documents of distinct sentences (each names its document, paragraph and sentence), so no chunk repeats."""
    rng = random.Random(seed)
    docs = []
    for d in range(documents):
        body = []
        for p in range(paragraphs):
            body.append(
                " ".join(
                    f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.randint(2, 999)} {rng.choice(OBJECTS)} "
                    f"in log {d}-{p}-{s}."
                    for s in range(sentences)
                )
            )
        docs.append(Document(f"log-{d:03d}.txt", "\n\n".join(body), {"n": d}))
    return docs


# ---- worker processes ----------------------------------------------------------------------------------------


@dataclass
class WorkerProcess:
    name: str
    process: subprocess.Popen[bytes]
    stdout: Path
    stderr: Path

    def alive(self) -> bool:
        return self.process.poll() is None

    def logs(self) -> str:
        out = self.stdout.read_text(errors="replace") if self.stdout.exists() else ""
        err = self.stderr.read_text(errors="replace") if self.stderr.exists() else ""
        return f"---- worker {self.name} (exit {self.process.poll()}) stdout ----\n{out}\n---- stderr ----\n{err}"


@pytest.fixture
def start_worker(tmp_path: Path) -> Iterator[Callable[[str, dict[str, str]], WorkerProcess]]:
    """Starts `python -m workers` processes; prints their logs at teardown (shown when the test fails) and kills
    any still running."""
    started: list[WorkerProcess] = []
    files: list[IO[bytes]] = []

    def start(name: str, env: dict[str, str]) -> WorkerProcess:
        stdout, stderr = tmp_path / f"worker-{name}.out", tmp_path / f"worker-{name}.err"
        files.extend([stdout.open("wb"), stderr.open("wb")])
        process = subprocess.Popen(
            [sys.executable, "-m", "workers"], env=env, cwd=tmp_path, stdout=files[-2], stderr=files[-1]
        )
        started.append(WorkerProcess(name, process, stdout, stderr))
        return started[-1]

    yield start
    for worker in started:
        if worker.alive():
            worker.process.kill()
            worker.process.wait(timeout=30)
    for file in files:
        file.close()
    for worker in started:
        print(worker.logs())


def worker_env(model_dir: Path, data_dir: Path, redis_url: str, redis_prefix: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("KVSTITCH_")}
    env.update({f"KVSTITCH_{name}": value for name, value in WORKER_SETTINGS.items()})
    env.update(
        {
            "KVSTITCH_MODEL": str(model_dir),
            "KVSTITCH_DATA_DIR": str(data_dir),
            "KVSTITCH_REDIS_URL": redis_url,
            "KVSTITCH_REDIS_PREFIX": redis_prefix,
            "PYTHONUNBUFFERED": "1",
            "HF_HUB_OFFLINE": "1",
        }
    )
    return env


def wait_for(
    jobs: RedisJobStatusStore,
    job_id: str,
    done: Callable[[JobStatus], bool],
    timeout_s: float,
    worker: WorkerProcess,
    poll_s: float = 0.02,
) -> JobStatus:
    """The first status that satisfies `done`; fails early when the worker process exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = jobs.get(job_id)
        assert status is not None, f"job {job_id} has no status"
        if done(status):
            return status
        assert worker.alive(), f"worker {worker.name} exited with {worker.process.poll()} before {done.__doc__}"
        time.sleep(poll_s)
    raise AssertionError(f"after {timeout_s} s: {jobs.get(job_id)}")


# ---- what the job must leave behind --------------------------------------------------------------------------


@dataclass(frozen=True)
class ExpectedPoint:
    id: str
    doc_id: str
    index: int
    version: str
    token_ids: tuple[int, ...]
    block: tuple[int, ...]
    kv_key: str


def expected_points(engine: StitchEngine, documents: list[Document]) -> list[ExpectedPoint]:
    """Computed here, independently of the workers, with the same model, template and chunker settings."""
    defaults = Settings()
    chunker = Chunker(engine.tokenizer, ChunkerConfig(CHUNK_SIZE, CHUNK_OVERLAP, defaults.max_document_chars))
    fingerprint = model_fingerprint(engine.model)
    chunking = f"size={CHUNK_SIZE};overlap={CHUNK_OVERLAP};template={engine.template.version};embed={EMBED_FORM}"
    expected = []
    for doc in documents:
        version = document_version(doc, chunking)
        for chunk in chunker.chunk(doc.id, doc.text, markdown=doc.format == "markdown"):
            block = engine.template.chunk_block(chunk.token_ids)
            key = block_key(fingerprint, engine.template.version, engine.spec.dtype, block)
            point = point_id(doc.id, chunk.index, version)
            expected.append(ExpectedPoint(point, doc.id, chunk.index, version, chunk.token_ids, block, key))
    return expected


def stored_points(qdrant_dir: Path, collection: str) -> list[dict[str, Any]]:
    """Every point of the collection (id and payload), read with a plain Qdrant client."""
    client = QdrantClient(path=str(qdrant_dir))
    try:
        points: list[dict[str, Any]] = []
        offset: Any = None
        while True:
            page, offset = client.scroll(collection, limit=256, offset=offset, with_payload=True, with_vectors=False)
            points += [{"id": str(p.id), **(p.payload or {})} for p in page]
            if offset is None:
                return points
    finally:
        client.close()


# ---- the test --------------------------------------------------------------------------------------------------


def test_a_job_whose_worker_is_sigkilled_is_finished_by_another_with_no_chunk_lost_or_doubled(
    tmp_path: Path,
    tiny_model_dirs: dict[str, Path],
    get_engine: Callable[[str, str], StitchEngine],
    redis_url: str,
    redis_prefix: str,
    start_worker: Callable[[str, dict[str, str]], WorkerProcess],
) -> None:
    data_dir = tmp_path / "data"
    env = worker_env(tiny_model_dirs["qwen2"], data_dir, redis_url, redis_prefix)
    # The names service.serving.runtime.open_jobs gives the stream, group, dead letters and statuses under the prefix.
    queue = RedisStreamQueue(
        redis_url,
        stream=f"{redis_prefix}:ingest",
        group=f"{redis_prefix}-workers",
        dead_letter=f"{redis_prefix}:ingest:dead",
    )
    jobs = RedisJobStatusStore(redis_url, prefix=f"{redis_prefix}:job")
    order = RedisDocumentOrder(redis_url, prefix=f"{redis_prefix}:doc")
    documents = corpus(DOCUMENTS)
    job_id = submit_ingest(queue, jobs, order, documents)

    worker_a = start_worker("a", env)

    def started_and_progressed(status: JobStatus) -> bool:
        """worker A reported progress"""
        return status.status == "running" and status.documents_done >= 1

    at_kill = wait_for(jobs, job_id, started_and_progressed, START_TIMEOUT_S, worker_a)
    os.kill(worker_a.process.pid, signal.SIGKILL)
    assert worker_a.process.wait(timeout=30) == -signal.SIGKILL
    after_kill = jobs.get(job_id)
    assert after_kill is not None
    assert at_kill.documents_done < at_kill.documents == DOCUMENTS
    assert after_kill.status == "running", "A finished the job before it was killed: make the job longer"
    assert queue.pending_count() == 1  # still in the stream, pending on the dead consumer

    worker_b = start_worker("b", env)

    def finished(status: JobStatus) -> bool:
        """the job finished"""
        return status.status in ("done", "failed")

    final = wait_for(jobs, job_id, finished, FINISH_TIMEOUT_S, worker_b, poll_s=0.2)
    worker_b.process.send_signal(signal.SIGTERM)
    assert worker_b.process.wait(timeout=60) == 0

    engine = get_engine("qwen2", "cpu")
    expected = expected_points(engine, documents)
    keys = {p.kv_key for p in expected}
    assert len(keys) == len(expected) > 3 * DOCUMENTS  # distinct chunks, several per document

    # The job: done by B, every chunk counted once; B reused the KV that A had stored before it died.
    assert (final.status, final.error) == ("done", None)
    assert (final.documents, final.documents_done, final.chunks) == (DOCUMENTS, DOCUMENTS, len(expected))
    assert final.chunks_precomputed + final.chunks_reused == len(expected)
    assert final.chunks_reused >= 1
    assert queue.pending_count() == 0 and queue.dead_letters() == []

    # Qdrant: exactly the expected points, each once, naming its chunk's KV block.
    points = stored_points(data_dir / "qdrant", Settings().collection)
    ids = [p["id"] for p in points]
    assert len(ids) == len(set(ids)) == len(expected)
    by_id = {p["id"]: p for p in points}
    assert set(by_id) == {p.id for p in expected}
    for want in expected:
        got = by_id[want.id]
        assert (got["doc_id"], got["index"], got["version"], got["kv_key"]) == (
            want.doc_id,
            want.index,
            want.version,
            want.kv_key,
        )
        assert unpack_token_ids(got["token_ids"]) == want.token_ids

    # The KV store: the index lists exactly the expected blocks, each file is there, whole and for its block.
    index = RedisIndex(redis_url, f"{redis_prefix}:kv")
    try:
        assert set(index.keys()) == keys
        kv_dir = data_dir / "kv"
        fingerprint = model_fingerprint(engine.model)
        for want in expected:
            entry = index.get(want.kv_key)
            path = kv_dir / block_relpath(want.kv_key)
            assert entry is not None and entry.path == block_relpath(want.kv_key)
            assert entry.nbytes == path.stat().st_size
            block = read_block(path, want.kv_key, fingerprint, engine.spec, expected_token_ids=want.block)
            assert block.token_ids == want.block
    finally:
        index.close()
    files = [p for p in kv_dir.rglob("*") if p.is_file()]
    assert {p.name.removesuffix(BLOCK_SUFFIX) for p in files if p.name.endswith(BLOCK_SUFFIX)} == keys
    leftovers = [p for p in files if not p.name.endswith(BLOCK_SUFFIX)]
    assert all(is_temp_file(p) for p in leftovers), leftovers  # a write cut by the kill: repair removes these

    client = redis.Redis.from_url(redis_url)
    try:
        assert client.xpending(queue.stream, queue.group)["pending"] == 0
    finally:
        client.close()
    queue.close()
    jobs.close()


def test_a_sigtermed_worker_hands_its_job_back_and_exits_within_the_timeout(
    tmp_path: Path,
    tiny_model_dirs: dict[str, Path],
    redis_url: str,
    redis_prefix: str,
    start_worker: Callable[[str, dict[str, str]], WorkerProcess],
) -> None:
    timeout_s = 8.0
    env = worker_env(tiny_model_dirs["qwen2"], tmp_path / "data", redis_url, redis_prefix)
    env["KVSTITCH_SHUTDOWN_TIMEOUT_S"] = str(timeout_s)
    queue = RedisStreamQueue(
        redis_url, stream=f"{redis_prefix}:ingest", group=f"{redis_prefix}-workers", dead_letter=f"{redis_prefix}:dead"
    )
    jobs = RedisJobStatusStore(redis_url, prefix=f"{redis_prefix}:job")
    order = RedisDocumentOrder(redis_url, prefix=f"{redis_prefix}:doc")
    job_id = submit_ingest(queue, jobs, order, corpus(DOCUMENTS))
    worker_a = start_worker("a", env)

    def progressed(status: JobStatus) -> bool:
        """worker A reported progress"""
        return status.status == "running" and status.documents_done >= 1

    wait_for(jobs, job_id, progressed, START_TIMEOUT_S, worker_a)
    signalled = time.monotonic()
    worker_a.process.send_signal(signal.SIGTERM)
    assert worker_a.process.wait(timeout=60) == 0
    took = time.monotonic() - signalled

    assert took < timeout_s, f"exit took {took:.1f} s"
    handed_back = jobs.get(job_id)
    assert handed_back is not None and handed_back.status == "queued"
    assert handed_back.documents_done < DOCUMENTS, "the job finished before the signal: make it longer"
    assert handed_back.error is not None and "interrupted after" in handed_back.error
    client = redis.Redis.from_url(redis_url)
    try:  # back in the stream for any worker, not pending on the one that stopped
        assert queue.pending_count() == 1 and client.xpending(queue.stream, queue.group)["pending"] == 0
    finally:
        client.close()

    worker_b = start_worker("b", env)

    def finished(status: JobStatus) -> bool:
        """the job finished"""
        return status.status in ("done", "failed")

    final = wait_for(jobs, job_id, finished, FINISH_TIMEOUT_S, worker_b, poll_s=0.2)
    worker_b.process.send_signal(signal.SIGTERM)
    assert worker_b.process.wait(timeout=60) == 0
    assert (final.status, final.error, final.documents_done) == ("done", None, DOCUMENTS)
    # Worker B got the rest of the job with its counts: nothing worker A did is redone or recounted.
    assert (final.chunks_reused, final.chunks_precomputed) == (0, final.chunks)
    assert queue.pending_count() == 0 and queue.dead_letters() == []
    for store in (queue, jobs, order):
        store.close()
