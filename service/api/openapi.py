"""What the OpenAPI document says a route may answer, beyond its 200 JSON body: the streamed and text forms, and
every error status with the body it comes in (FastAPI's `{"detail": ...}`, or OpenAI's `{"error": ...}` under
/v1). tests/api/test_api_schema_fuzz.py holds the server to it.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

Responses = dict[int | str, dict[str, Any]]


class ErrorOut(BaseModel):
    """An HTTP error outside /v1: a message in `detail`."""

    detail: str


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIErrorOut(BaseModel):
    """An error under /v1, shaped like OpenAI's."""

    error: OpenAIErrorDetail


class Readiness(BaseModel):
    """What /readyz answers, with 200 or 503: each check and why it fails; once the model is loaded, the KV path
    chosen at start (`kv_path`: shared or copy, why, which segment attention) and, serving shared chunks, the
    arena's figures (`arena`); once serving, the shadow answers' figures (share, queue, outcomes, agreement rates
    and mean KL since start)."""

    ready: bool
    checks: dict[str, Any]
    kv_path: dict[str, Any] | None = None
    arena: dict[str, Any] | None = None
    shadow: dict[str, Any] | None = None


WHY = {
    401: "KVSTITCH_API_KEY is set and the request has no matching `Authorization: Bearer` header.",
    404: "No such job or document; under /v1 no such model (`model_not_found`) or URL (`unknown_url`).",
    409: "The job already finished (done, failed or cancelled): nothing to cancel.",
    413: "The body is larger than KVSTITCH_MAX_REQUEST_MB (declared or counted while it is read), or an ingest "
    "job's documents hold more than KVSTITCH_MAX_JOB_TOKENS tokens.",
    400: "The body is not JSON the server can read (invalid UTF-8, nesting deeper than the parser allows); under "
    "/v1 every body refused: not JSON, an unknown field (named in the message, as OpenAI does), a value missing, "
    "malformed or out of bounds (named in `param`), or an OpenAI option that is not served (tools, json response "
    "formats, n > 1, penalties), named in `param`.",
    422: "A field is missing, malformed or out of bounds; the error names it.",
    503: "Not ready yet, the engine's line is full, or a dependency (Qdrant, the KV index, Redis) is away; "
    "see Retry-After.",
}


def errors(*codes: int) -> Responses:
    """Error answers of a route outside /v1 (422 keeps FastAPI's own validation-error schema)."""
    return {code: {"description": WHY[code]} if code == 422 else {"model": ErrorOut, "description": WHY[code]}
            for code in codes}  # fmt: skip


def openai_errors(*codes: int) -> Responses:
    """Error answers of a route under /v1, all in OpenAI's shape."""
    return {code: {"model": OpenAIErrorOut, "description": WHY[code]} for code in codes}


def streamed(what: str, event_names: tuple[str, ...] | None = None) -> Responses:
    """A 200 that is JSON or, when the request asks to stream, server-sent events; the schema describes one
    event (Open API 3.1 has no `itemSchema`): its `data` is a JSON text, `event` its name where events have one."""
    event: dict[str, Any] = {"type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}
    if event_names is not None:
        event["properties"]["event"] = {"type": "string", "enum": list(event_names)}
        event["required"].append("event")
    stream = {"text/event-stream": {"schema": event}}
    return {200: {"description": f"{what}: JSON, or server-sent events when streaming", "content": stream}}
