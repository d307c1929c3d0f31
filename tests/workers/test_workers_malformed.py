"""Malformed jobs and documents: a failed status naming the field, a dead letter, nothing stored, and a worker
that goes on to the next job. Then the `kvstitch ingest` command's own checks of files and folders."""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from ingest_support import OpenRuntime, expected_chunks

from service.cli import main as kvstitch
from service.commands.ingest import InputError, collect_documents
from service.engine.engine import StitchEngine
from service.jobs.documents import MAX_DOC_ID_CHARS, MAX_METADATA_BYTES, Document
from service.jobs.job_status import JobStatus
from service.jobs.queue import RedisStreamQueue
from service.jobs.submit import submit_ingest
from service.kvcache.index import open_index
from service.plain_json import MAX_DEPTH
from service.retrieval.chunker import Chunker, ChunkerConfig
from service.retrieval.collection import ChunkCollection
from service.retrieval.embedder import Embedder
from service.serving.runtime import Runtime
from workers.worker import IngestWorker, runtime_worker

MAX_CHARS = 300  # max_document_chars of these tests' runtimes
MAX_DOCS = 3  # max_documents_per_job
GOOD = Document("chess.txt", "In chess the knight is the only piece that can jump over other pieces.")
VALID = {"id": "valid.txt", "text": "A valid first document that must not be stored either.", "format": "text"}


def nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(depth):
        value = {"k": value}
    return value


@dataclass(frozen=True)
class Case:
    """A job's `documents` field and the exact error its status and dead letter must carry."""

    documents: Any
    error: str


ID_RULE = f"must be a non-blank string of at most {MAX_DOC_ID_CHARS} characters"
CASES: dict[str, Case] = {
    "documents-an-object": Case({"id": "a", "text": "x"}, "documents must be a non-empty list"),
    "documents-a-string": Case("otters.txt", "documents must be a non-empty list"),
    "documents-missing": Case(None, "documents must be a non-empty list"),
    "documents-empty": Case([], "documents must be a non-empty list"),
    "document-a-string": Case(["plain text"], "documents[0] must be an object, got str"),
    "document-null-after-a-valid-one": Case([VALID, None], "documents[1] must be an object, got null"),
    "document-a-list": Case([VALID, ["id", "text"]], "documents[1] must be an object, got list"),
    "id-missing": Case([{"text": "some text"}], f"documents[0].id {ID_RULE}"),
    "id-blank": Case([VALID, {"id": " \t ", "text": "some text"}], f"documents[1].id {ID_RULE}"),
    "id-too-long": Case([{"id": "x" * (MAX_DOC_ID_CHARS + 1), "text": "some text"}], f"documents[0].id {ID_RULE}"),
    "id-an-int": Case([VALID, {"id": 7, "text": "some text"}], f"documents[1].id {ID_RULE}"),
    "id-with-a-newline": Case(
        [VALID, {"id": "a\nb", "text": "some text"}], "documents[1].id must not contain control characters"
    ),
    "id-with-a-nul": Case([{"id": "a\x00b", "text": "x"}], "documents[0].id must not contain control characters"),
    "text-an-int": Case([VALID, {"id": "b", "text": 42}], "documents[1].text must be a string, got int"),
    "text-null": Case([{"id": "b", "text": None}], "documents[0].text must be a string, got null"),
    "text-missing": Case([VALID, {"id": "b"}], "documents[1].text must be a string, got null"),
    "text-a-list": Case([{"id": "b", "text": ["a", "b"]}], "documents[0].text must be a string, got list"),
    "text-a-bool": Case([{"id": "b", "text": True}], "documents[0].text must be a string, got bool"),
    "text-empty": Case([VALID, {"id": "b", "text": ""}], "documents[1].text is empty (nothing to ingest)"),
    "text-whitespace-only": Case([{"id": "b", "text": " \n\t\n "}], "documents[0].text is empty (nothing to ingest)"),
    "text-too-long": Case(
        [VALID, {"id": "b", "text": "y" * (MAX_CHARS + 1)}],
        f"documents[1].text has {MAX_CHARS + 1} characters; the limit is {MAX_CHARS}",
    ),
    "metadata-a-list": Case(
        [VALID, {"id": "b", "text": "x", "metadata": ["topic"]}],
        "documents[1].metadata must be an object with string keys, got list",
    ),
    "metadata-a-string": Case(
        [{"id": "b", "text": "x", "metadata": "topic=food"}],
        "documents[0].metadata must be an object with string keys, got str",
    ),
    "metadata-too-large": Case(
        [{"id": "b", "text": "x", "metadata": {"blob": "z" * MAX_METADATA_BYTES}}],
        f"documents[0].metadata is larger than {MAX_METADATA_BYTES} bytes as JSON",
    ),
    "metadata-too-deep": Case(
        [{"id": "b", "text": "x", "metadata": nested(100)}],
        "documents[0].metadata" + ".k" * MAX_DEPTH + f": nested deeper than {MAX_DEPTH} levels",
    ),
    "format-unknown": Case(
        [VALID, {"id": "b", "text": "x", "format": "pdf"}],
        "documents[1].format must be one of text, markdown, got 'pdf'",
    ),
    "format-null": Case(
        [{"id": "b", "text": "x", "format": None}], "documents[0].format must be one of text, markdown, got None"
    ),
    "format-a-huge-string": Case(
        [{"id": "b", "text": "x", "format": "m" * 100_000}],
        "documents[0].format must be one of text, markdown, got '" + "m" * 78 + "…",
    ),
    "duplicate-ids": Case(
        [VALID, {"id": "b", "text": "x"}, {"id": "valid.txt", "text": "another text"}],
        "documents[2].id 'valid.txt' appears twice in one job",
    ),
    "too-many-documents": Case(
        [{"id": f"d{i}", "text": f"document number {i}"} for i in range(MAX_DOCS + 1)],
        f"a job holds at most {MAX_DOCS} documents, got {MAX_DOCS + 1}",
    ),
}


@pytest.fixture
def runtime(open_test_runtime: OpenRuntime) -> Runtime:
    """A runtime (embedded or Redis) with small document limits, so the limits can be crossed cheaply."""
    return open_test_runtime(max_document_chars=MAX_CHARS, max_documents_per_job=MAX_DOCS)


def enqueue_raw(runtime: Runtime, payload: dict[str, Any], create_status: bool = True) -> None:
    """Queue a payload as a producer that skipped validation would: status first (when asked), then the job."""
    if create_status:
        documents = payload.get("documents")
        runtime.jobs.create(payload["job_id"], len(documents) if isinstance(documents, list) else 0)
    runtime.queue.enqueue(payload)


def assert_nothing_stored(runtime: Runtime) -> None:
    assert runtime.collection.count() == 0
    assert runtime.index.keys() == []
    assert list(runtime.settings.kv_dir.rglob("*.kvblock")) == []


def assert_good_job_runs(runtime: Runtime, worker: IngestWorker) -> JobStatus:
    """A well-formed job queued after the bad one is ingested by the same worker object."""
    job_id = submit_ingest(runtime.queue, runtime.jobs, runtime.order, [GOOD])
    assert worker.run_once() == 1
    status = runtime.jobs.get(job_id)
    expected = expected_chunks(runtime, [GOOD])
    assert status is not None and (status.status, status.error) == ("done", None)
    assert (status.documents_done, status.chunks) == (1, len(expected))
    assert runtime.collection.count() == len(expected)
    assert set(runtime.index.keys()) == {c.kv_key for c in expected}
    assert runtime.queue.pending_count() == 0
    return status


# ---- malformed documents: every backend ----------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES.values(), ids=list(CASES))
def test_a_malformed_job_fails_naming_the_field_and_the_worker_goes_on(runtime: Runtime, case: Case) -> None:
    payload: dict[str, Any] = {"job_id": "bad-job", "documents": case.documents}
    if case.documents is None:
        del payload["documents"]
    enqueue_raw(runtime, payload)
    worker = runtime_worker(runtime, poll_ms=10)

    assert worker.run_once() == 1

    status = runtime.jobs.get("bad-job")
    assert status is not None
    assert (status.status, status.error) == ("failed", case.error)
    assert (status.documents_done, status.chunks, status.chunks_precomputed) == (0, 0, 0)
    assert status.finished_at is not None
    (dead,) = runtime.queue.dead_letters()
    assert (dead.error, dead.attempts) == (case.error, 1)
    assert json.loads(dead.payload) == payload
    assert runtime.queue.pending_count() == 0
    assert (worker.jobs_failed, worker.jobs_done) == (1, 0)
    assert_nothing_stored(runtime)

    assert_good_job_runs(runtime, worker)
    assert (worker.jobs_failed, worker.jobs_done) == (1, 1)


def test_a_malformed_job_nobody_gave_a_status_gets_a_failed_one(runtime: Runtime) -> None:
    enqueue_raw(runtime, {"job_id": "no-status", "documents": [{"id": "a", "text": 3.5}]}, create_status=False)
    worker = runtime_worker(runtime, poll_ms=10)

    worker.run_once()

    status = runtime.jobs.get("no-status")
    assert status is not None
    assert (status.status, status.documents, status.error) == (
        "failed",
        1,
        "documents[0].text must be a string, got float",
    )
    assert_good_job_runs(runtime, worker)


@pytest.mark.parametrize(
    "job_id",
    [None, "", 17, "x" * 129, "tab\there", ["j"]],
    ids=["missing", "empty", "an-int", "too-long", "control-char", "a-list"],
)
def test_a_job_without_a_usable_job_id_is_dead_lettered_without_a_status(runtime: Runtime, job_id: Any) -> None:
    payload: dict[str, Any] = {"documents": [VALID]}
    if job_id is not None:
        payload["job_id"] = job_id
    runtime.queue.enqueue(payload)
    worker = runtime_worker(runtime, poll_ms=10)

    assert worker.run_once() == 1

    (dead,) = runtime.queue.dead_letters()
    assert dead.error == "job_id must be a printable string of 1-128 characters"
    assert json.loads(dead.payload) == payload
    if isinstance(job_id, str) and job_id:
        assert runtime.jobs.get(job_id) is None
    assert worker.jobs_failed == 1
    assert_nothing_stored(runtime)
    assert_good_job_runs(runtime, worker)


@pytest.mark.parametrize(
    "metadata",
    [{"when": datetime.date(2026, 11, 21)}, {"score": float("nan")}, {"weights": {1, 2}}],
    ids=["a-date", "nan", "a-set"],
)
def test_metadata_that_is_not_json_fails_at_submit_with_a_failed_status(runtime: Runtime, metadata: Any) -> None:
    with pytest.raises(ValueError, match="job payload is not JSON-serializable"):
        submit_ingest(
            runtime.queue, runtime.jobs, runtime.order, [Document("a.txt", "some text", metadata)], job_id="unjsonable"
        )

    status = runtime.jobs.get("unjsonable")
    assert status is not None and status.status == "failed"
    assert status.error is not None
    assert status.error.startswith("could not queue the job: job payload is not JSON-serializable")
    assert runtime.queue.pending_count() == 0
    assert_good_job_runs(runtime, runtime_worker(runtime, poll_ms=10))


def test_the_worker_loop_survives_a_run_of_malformed_jobs(runtime: Runtime, caplog: pytest.LogCaptureFixture) -> None:
    for n, case in enumerate(CASES.values()):
        enqueue_raw(runtime, {"job_id": f"bad-{n}", "documents": case.documents})
    runtime.queue.enqueue({"documents": "no job id either"})
    good_id = submit_ingest(runtime.queue, runtime.jobs, runtime.order, [GOOD])
    worker = runtime_worker(runtime, poll_ms=10)

    with caplog.at_level(logging.WARNING), running(worker):
        final = wait_finished(runtime, good_id, timeout_s=60)

    assert final.status == "done"
    errors = {f"bad-{n}": case.error for n, case in enumerate(CASES.values())}
    found = {job_id: _status(runtime, job_id) for job_id in errors}
    assert {job_id: (s.status, s.error) for job_id, s in found.items()} == {
        job_id: ("failed", error) for job_id, error in errors.items()
    }
    assert len(runtime.queue.dead_letters(limit=1000)) == len(CASES) + 1
    assert (worker.jobs_failed, worker.jobs_done) == (len(CASES) + 1, 1)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # no "queue error; retrying"


# ---- what only a Redis stream can carry ------------------------------------------------------------------------


def xadd(runtime: Runtime, fields: dict[str, Any]) -> None:
    """Put an entry into the job stream directly, as a foreign or broken producer could."""
    assert isinstance(runtime.queue, RedisStreamQueue)
    client = redis.Redis.from_url(str(runtime.settings.redis_url))
    try:
        client.xadd(runtime.queue.stream, {name: value for name, value in fields.items()})  # typed as redis wants
    finally:
        client.close()


LATIN1_JOB = b'{"job_id":"latin1","documents":[{"id":"a","text":"caf\xe9 au lait"}]}'
RAW_ENTRIES: dict[str, tuple[dict[str, Any], str]] = {
    "payload-not-json": ({"payload": "{job_id: j1"}, "malformed message: payload is not valid JSON ("),
    "payload-a-json-list": ({"payload": '[{"job_id": "j1"}]'}, "malformed message: payload is a JSON list"),
    "payload-a-json-string": ({"payload": '"j1"'}, "malformed message: payload is a JSON str"),
    "no-payload-field": ({"job": '{"job_id": "j1"}'}, "malformed message: it has no payload field"),
    "payload-bytes-not-utf8": (
        {"payload": b"\xff\xfe\x00\x01"},
        "malformed message: payload is not UTF-8 text (invalid start byte at byte 0)",
    ),
    "json-with-latin1-text": (
        {"payload": LATIN1_JOB},
        f"malformed message: payload is not UTF-8 text (invalid continuation byte at byte {LATIN1_JOB.index(0xE9)})",
    ),
}


@pytest.mark.parametrize("backend", ["redis"], indirect=True)
@pytest.mark.parametrize("fields, error", RAW_ENTRIES.values(), ids=list(RAW_ENTRIES))
def test_a_broken_stream_entry_is_dead_lettered_and_the_worker_goes_on(
    runtime: Runtime, fields: dict[str, Any], error: str
) -> None:
    xadd(runtime, fields)
    worker = runtime_worker(runtime, poll_ms=10)

    assert worker.run_once() == 0  # read, but nothing to run

    (dead,) = runtime.queue.dead_letters()
    assert dead.error.startswith(error)
    assert dead.attempts == 1
    raw = fields.get("payload", "")
    assert dead.payload == (raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw)
    assert runtime.queue.pending_count() == 0
    assert runtime.jobs.get("j1") is None  # no usable job id in those: no status
    latin1 = runtime.jobs.get("latin1")
    if fields.get("payload") == LATIN1_JOB:  # its job id was readable: the status tells the client why it failed
        assert latin1 is not None and latin1.status == "failed"
        assert latin1.error is not None and latin1.error.startswith(error)
    else:
        assert latin1 is None
    assert_nothing_stored(runtime)
    assert_good_job_runs(runtime, worker)


@pytest.mark.parametrize("backend", ["redis"], indirect=True)
@pytest.mark.parametrize(
    "document, error",
    [
        ('{"id":"a","text":"x","metadata":{"score":NaN}}', "documents[0].metadata.score: nan is not a finite"),
        ('{"id":"a","text":Infinity}', "documents[0].text must be a string, got a non-finite number"),
        ('{"id":"a","text":"x","format":-Infinity}', "documents[0].format must be one of text, markdown, got -inf"),
    ],
    ids=["nan-metadata", "infinite-text", "infinite-format"],
)
def test_non_finite_numbers_in_a_stream_entry_fail_the_job_naming_the_field(
    runtime: Runtime, document: str, error: str
) -> None:
    runtime.jobs.create("nan-job", 1)
    xadd(runtime, {"payload": '{"job_id":"nan-job","documents":[' + document + "]}"})
    worker = runtime_worker(runtime, poll_ms=10)

    assert worker.run_once() == 1

    status = _status(runtime, "nan-job")
    assert status.status == "failed" and status.error is not None and status.error.startswith(error)
    (dead,) = runtime.queue.dead_letters()
    assert dead.error == status.error
    assert "nan-job" in dead.payload
    assert runtime.queue.pending_count() == 0
    assert_nothing_stored(runtime)
    assert_good_job_runs(runtime, worker)


# ---- the ingest command ------------------------------------------------------------------------------------


def write(path: Path, content: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return path


def test_collect_documents_walks_folders_for_text_files(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    write(corpus / "a.md", "# A\n\nAlpha.")
    write(corpus / "sub" / "b.txt", "Beta.")
    write(corpus / "sub" / "c.markdown", "Gamma.")
    write(corpus / "skipped.bin", "a folder walk takes known extensions only")
    write(corpus / ".hidden" / "d.txt", "Hidden.")
    single = write(tmp_path / "single.txt", "Single.")

    documents = collect_documents([corpus, single], max_chars=100)

    found = [(d.id, d.text, d.format, d.metadata["source"]) for d in documents]
    assert found == [
        ("corpus/a.md", "# A\n\nAlpha.", "markdown", str(corpus / "a.md")),
        ("corpus/sub/b.txt", "Beta.", "text", str(corpus / "sub" / "b.txt")),
        ("corpus/sub/c.markdown", "Gamma.", "markdown", str(corpus / "sub" / "c.markdown")),
        ("single.txt", "Single.", "text", str(single)),
    ]


def test_collect_documents_refuses_a_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.txt"
    with pytest.raises(InputError) as caught:
        collect_documents([write(tmp_path / "ok.txt", "fine"), missing], max_chars=100)
    assert str(caught.value) == f"{missing}: no such file or folder"


def test_collect_documents_refuses_a_file_that_is_not_utf8(tmp_path: Path) -> None:
    bad = write(tmp_path / "corpus" / "latin1.txt", b"caf\xe9\n")
    write(tmp_path / "corpus" / "fine.txt", "fine")
    with pytest.raises(InputError) as caught:
        collect_documents([tmp_path / "corpus"], max_chars=100)
    assert str(caught.value) == f"{bad}: not UTF-8 text (invalid continuation byte at byte 3)"


@pytest.mark.parametrize("content", ["", " \n\t\n"], ids=["empty", "whitespace-only"])
def test_collect_documents_refuses_an_empty_file(tmp_path: Path, content: str) -> None:
    empty = write(tmp_path / "empty.md", content)
    with pytest.raises(InputError) as caught:
        collect_documents([empty], max_chars=100)
    assert str(caught.value) == f"{empty}: the file is empty"


def test_collect_documents_refuses_a_broken_pdf_given_directly(tmp_path: Path) -> None:
    pdf = write(tmp_path / "paper.pdf", "%PDF-1.7")
    with pytest.raises(InputError) as caught:
        collect_documents([pdf], max_chars=100)
    assert str(caught.value).startswith(f"{pdf}: not a readable PDF (")


def test_collect_documents_refuses_a_folder_without_text_files(tmp_path: Path) -> None:
    write(tmp_path / "corpus" / "image.png", b"\x89PNG\r\n")
    with pytest.raises(InputError) as caught:
        collect_documents([tmp_path / "corpus"], max_chars=100)
    assert str(caught.value) == (
        "no .txt, .text, .md, .markdown, .html, .htm, .xhtml, .pdf files found in the paths given"
    )


def test_collect_documents_refuses_two_files_with_one_document_id(tmp_path: Path) -> None:
    first = write(tmp_path / "a" / "notes.txt", "first")
    second = write(tmp_path / "b" / "notes.txt", "second")
    with pytest.raises(InputError) as caught:
        collect_documents([first, second], max_chars=100)
    assert str(caught.value) == f"{second} and {first} would both get the document id 'notes.txt'"


def test_collect_documents_refuses_a_file_over_the_limit(tmp_path: Path) -> None:
    long = write(tmp_path / "long.txt", "x" * 1001)
    with pytest.raises(InputError) as caught:
        collect_documents([long], max_chars=1000)
    assert str(caught.value) == f"{long}: 1,001 characters; the limit is 1,000"


CLI_SETTINGS = {
    "CHUNK_SIZE": "48",
    "CHUNK_OVERLAP": "8",
    "MAX_PRECOMPUTE_TOKENS": "256",
    "GPU_CACHE_MB": "0",
    "HOST_CACHE_MB": "4",
    "DISK_CACHE_MB": "512",
}


@pytest.fixture
def cli_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A clean KVSTITCH_* environment (no Redis: embedded) and a working dir without a .env; the data dir."""
    for name in [n for n in os.environ if n.upper().startswith("KVSTITCH_")]:
        monkeypatch.delenv(name)
    for name, value in CLI_SETTINGS.items():
        monkeypatch.setenv(f"KVSTITCH_{name}", value)
    monkeypatch.chdir(tmp_path)
    return tmp_path / "data"


def test_kvstitch_ingest_embedded_ingests_a_folder_and_prints_done(
    cli_env: Path,
    tmp_path: Path,
    tiny_model_dirs: dict[str, Path],
    get_engine: Callable[[str, str], StitchEngine],
    worker_embedder: Embedder,
    capsys: pytest.CaptureFixture[str],
) -> None:
    corpus = tmp_path / "corpus"
    write(corpus / "otters.md", "# Otters\n\nSea otters hold hands while they sleep.\n\nThey keep a favourite stone.")
    volcanoes = " ".join(f"Volcano number {n} erupted {n + 3} times in the year {1900 + 7 * n}." for n in range(12))
    write(corpus / "notes" / "volcanoes.txt", volcanoes)
    write(corpus / "notes" / "bread.markdown", "## Bread\n\nSourdough rises because wild yeast ferments the flour.")
    documents = collect_documents([corpus], max_chars=10_000)
    chunker = Chunker(get_engine("qwen2", "cpu").tokenizer, ChunkerConfig(48, 8, 10_000))
    token_ids = [c.token_ids for d in documents for c in chunker.chunk(d.id, d.text, markdown=d.format == "markdown")]
    chunks = len(token_ids)
    assert chunks > len(documents) and len(set(token_ids)) == chunks  # several chunks, all different

    argv = ["ingest", "--embedded", "--model", str(tiny_model_dirs["qwen2"]), "--device", "cpu"]
    code = kvstitch([*argv, "--data-dir", str(cli_env), str(corpus)])

    out = capsys.readouterr().out
    assert code == 0, out
    match = re.fullmatch(
        r"job [0-9a-f]{32}: done — 3 documents, (\d+) chunks \((\d+) KV precomputed, (\d+) reused\)\n", out
    )
    assert match is not None, out
    assert tuple(int(g) for g in match.groups()) == (chunks, chunks, 0)
    collection = ChunkCollection("kvstitch_chunks", worker_embedder.dimension, path=cli_env / "qdrant")
    try:
        assert collection.count() == chunks
        assert collection.document_versions("corpus/notes/bread.markdown") != set()
    finally:
        collection.close()
    index = open_index(None, cli_env)
    try:
        assert len(index.keys()) == chunks
    finally:
        index.close()


def test_kvstitch_ingest_embedded_exits_2_naming_a_bad_file(
    cli_env: Path, tmp_path: Path, tiny_model_dirs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    write(tmp_path / "corpus" / "good.txt", "A perfectly good file.")
    bad = write(tmp_path / "corpus" / "bad.md", b"# Caf\xe9\n")

    argv = ["ingest", "--embedded", "--model", str(tiny_model_dirs["qwen2"]), "--device", "cpu"]
    code = kvstitch([*argv, "--data-dir", str(cli_env), str(tmp_path / "corpus")])

    captured = capsys.readouterr()
    assert code == 2
    assert captured.err == f"error: {bad}: not UTF-8 text (invalid continuation byte at byte 5)\n"
    assert captured.out == ""
    assert not cli_env.exists()  # refused before anything was opened


def test_kvstitch_ingest_exits_2_on_a_missing_path(cli_env: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = kvstitch(["ingest", "--embedded", "--data-dir", str(cli_env), "no-such-folder"])

    assert code == 2
    assert capsys.readouterr().err == "error: no-such-folder: no such file or folder\n"


# ---- helpers -------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def running(worker: IngestWorker) -> Iterator[None]:
    """The worker's own loop in a thread for the duration of the block."""
    thread = threading.Thread(target=worker.run, name="test-ingest-worker", daemon=True)
    thread.start()
    try:
        yield
    finally:
        worker.stop()
        thread.join(timeout=30)
        assert not thread.is_alive(), "the worker loop did not stop"


def wait_finished(runtime: Runtime, job_id: str, timeout_s: float) -> JobStatus:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = _status(runtime, job_id)
        if status.status in ("done", "failed"):
            return status
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} not finished after {timeout_s} s: {runtime.jobs.get(job_id)}")


def _status(runtime: Runtime, job_id: str) -> JobStatus:
    status = runtime.jobs.get(job_id)
    assert status is not None, f"no status for job {job_id}"
    return status
