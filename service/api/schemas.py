"""Request and response bodies of the HTTP API (the names are a contract with the frontend and clients)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from service.api.validation import MessageContent, Metadata, Text

MAX_TOP_K = 50
MAX_SEED = 2**63 - 1


class Body(BaseModel):
    # A misspelt field is an error, not silently a default; NaN and ±Infinity are no numbers to sample with;
    # strict: JSON types as the OpenAPI document gives them (`"seed": true` or `"top_k": "5"` is a 422).
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


class DocumentIn(Body):
    id: Text = Field(min_length=1, max_length=256)
    text: Text = Field(min_length=1)
    metadata: Metadata = Field(default_factory=dict)
    format: Literal["text", "markdown"] = "text"


class IngestRequest(Body):
    documents: list[DocumentIn] = Field(min_length=1)


class IngestAccepted(BaseModel):
    job_id: str


class JobStatusOut(BaseModel):
    job_id: str
    kind: Literal["ingest", "delete"]
    status: Literal["queued", "running", "done", "failed", "cancelled"]
    documents: int
    documents_done: int
    chunks: int
    chunks_precomputed: int
    chunks_reused: int
    chunks_deleted: int
    blocks_released: int
    error: str | None
    created_at: float
    finished_at: float | None


class DocumentOut(BaseModel):
    id: str
    version: str
    chunks: int
    tokens: int
    ingested_at: float | None
    metadata: dict[str, Any]


class DocumentList(BaseModel):
    total: int
    offset: int
    documents: list[DocumentOut]


class DeleteAccepted(BaseModel):
    doc_id: str
    job_id: str


class AskRequest(Body):
    question: Text = Field(min_length=1)
    top_k: int = Field(5, ge=1, le=MAX_TOP_K)
    mode: Literal["turbo", "naive"] = "turbo"
    positions: Literal["reordered", "composite"] = "reordered"
    stream: bool = True
    max_new_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    # none | prefix:N | selective:R, checked by the service (422 naming it); unset: KVSTITCH_RECOMPUTE.
    recompute: str | None = Field(None, max_length=64)


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: MessageContent = None


class ChatCompletionRequest(BaseModel):
    """OpenAI's chat completion body; unknown OpenAI fields are accepted and ignored, as OpenAI clients send many."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)

    model: Text = Field(min_length=1, max_length=512)
    messages: list[ChatMessage] = Field(min_length=1, max_length=256)
    stream: bool = False
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    n: int = Field(1, ge=1, le=1)
    # kvstitch's own options (the openai client sends them through `extra_body`)
    top_k: int = Field(5, ge=1, le=MAX_TOP_K)
    mode: Literal["turbo", "naive"] = "turbo"
    positions: Literal["reordered", "composite"] = "reordered"
    recompute: str | None = Field(None, max_length=64)
