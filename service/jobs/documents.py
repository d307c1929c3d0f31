"""The jobs that travel through the queue (ingest documents, delete a document) and their validation.

An ingest payload is `{"job_id": str, "kind": "ingest", "documents": [{"id": str, "text": str, "metadata": {...},
"format": ...}], "sequence": {doc_id: n}}`; a delete payload is `{"job_id": str, "kind": "delete", "doc_id": str,
"sequence": {doc_id: n}}`. `sequence` holds each document's submit order (`ordering.py`): a worker applies a job
to a document only while no later job for it was submitted, so a delete sent right after an ingest of the same
document wins whichever worker runs first. A payload without `kind` is an ingest, without `sequence` unordered
(messages queued by an older version).
The gateway validates the same limits before enqueueing, but the queue may carry anything (an older client, a
hand-written message), so the worker checks every field again and refuses the whole job with a message that
names the field: a job is ingested entirely or not at all.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from service.plain_json import json_problem, text_problem

MAX_DOC_ID_CHARS = 256
MAX_METADATA_BYTES = 16_384
MAX_JOB_ID_CHARS = 128
DocumentFormat = Literal["text", "markdown"]
JobKind = Literal["ingest", "delete"]
JOB_KINDS: tuple[JobKind, ...] = ("ingest", "delete")
FORMATS: tuple[DocumentFormat, ...] = ("text", "markdown")


class JobError(ValueError):
    """The job can never succeed as sent (a malformed message or document); retrying would not help."""


@dataclass(frozen=True)
class Document:
    id: str
    text: str
    metadata: Mapping[str, Any] = field(default_factory=dict)
    format: DocumentFormat = "text"

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "text": self.text, "metadata": dict(self.metadata), "format": self.format}


# What the rest of a job carries from its earlier turns (a job taking turns with others is queued again as its
# documents not yet done, with these counts): the whole job's document count and what was done so far.
PROGRESS_FIELDS = ("documents", "documents_done", "chunks", "chunks_done", "chunks_precomputed", "chunks_reused")


@dataclass(frozen=True)
class IngestJob:
    job_id: str
    documents: tuple[Document, ...]
    sequence: Mapping[str, int] = field(default_factory=dict)  # doc id → its submit order (absent: unordered)
    progress: Mapping[str, int] = field(default_factory=dict)  # PROGRESS_FIELDS of earlier turns (absent: none)

    kind: ClassVar[JobKind] = "ingest"

    @property
    def total_documents(self) -> int:
        """Documents of the whole job, those done in earlier turns included."""
        return self.progress.get("documents", len(self.documents))

    def to_payload(self) -> dict[str, Any]:
        payload = {
            "job_id": self.job_id,
            "kind": self.kind,
            "documents": [d.to_json() for d in self.documents],
            "sequence": dict(self.sequence),
        }
        if self.progress:
            payload["progress"] = dict(self.progress)
        return payload

    def rest(self, done: int, progress: Mapping[str, int]) -> IngestJob:
        """The job without its first `done` documents, carrying `progress` (the next turn's payload)."""
        left = self.documents[done:]
        ids = {d.id for d in left}
        sequence = {doc_id: n for doc_id, n in self.sequence.items() if doc_id in ids}
        carried = {name: progress[name] for name in PROGRESS_FIELDS if name in progress}
        return IngestJob(self.job_id, left, sequence, carried | {"documents": self.total_documents})


@dataclass(frozen=True)
class DeleteJob:
    job_id: str
    doc_id: str
    sequence: Mapping[str, int] = field(default_factory=dict)

    kind: ClassVar[JobKind] = "delete"

    def to_payload(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "kind": self.kind, "doc_id": self.doc_id, "sequence": dict(self.sequence)}


Job = IngestJob | DeleteJob


@dataclass(frozen=True)
class DocumentLimits:
    max_document_chars: int = 2_000_000
    max_documents_per_job: int = 1000


def document_version(doc: Document, chunking: str) -> str:
    """A content hash: the same text, format, metadata and chunking give the same version (nothing to redo)."""
    digest = hashlib.sha256()
    for part in (doc.format, chunking, json.dumps(doc.metadata, sort_keys=True, ensure_ascii=False), doc.text):
        data = part.encode("utf-8", "surrogatepass")
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()[:32]


def job_id_of(payload: Mapping[str, Any]) -> str | None:
    """The job id of a payload when it has a usable one (so a malformed job can still get a failed status)."""
    job_id = payload.get("job_id")
    if isinstance(job_id, str) and 0 < len(job_id) <= MAX_JOB_ID_CHARS and job_id.isprintable():
        return job_id
    return None


def job_documents(payload: Mapping[str, Any]) -> set[str]:
    """The document ids a payload names, read leniently (a malformed job names what it can): what a queued job
    will write or delete."""
    if payload.get("kind") == "delete":
        doc_id = payload.get("doc_id")
        return {doc_id} if isinstance(doc_id, str) else set()
    documents = payload.get("documents")
    if not isinstance(documents, list):
        return set()
    return {d["id"] for d in documents if isinstance(d, dict) and isinstance(d.get("id"), str)}


def parse_job(payload: Mapping[str, Any], limits: DocumentLimits) -> Job:
    """The job a payload describes; `JobError` naming the first field that is wrong."""
    job_id = job_id_of(payload)
    if job_id is None:
        raise JobError(f"job_id must be a printable string of 1-{MAX_JOB_ID_CHARS} characters")
    kind = payload.get("kind", "ingest")
    if kind == "delete":
        doc_id = _doc_id("doc_id", payload.get("doc_id"))
        return DeleteJob(job_id, doc_id, _sequence(payload.get("sequence"), {doc_id}))
    if kind != "ingest":
        raise JobError(f"kind must be one of {', '.join(JOB_KINDS)}, got {_clipped_repr(kind)}")
    return _parse_ingest(job_id, payload, limits)


def _parse_ingest(job_id: str, payload: Mapping[str, Any], limits: DocumentLimits) -> IngestJob:
    raw_documents = payload.get("documents")
    if not isinstance(raw_documents, list) or not raw_documents:
        raise JobError("documents must be a non-empty list")
    if len(raw_documents) > limits.max_documents_per_job:
        raise JobError(f"a job holds at most {limits.max_documents_per_job} documents, got {len(raw_documents)}")
    documents = tuple(_parse_document(i, raw, limits) for i, raw in enumerate(raw_documents))
    seen: set[str] = set()
    for i, doc in enumerate(documents):
        if doc.id in seen:
            raise JobError(f"documents[{i}].id {doc.id!r} appears twice in one job")
        seen.add(doc.id)
    return IngestJob(job_id, documents, _sequence(payload.get("sequence"), seen), _progress(payload.get("progress")))


def _progress(raw: Any) -> dict[str, int]:
    """Counts carried from a job's earlier turns: non-negative ints of known names."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise JobError(f"progress must be an object, got {_type(raw)}")
    progress: dict[str, int] = {}
    for name, n in raw.items():
        if name not in PROGRESS_FIELDS:
            raise JobError(f"progress names {_clipped_repr(name)}; known: {', '.join(PROGRESS_FIELDS)}")
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise JobError(f"progress[{name!r}] must be a non-negative integer, got {_clipped_repr(n)}")
        progress[name] = n
    return progress


def _sequence(raw: Any, doc_ids: set[str]) -> dict[str, int]:
    """Each document's submit order: positive ints, for documents of this job only."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise JobError(f"sequence must be an object, got {_type(raw)}")
    sequence: dict[str, int] = {}
    for doc_id, n in raw.items():
        if doc_id not in doc_ids:
            raise JobError(f"sequence names {_clipped_repr(doc_id)}, which is not a document of this job")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise JobError(f"sequence[{doc_id!r}] must be a positive integer, got {_clipped_repr(n)}")
        sequence[doc_id] = n
    return sequence


def _parse_document(i: int, raw: Any, limits: DocumentLimits) -> Document:
    where = f"documents[{i}]"
    if not isinstance(raw, Mapping):
        raise JobError(f"{where} must be an object, got {_type(raw)}")
    return Document(
        id=_doc_id(f"{where}.id", raw.get("id")),
        text=_text(f"{where}.text", raw.get("text"), limits),
        metadata=_metadata(f"{where}.metadata", raw.get("metadata")),
        format=_format(f"{where}.format", raw.get("format", "text")),
    )


def _doc_id(where: str, doc_id: Any) -> str:
    if not isinstance(doc_id, str) or not doc_id.strip() or len(doc_id) > MAX_DOC_ID_CHARS:
        raise JobError(f"{where} must be a non-blank string of at most {MAX_DOC_ID_CHARS} characters")
    if not doc_id.isprintable():
        raise JobError(f"{where} must not contain control characters")
    return doc_id


def _text(where: str, text: Any, limits: DocumentLimits) -> str:
    if not isinstance(text, str):
        raise JobError(f"{where} must be a string, got {_type(text)}")
    if not text.strip():
        raise JobError(f"{where} is empty (nothing to ingest)")
    if (problem := text_problem(text)) is not None:  # the tokenizer cannot encode it
        raise JobError(f"{where} {problem}")
    if len(text) > limits.max_document_chars:
        raise JobError(f"{where} has {len(text):,} characters; the limit is {limits.max_document_chars:,}")
    return text


def _metadata(where: str, metadata: Any) -> dict[str, Any]:
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping) or not all(isinstance(k, str) for k in metadata):
        raise JobError(f"{where} must be an object with string keys, got {_type(metadata)}")
    # Checked before encoding: a lone surrogate fails `.encode()` and deep nesting fails Qdrant (RecursionError).
    if (problem := json_problem(dict(metadata), where)) is not None:
        raise JobError(problem)  # names the path: documents[0].metadata.score: nan is not a finite number
    encoded = json.dumps(dict(metadata), ensure_ascii=False, allow_nan=False)
    if len(encoded.encode()) > MAX_METADATA_BYTES:
        raise JobError(f"{where} is larger than {MAX_METADATA_BYTES} bytes as JSON")
    return dict(metadata)


def _format(where: str, value: Any) -> DocumentFormat:
    for name in FORMATS:
        if value == name:
            return name
    raise JobError(f"{where} must be one of {', '.join(FORMATS)}, got {_clipped_repr(value)}")


def _clipped_repr(value: Any, limit: int = 80) -> str:
    """A value as the error shows it: a huge string sent as a format must not make a huge error and log line."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _type(value: Any) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return "a non-finite number"
    return "null" if value is None else type(value).__name__
