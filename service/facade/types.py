"""The values the HTTP layer exchanges with the service: requests, answer events, documents, job statuses, limits.

Plain data only, so the HTTP process imports no torch, Qdrant or Redis client to read them
(tests/test_facade_weight.py holds it to that). Where the core already defines such a value in a torch-free
module (a document and its bounds, a job's status, a stored document's summary, a recompute spec, the plain-JSON
rule), it is re-exported here rather than copied, so the core and the HTTP layer cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from service.engine.recompute_spec import COMPOSITE_RECOMPUTE, RecomputeSpec, parse_recompute
from service.jobs.documents import MAX_DOC_ID_CHARS, MAX_METADATA_BYTES, Document, DocumentFormat
from service.jobs.job_status import JobStatus
from service.plain_json import MAX_DEPTH, json_problem, json_safe, text_problem
from service.retrieval.document_summary import DocumentSummary
from service.search_filter import FilterError, SearchFilter, parse_filter

__all__ = [
    "COMPOSITE_RECOMPUTE",
    "MAX_DEPTH",
    "MAX_DOC_ID_CHARS",
    "MAX_METADATA_BYTES",
    "AnswerEvent",
    "AnswerLimits",
    "AnswerRequest",
    "ChatMessage",
    "Document",
    "DocumentFormat",
    "DocumentPage",
    "DocumentSummary",
    "DoneEvent",
    "FilterError",
    "JobStatus",
    "Logprob",
    "Mode",
    "Positions",
    "RecomputeSpec",
    "RequestLimits",
    "RetrieveRequest",
    "Role",
    "SearchFilter",
    "Source",
    "TokenChoice",
    "TokenEvent",
    "json_problem",
    "json_safe",
    "parse_filter",
    "parse_recompute",
    "text_problem",
]

# The roles of a conversation's earlier messages (the engine's chat template knows the same three).
Role = Literal["system", "user", "assistant"]
Mode = Literal["turbo", "naive"]  # turbo: stitched chunk KV; naive: the whole prompt prefilled
Positions = Literal["reordered", "composite"]
# One retrieved chunk as an answer reports it: id, doc_id, score, tokens, text, its document's metadata (as given at
# ingest, bounded there), and where known title, headings, page and last_page.
Source = dict[str, Any]


@dataclass(frozen=True)
class ChatMessage:
    """One earlier message of a conversation, as the client sent it."""

    role: Role
    text: str


@dataclass(frozen=True)
class AnswerLimits:
    """The bounds of a question that come from the settings (KVSTITCH_MAX_*), checked at the HTTP boundary."""

    max_question_chars: int
    max_top_k: int
    max_new_tokens: int
    default_max_new_tokens: int  # when a request gives none
    max_history_messages: int
    max_history_chars: int


@dataclass(frozen=True)
class AnswerRequest:
    """A question within every bound that needs no model: what the HTTP boundary hands the service. Only the
    token counts (question, history and answer within the model's context) are checked after it."""

    question: str  # not blank
    top_k: int
    mode: Mode
    positions: Positions
    max_new_tokens: int  # the request's, or the deployment's default
    temperature: float
    top_p: float
    seed: int | None
    recompute: RecomputeSpec | None = None  # None: the deployment's default (KVSTITCH_RECOMPUTE)
    history: tuple[ChatMessage, ...] = ()  # earlier messages of the conversation, oldest first
    stop: tuple[str, ...] = ()  # the answer ends before the first of these strings
    logprobs: int | None = None  # None: no log-probabilities; k: each token's, with its k most likely rivals
    filter: SearchFilter | None = None  # retrieval reads only the chunks it matches


@dataclass(frozen=True)
class RetrieveRequest:
    """A search without an answer (`POST /retrieve`), within the same bounds as a question."""

    question: str  # not blank
    top_k: int
    filter: SearchFilter | None = None
    hybrid: bool | None = None  # None: the deployment's default (KVSTITCH_HYBRID_SEARCH)


@dataclass(frozen=True)
class TokenChoice:
    """A token by its text and its own bytes (a part of a UTF-8 character reads as U+FFFD, its bytes as the part),
    with its log-probability."""

    token: str
    logprob: float
    token_bytes: bytes


@dataclass(frozen=True)
class Logprob(TokenChoice):
    """One answer token's log-probability and its likeliest rivals (when a request asks)."""

    top: tuple[TokenChoice, ...] = ()


@dataclass(frozen=True)
class TokenEvent:
    text: str
    logprobs: tuple[Logprob, ...] = ()  # of the tokens generated since the last event (when a request asks)


@dataclass(frozen=True)
class DoneEvent:
    mode: str
    positions: str
    ttft_ms: float
    output_tokens: int
    finish_reason: str
    timings_ms: dict[str, float]
    kv: dict[str, int]
    answer: str
    prompt_tokens: int
    context_tokens: int
    # Bytes of chunk KV served per tier (metrics only: the `done` event's tier counts say enough to a client).
    kv_bytes: dict[str, int] = field(default_factory=dict)
    recompute: str = "none"
    recomputed_tokens: int = 0
    recomputed_share: float = 0.0  # of the chunk tokens (auto decides it per request)
    logprobs: tuple[Logprob, ...] = ()  # every answer token's, when the request asked

    def summary(self) -> dict[str, Any]:
        """The `done` event's data (the answer text itself went out as tokens)."""
        return {
            "mode": self.mode,
            "positions": self.positions,
            "ttft_ms": round(self.ttft_ms, 3),
            "output_tokens": self.output_tokens,
            "finish_reason": self.finish_reason,
            "timings_ms": {k: round(v, 3) for k, v in self.timings_ms.items()},
            "kv": self.kv,
            "prompt_tokens": self.prompt_tokens,
            "context_tokens": self.context_tokens,
            "recompute": self.recompute,
            "recomputed_tokens": self.recomputed_tokens,
            "recomputed_share": round(self.recomputed_share, 4),
        }


# What an answer stream yields: token events, then one done event.
AnswerEvent = TokenEvent | DoneEvent


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
    answer: AnswerLimits
    max_upload_files: int = 100  # files in one POST /ingest/files
    max_upload_file_bytes: int = 32 * 2**20
