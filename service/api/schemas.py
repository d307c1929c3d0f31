"""Request and response bodies of the HTTP API (the names are a contract with the frontend and clients)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from service.api.validation import MessageContent, Metadata, Text, valid_text

MAX_TOP_K = 50
MAX_SEED = 2**63 - 1
MAX_STOP = 4  # stop strings per request (OpenAI's bound; the engine takes up to 8)
MAX_HISTORY = 256  # earlier messages at most; KVSTITCH_MAX_HISTORY_MESSAGES may set fewer
MAX_TOP_LOGPROBS = 20
MAX_STOP_CHARS = 256


def _bounded_stop(stop: str | list[str] | None) -> str | list[str] | None:
    """1 to MAX_STOP strings of 1 to MAX_STOP_CHARS characters (checked here so the error names `stop` alone)."""
    strings = [stop] if isinstance(stop, str) else stop or []
    if isinstance(stop, list) and not 1 <= len(stop) <= MAX_STOP:
        raise ValueError(f"1 to {MAX_STOP} stop strings (got {len(stop)})")
    for text in strings:
        if not 1 <= len(text) <= MAX_STOP_CHARS:
            raise ValueError(f"each stop string has 1 to {MAX_STOP_CHARS} characters")
        valid_text(text)
    return stop


# A metadata filter over the documents (`service/search_filter.py`), checked by `validation.checked_filter`.
SearchFilterIn = Annotated[
    dict[str, Any] | None,
    Field(description='{"must"|"should"|"must_not": [{"key": K, "match"|"any"|"range": ...}, ...]}; see docs/api.md.'),
]

# The answer ends before the first occurrence of any of these strings (a string or a list of them).
Stop = Annotated[
    str | list[str] | None,
    AfterValidator(_bounded_stop),
    Field(description=f"Up to {MAX_STOP} strings of 1 to {MAX_STOP_CHARS} characters; the answer ends before one."),
]


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
    chunks_done: int
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


class HistoryMessage(Body):
    """An earlier message of the conversation; its total with the others is bounded by KVSTITCH_MAX_HISTORY_*."""

    role: Literal["user", "assistant", "system"]
    content: Text


class AskRequest(Body):
    question: Text = Field(min_length=1)
    history: list[HistoryMessage] = Field(default_factory=list, max_length=MAX_HISTORY)
    stop: Stop = None
    top_k: int = Field(5, ge=1, le=MAX_TOP_K)
    mode: Literal["turbo", "naive"] = "turbo"
    positions: Literal["reordered", "composite"] = "reordered"
    stream: bool = True
    max_new_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    # none | prefix:N | selective:R[:F] | query:R[:F] | auto[:T], checked by the service (422 naming it);
    # unset: KVSTITCH_RECOMPUTE.
    recompute: str | None = Field(None, max_length=64)
    filter: SearchFilterIn = None


class RetrieveIn(Body):
    question: Text = Field(min_length=1)
    filter: SearchFilterIn = None
    top_k: int = Field(5, ge=1, le=MAX_TOP_K)
    hybrid: bool | None = Field(None, description="Dense and sparse search fused; unset: KVSTITCH_HYBRID_SEARCH.")


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: MessageContent = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    """OpenAI's chat completion body. A field OpenAI does not know is a 400 naming it, as OpenAI answers; the
    OpenAI fields that do not change the answer are taken and ignored, and those that would and are not served are
    a 400 naming them unless they ask for what is served anyway."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    model: Text | None = Field(None, min_length=1, max_length=512, description="Unset: the served model.")
    messages: list[ChatMessage] = Field(min_length=1, max_length=256)
    stream: bool = False
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    n: int = Field(1, ge=1, le=128, description="Only 1 is served; more is a 400 naming `n`.")
    stop: Stop = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    stream_options: StreamOptions | None = None
    # Declared so the OpenAPI document shows them; none is served, each is a 400 naming it (never ignored).
    tools: list[Any] | None = Field(None, description="Not served: a 400 naming `tools`.")
    tool_choice: Any = Field(None, description="Not served: a 400 naming `tool_choice`.")
    functions: list[Any] | None = Field(None, description="Not served: a 400 naming `functions`.")
    function_call: Any = Field(None, description="Not served: a 400 naming `function_call`.")
    response_format: dict[str, Any] | None = Field(
        None, description='Only {"type": "text"}; json_object and json_schema are a 400 naming it.'
    )
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, description="Only 0 is served.")
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, description="Only 0 is served.")
    logit_bias: dict[str, int] | None = Field(None, max_length=300, description="Only an empty one is served.")
    modalities: list[Literal["text", "audio"]] | None = Field(None, max_length=2, description='Only ["text"].')
    audio: Any = Field(None, description="Not served: a 400 naming `audio`.")
    prediction: Any = Field(None, description="Not served: a 400 naming `prediction`.")
    web_search_options: Any = Field(None, description="Not served: a 400 naming `web_search_options`.")
    # OpenAI fields that leave the answer as it is: taken and ignored.
    user: Text | None = Field(None, max_length=512)
    safety_identifier: Text | None = Field(None, max_length=512)
    prompt_cache_key: Text | None = Field(None, max_length=512)
    metadata: dict[Text, Text] | None = Field(None, max_length=16)
    store: bool | None = None
    service_tier: Text | None = Field(None, max_length=32)
    parallel_tool_calls: bool | None = None
    reasoning_effort: Text | None = Field(None, max_length=32)
    verbosity: Literal["low", "medium", "high"] | None = None
    # kvstitch's own options (the openai client sends them through `extra_body`)
    top_k: int = Field(5, ge=1, le=MAX_TOP_K)
    mode: Literal["turbo", "naive"] = "turbo"
    positions: Literal["reordered", "composite"] = "reordered"
    recompute: str | None = Field(None, max_length=64)
    filter: SearchFilterIn = None


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    """A request's `stop` as the engine takes it: a tuple of strings, maybe empty."""
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)
