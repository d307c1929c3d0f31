"""`kvstitch ingest PATH...`: send files and folders to a running server, or ingest them in this process.

Folders are walked for text, Markdown, HTML and PDF files by extension (`service.formats.EXTENSIONS`); every file
the walk leaves out is reported with its reason (no extension, another extension, hidden, not a regular file; a
hidden folder or a link to one once, not walked), so a `LICENSE` in a folder is not lost silently. A file named
explicitly is read whatever its name (`LICENSE`, `NOTICE`…): PDF and HTML are told by their bytes, anything else
is text if it decodes as UTF-8, and a binary file is refused naming it. A file's document id is its path relative
to the folder given, prefixed with that folder's name, or its name when given directly. Every file is read and
extracted before anything is sent, so a bad file stops the command without a half-done ingest. Documents go in
jobs of at most `--batch` documents; progress (documents, and chunks whose KV is stored as their batches finish)
is drawn on stderr.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

from service.formats import EXTENSIONS, ExtractError, extract
from service.jobs.documents import Document

DEFAULT_BATCH = 100
_KINDS = ", ".join(EXTENSIONS)
POLL_S = 0.5
FINISHED = ("done", "failed", "cancelled")

StatusReader = Callable[[str], Mapping[str, Any]]


class InputError(ValueError):
    """A path that cannot be ingested (missing, not text, not UTF-8)."""


@dataclass(frozen=True)
class Skipped:
    """A path a folder walk left out, and why (one line of `kvstitch ingest`'s report)."""

    path: Path
    reason: str

    def __str__(self) -> str:
        return f"skipped {self.path}: {self.reason}"


def collect_documents(
    paths: Sequence[str | Path], max_chars: int, on_skip: Callable[[Skipped], None] | None = None
) -> list[Document]:
    """Every document under the paths, read and checked; `InputError` naming the first bad one. `on_skip` hears
    of each path a folder walk leaves out, before any file is read."""
    files, skipped = walk(paths)
    for entry in skipped:
        if on_skip is not None:
            on_skip(entry)
    documents: list[Document] = []
    seen: dict[str, Path] = {}
    for path, doc_id in files:
        if doc_id in seen:
            raise InputError(f"{path} and {seen[doc_id]} would both get the document id {doc_id!r}")
        seen[doc_id] = path
        documents.append(_read(path, doc_id, max_chars))
    if not documents:
        raise InputError(f"no {_KINDS} files found in the paths given")
    return documents


def walk(paths: Sequence[str | Path]) -> tuple[list[tuple[Path, str]], list[Skipped]]:
    """The files to read with their document ids, and what the folder walks left out (each sorted by path)."""
    files: list[tuple[Path, str]] = []
    skipped: list[Skipped] = []
    for given in map(Path, paths):
        if given.is_dir():
            found: list[Path] = []
            _walk_folder(given, found, skipped)
            files += [(path, f"{given.resolve().name}/{path.relative_to(given).as_posix()}") for path in sorted(found)]
        elif given.is_file():  # named explicitly: any name; `extract` decides by the content
            files.append((given, given.name))
        else:
            raise InputError(f"{given}: no such file or folder")
    return files, sorted(skipped, key=lambda s: s.path)


def _walk_folder(folder: Path, found: list[Path], skipped: list[Skipped]) -> None:
    for path in folder.iterdir():
        reason = _skip_reason(path)
        if reason is not None:
            skipped.append(Skipped(path, reason))
        elif path.is_dir():
            _walk_folder(path, found, skipped)
        else:
            found.append(path)


def _skip_reason(path: Path) -> str | None:
    """Why a folder walk leaves `path` out, or None to take it (a folder: walk it)."""
    if path.name.startswith("."):
        return "a hidden folder (not walked)" if path.is_dir() else "a hidden file"
    if path.is_dir():
        return "a link to a folder (not walked)" if path.is_symlink() else None  # a link may loop
    if not path.is_file():
        return "not a regular file"
    if not path.suffix:
        return f"no extension (a folder walk reads {_KINDS}; name the file to ingest it)"
    if path.suffix.lower() not in EXTENSIONS:
        return f"a {path.suffix} file (a folder walk reads {_KINDS})"
    return None


def _read(path: Path, doc_id: str, max_chars: int) -> Document:
    try:
        data = path.read_bytes()
    except OSError as err:
        raise InputError(f"{path}: cannot read ({err.strerror})") from err
    if not data.strip():
        raise InputError(f"{path}: the file is empty")
    try:
        extracted = extract(str(path), data)
    except ExtractError as err:
        raise InputError(str(err)) from err
    if len(extracted.text) > max_chars:
        raise InputError(f"{path}: {len(extracted.text):,} characters; the limit is {max_chars:,}")
    return Document(doc_id, extracted.text, extracted.metadata(source=str(path)), extracted.format)


def batches(documents: Sequence[Document], size: int) -> list[list[Document]]:
    return [list(documents[i : i + size]) for i in range(0, len(documents), size)]


# ---- following jobs ------------------------------------------------------------------------------------------


def follow_jobs(
    job_ids: Sequence[str],
    read_status: StatusReader,
    out: TextIO | None = None,
    step: Callable[[], None] | None = None,
) -> dict[str, Mapping[str, Any]]:
    """Poll until every job is done or failed, drawing a progress bar on `out` (default: stderr at call time);
    the final statuses by job id.

    `step` runs between polls instead of sleeping (the embedded mode works the queue there)."""
    out = out or sys.stderr
    final: dict[str, Mapping[str, Any]] = {}
    while True:
        statuses = {job_id: final.get(job_id) or read_status(job_id) for job_id in job_ids}
        final.update({j: s for j, s in statuses.items() if s.get("status") in FINISHED})
        _draw(statuses.values(), out)
        if len(final) == len(job_ids):
            out.write("\n")
            return final
        if step is not None:
            step()
        else:
            time.sleep(POLL_S)


def _draw(statuses: Iterator[Mapping[str, Any]] | Any, out: TextIO, width: int = 30) -> None:
    rows = list(statuses)
    total = sum(int(s.get("documents", 0)) for s in rows)
    done = sum(int(s.get("documents" if s.get("status") in ("done", "failed") else "documents_done", 0)) for s in rows)
    chunks = sum(int(s.get("chunks", 0)) for s in rows)
    chunks_done = sum(int(s.get("chunks_done", 0)) for s in rows)
    share = sum(_job_share(s) for s in rows) / total if total else 1.0
    filled = min(width, int(width * share))
    out.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} documents, {chunks_done}/{chunks} chunks")
    out.flush()


def _job_share(status: Mapping[str, Any]) -> float:
    """A job's progress as a share of its documents: the share of its chunks whose KV is stored once chunks are
    counted (a group of documents at a time, before their KV is computed: in a job of several groups the share
    drops back when the next group is counted), else of its documents done."""
    documents = int(status.get("documents", 0))
    if status.get("status") in FINISHED:
        return float(documents)
    chunks = int(status.get("chunks", 0))
    if not chunks:
        return float(status.get("documents_done", 0))
    return documents * min(1.0, int(status.get("chunks_done", 0)) / chunks)


def report(final: Mapping[str, Mapping[str, Any]], out: TextIO | None = None) -> int:
    """One line per job on `out` (default: stdout at call time); exit status 1 when a job failed."""
    out = out or sys.stdout
    failed = 0
    for job_id, status in final.items():
        line = (
            f"job {job_id}: {status.get('status')} — {status.get('documents', 0)} documents, "
            f"{status.get('chunks', 0)} chunks ({status.get('chunks_precomputed', 0)} KV precomputed, "
            f"{status.get('chunks_reused', 0)} reused)"
        )
        if status.get("status") != "done":
            failed += 1
            line += f"; error: {status.get('error')}"
        print(line, file=out)
    return 1 if failed else 0


# ---- the two ways to ingest ----------------------------------------------------------------------------------


def ingest_remote(documents: Sequence[Document], url: str, api_key: str | None, batch: int) -> int:
    """Send the documents to a running server and follow the jobs there; RuntimeError when it cannot."""
    import httpx

    try:
        return _ingest_remote(documents, url, api_key, batch)
    except httpx.HTTPError as err:
        raise RuntimeError(f"cannot talk to the server at {url}: {err}") from err


def _ingest_remote(documents: Sequence[Document], url: str, api_key: str | None, batch: int) -> int:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=60.0) as client:
        job_ids = []
        for group in batches(documents, batch):
            body = {"documents": [d.to_json() for d in group]}
            reply = client.post("/ingest", json=body)
            _raise_for(reply)
            job_ids.append(str(reply.json()["job_id"]))

        def read_status(job_id: str) -> Mapping[str, Any]:
            reply = client.get(f"/ingest/{job_id}")
            _raise_for(reply)
            status: Mapping[str, Any] = reply.json()
            return status

        return report(follow_jobs(job_ids, read_status))


def ingest_embedded(documents: Sequence[Document], settings: Any, batch: int) -> int:
    """Open the data dir in this process (no server may hold it) and run the worker here."""
    from service.jobs.submit import submit_ingest
    from service.serving.runtime import open_runtime
    from workers.worker import runtime_worker

    with open_runtime(settings, answers=False) as runtime:
        worker = runtime_worker(runtime, name="kvstitch-ingest", poll_ms=50)
        job_ids = [
            submit_ingest(runtime.queue, runtime.jobs, runtime.order, group) for group in batches(documents, batch)
        ]

        def read_status(job_id: str) -> Mapping[str, Any]:
            status = runtime.jobs.get(job_id)
            return asdict(status) if status is not None else {"status": "failed", "error": "status lost"}

        def work() -> None:
            worker.run_once()

        return report(follow_jobs(job_ids, read_status, step=work))


def cancel_remote(job_id: str, url: str, api_key: str | None, out: TextIO | None = None) -> int:
    """`kvstitch cancel JOB_ID`: cancel a queued or running job on a server; RuntimeError (the server's reason:
    unknown job, already finished) when it cannot."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=60.0) as client:
            reply = client.delete(f"/ingest/{job_id}")
    except httpx.HTTPError as err:
        raise RuntimeError(f"cannot talk to the server at {url}: {err}") from err
    _raise_for(reply)
    status = reply.json()
    line = f"job {job_id}: {status['status']} after {status['documents_done']} of {status['documents']} documents"
    print(f"{line} (the worker withdraws the rest at its next step)", file=out or sys.stdout)
    return 0


def _raise_for(reply: Any) -> None:
    if reply.status_code >= 400:
        try:
            detail = reply.json().get("detail", reply.text)
        except ValueError:
            detail = reply.text
        raise RuntimeError(f"{reply.request.method} {reply.request.url.path} → {reply.status_code}: {detail}")
