"""What the HTTP layer sees of the service: one narrow protocol and the plain values it exchanges.

As vLLM's API server sees only an `EngineClient`, the routes depend on `Facade` and nothing else: no engine, no
store, no queue. `service.serving.server.Server` implements it in this process; errors are those of `service.errors`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from service.jobs.documents import Document
from service.jobs.status import JobStatus
from service.retrieval.collection import DocumentSummary
from service.usecases.answer import ChatMessage, DoneEvent, Question, Retrieval, TokenEvent

# What an answer session hands its listener: events, then None at the end; an exception instead when it failed.
AnswerItem = TokenEvent | DoneEvent | BaseException | None


@dataclass(frozen=True)
class AnswerRequest:
    """A question as the client sent it; the service checks the bounds its settings set."""

    question: str
    top_k: int
    mode: str
    positions: str
    max_new_tokens: int | None
    temperature: float
    top_p: float
    seed: int | None
    recompute: str | None = None  # none | prefix:N | selective:R; None: the server's default setting
    history: tuple[ChatMessage, ...] = ()  # earlier messages of the conversation, oldest first
    stop: tuple[str, ...] = ()  # the answer ends before the first of these strings
    logprobs: int | None = None  # None: no log-probabilities; k: each token's, with its k most likely rivals


@dataclass(frozen=True)
class DocumentPage:
    """One page of the stored documents, sorted by id; `total` counts them all."""

    total: int
    offset: int
    documents: list[DocumentSummary]


@dataclass(frozen=True)
class RequestLimits:
    """Bounds the HTTP layer applies before a request reaches the service."""

    max_request_bytes: int
    api_key: str | None
    max_upload_files: int = 100  # files in one POST /ingest/files
    max_upload_file_bytes: int = 32 * 2**20


class AnswerSession(Protocol):
    """One admitted question, retrieval done; generation starts with `start` and runs on the engine."""

    question: Question
    retrieval: Retrieval
    done: DoneEvent | None

    def sources(self) -> list[dict[str, Any]]: ...

    def start(self, listener: Callable[[AnswerItem], None]) -> None:
        """Generate; `listener` gets each event (from the engine thread), then None, or the error raised."""
        ...

    def cancel(self) -> None:
        """The client went away: stop at the next token and free the request's place."""
        ...


class Facade(Protocol):
    """The service as the HTTP layer uses it."""

    @property
    def model_name(self) -> str: ...

    @property
    def model_aliases(self) -> tuple[str, ...]:
        """Other names the OpenAI API answers to (KVSTITCH_MODEL_ALIASES)."""
        ...

    @property
    def limits(self) -> RequestLimits: ...

    def start(self) -> None:
        """Begin start-up in the background (`readiness` reports progress)."""
        ...

    def close(self) -> None: ...

    def readiness(self) -> dict[str, Any]: ...

    def open_answer(self, request: AnswerRequest) -> AnswerSession:
        """Check, admit and retrieve (blocking): `InvalidRequestError`, `BusyError`, `NotReadyError`,
        `UnavailableError`."""
        ...

    def submit_ingest(self, documents: Sequence[Document]) -> str:
        """Queue documents for ingestion; the job id (`InvalidRequestError` naming the field)."""
        ...

    def submit_delete(self, doc_id: str) -> str:
        """Queue a document's removal behind earlier jobs for it; `UnknownDocumentError` if never seen."""
        ...

    def job_status(self, job_id: str) -> JobStatus | None: ...

    def cancel_job(self, job_id: str) -> JobStatus:
        """Cancel a queued or running job; `UnknownJobError`, or `JobFinishedError` when it already finished."""
        ...

    def list_documents(self, offset: int, limit: int) -> DocumentPage:
        """The stored documents, a page at a time (`UnavailableError` when Qdrant is away)."""
        ...

    def get_document(self, doc_id: str) -> DocumentSummary:
        """One stored document; `UnknownDocumentError` when it is not stored."""
        ...

    def metrics_text(self) -> bytes: ...

    def count_request(self, route: str, status: int) -> None: ...
