"""Checks of request bodies beyond what pydantic's types say, and 422 bodies that can always be written.

JSON lets a client send `NaN`, `Infinity`, `1e309` (read as floats) and `"\\ud800"` (a lone surrogate); pydantic
accepts a lone surrogate in a `str` and anything under `Any`. The annotated types here refuse them where the
value would travel on (into the tokenizer, the queue, Qdrant), each as a 422 naming the field. `safe_errors`
makes the echo in any 422 writable, since a refused value is exactly what a strict JSON encoder cannot write.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Annotated, Any

from fastapi.encoders import jsonable_encoder
from pydantic import AfterValidator

from service.jobs.documents import MAX_METADATA_BYTES
from service.plain_json import MAX_DEPTH, json_problem, json_safe, text_problem


def valid_text(text: str) -> str:
    if (problem := text_problem(text)) is not None:
        raise ValueError(problem)
    return text


def _plain_metadata(metadata: dict[str, Any]) -> dict[str, Any]:
    if (problem := json_problem(metadata, "metadata", MAX_DEPTH)) is not None:
        raise ValueError(problem)
    size = len(json.dumps(metadata, ensure_ascii=False).encode())
    if size > MAX_METADATA_BYTES:
        raise ValueError(f"metadata is {size:,} bytes as JSON; the limit is {MAX_METADATA_BYTES:,}")
    return metadata


def _plain_content(content: Any) -> Any:
    if (problem := json_problem(content, "content", MAX_DEPTH)) is not None:
        raise ValueError(problem)
    return content


# A string that UTF-8 can encode (what the tokenizer, Redis and Qdrant need).
Text = Annotated[str, AfterValidator(valid_text)]
# Document metadata: plain JSON (finite numbers, encodable strings), at most MAX_DEPTH deep and
# MAX_METADATA_BYTES as JSON, so what is accepted at submit is what the worker, Redis and Qdrant can store.
Metadata = Annotated[dict[str, Any], AfterValidator(_plain_metadata)]
# A chat message's content, a string or a list of parts: the same plain-JSON rule as metadata.
MessageContent = Annotated[str | list[dict[str, Any]] | None, AfterValidator(_plain_content)]


def safe_errors(errors: Sequence[Any]) -> list[Any]:
    """FastAPI's validation errors with their `loc`, `input` and `ctx` made writable by a strict encoder."""
    encoded: list[Any] = jsonable_encoder(json_safe(list(errors)))
    return encoded
