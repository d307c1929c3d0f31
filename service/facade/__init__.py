"""What the HTTP layer sees of the service: one narrow protocol, the plain values of `types`, the errors of `errors`.

As vLLM's API server sees only an `EngineClient`, the routes depend on `Facade` and nothing else: no engine, no
store, no queue, and no torch: importing this package loads none of them. `service.serving.server.Server` implements it
in this process.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol

from service.facade.types import (
    AnswerEvent,
    AnswerRequest,
    Document,
    DocumentPage,
    DocumentSummary,
    DoneEvent,
    JobStatus,
    RequestLimits,
    RetrieveRequest,
    Source,
)


class AnswerStream(Protocol):
    """One admitted question, its retrieval done: iterate it for the answer's events (token events, then the done
    event); an error raised while generating is raised from the iteration. Leaving the iteration early (the client
    went away) or calling `cancel` stops generation at the next token and frees the request's place."""

    @property
    def sources(self) -> list[Source]:
        """The retrieved chunks the answer reads, best first."""
        ...

    @property
    def dropped(self) -> int:
        """Chunks retrieved but left out: they would not fit the model's context with the answer."""
        ...

    @property
    def done(self) -> DoneEvent | None:
        """The done event once the answer finished; None before (or when it failed or was cancelled)."""
        ...

    def __aiter__(self) -> AsyncIterator[AnswerEvent]: ...

    def cancel(self) -> None:
        """Stop the answer and give up its place; a no-op once it finished or was cancelled."""
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

    async def answer(self, request: AnswerRequest) -> AnswerStream:
        """Admit and retrieve, then hand back the answer to iterate. Everything that refuses the request is raised
        here, before any event: `InvalidRequestError` (over the model's context), `BusyError`, `NotReadyError`,
        `UnavailableError`; so the caller can still answer with an HTTP status."""
        ...

    async def retrieve(self, request: RetrieveRequest) -> list[Source]:
        """The ranked chunks for a question (no answer); `NotReadyError`, `UnavailableError`."""
        ...

    def read_file(self, name: str, data: bytes, stop: Callable[[], bool] | None = None) -> Document:
        """An uploaded file as a document whose id is `name`, its kind told by its bytes (text, Markdown, HTML,
        PDF), read in a child process within KVSTITCH_EXTRACT_TIMEOUT_S; `InvalidRequestError` naming `files` when
        it cannot be read, takes too long, or `stop()` turned true meanwhile (the reading is then killed at once)."""
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
