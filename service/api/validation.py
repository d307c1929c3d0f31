"""Checks of request bodies beyond what pydantic's types say, the typed answer request, and 422 bodies that can
always be written.

JSON lets a client send `NaN`, `Infinity`, `1e309` (read as floats) and `"\\ud800"` (a lone surrogate); pydantic
accepts a lone surrogate in a `str` and anything under `Any`. The annotated types here refuse them where the
value would travel on (into the tokenizer, the queue, Qdrant), each as a 422 naming the field. `safe_errors`
makes the echo in any 422 writable, since a refused value is exactly what a strict JSON encoder cannot write.

`answer_request` is where a question's bounds are checked, once: pydantic has checked the fixed ones (types,
ranges), it checks those the deployment sets (`AnswerLimits`) and hands the service a typed `AnswerRequest`;
the service checks only what needs the model (the tokens within its context).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi.encoders import jsonable_encoder
from pydantic import AfterValidator

from service.facade.errors import InvalidRequestError
from service.facade.types import (
    COMPOSITE_RECOMPUTE,
    MAX_DEPTH,
    MAX_METADATA_BYTES,
    AnswerLimits,
    AnswerRequest,
    ChatMessage,
    FilterError,
    Mode,
    Positions,
    RecomputeSpec,
    RetrieveRequest,
    SearchFilter,
    json_problem,
    json_safe,
    parse_filter,
    parse_recompute,
    text_problem,
)


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


@dataclass(frozen=True)
class Sampling:
    """How a request asks its answer to be drawn, as both APIs take it."""

    max_new_tokens: int | None  # None: the deployment's default
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...] = ()
    logprobs: int | None = None


def answer_request(
    limits: AnswerLimits,
    question: str,
    history: tuple[ChatMessage, ...],
    sampling: Sampling,
    *,
    top_k: int,
    mode: Mode,
    positions: Positions,
    recompute: str | None,
    search_filter: dict[str, Any] | None = None,
) -> AnswerRequest:
    """The request within the deployment's bounds; `InvalidRequestError` naming the first field beyond them."""
    _check_question(limits, question)
    _check_top_k(limits, top_k)
    parsed_filter = checked_filter(search_filter)
    max_new = sampling.max_new_tokens or limits.default_max_new_tokens
    if max_new > limits.max_new_tokens:
        raise InvalidRequestError("max_new_tokens", f"at most {limits.max_new_tokens} (got {max_new})")
    _check_history(limits, history)
    return AnswerRequest(
        question=question,
        top_k=top_k,
        mode=mode,
        positions=positions,
        max_new_tokens=max_new,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        seed=sampling.seed,
        recompute=_recompute(recompute, positions),
        history=history,
        stop=sampling.stop,
        logprobs=sampling.logprobs,
        filter=parsed_filter,
    )


def retrieve_request(
    limits: AnswerLimits, question: str, top_k: int, search_filter: dict[str, Any] | None, hybrid: bool | None
) -> RetrieveRequest:
    """A search request within the same bounds as a question's retrieval."""
    _check_question(limits, question)
    _check_top_k(limits, top_k)
    return RetrieveRequest(question, top_k, checked_filter(search_filter), hybrid)


def checked_filter(raw: dict[str, Any] | None) -> SearchFilter | None:
    """A request's metadata filter (`service.search_filter`); `InvalidRequestError` naming `filter` and where."""
    if raw is None:
        return None
    try:
        return parse_filter(raw)
    except FilterError as err:
        raise InvalidRequestError("filter", str(err)) from err


def _check_top_k(limits: AnswerLimits, top_k: int) -> None:
    if top_k > limits.max_top_k:
        raise InvalidRequestError("top_k", f"at most {limits.max_top_k}")


def _check_question(limits: AnswerLimits, question: str) -> None:
    if len(question) > limits.max_question_chars:
        raise InvalidRequestError("question", f"at most {limits.max_question_chars} characters (got {len(question)})")
    if not question.strip():
        raise InvalidRequestError("question", "must not be blank")


def _check_history(limits: AnswerLimits, history: Sequence[ChatMessage]) -> None:
    if len(history) > limits.max_history_messages:
        raise InvalidRequestError(
            "history", f"at most {limits.max_history_messages} earlier messages (got {len(history)})"
        )
    chars = sum(len(m.text) for m in history)
    if chars > limits.max_history_chars:
        raise InvalidRequestError("history", f"at most {limits.max_history_chars} characters in all (got {chars})")


def _recompute(spec: str | None, positions: Positions) -> RecomputeSpec | None:
    """The request's recompute spec; None leaves the deployment's default (KVSTITCH_RECOMPUTE)."""
    if spec is None:
        return None
    try:
        parsed = parse_recompute(spec)
    except ValueError as err:
        raise InvalidRequestError("recompute", str(err)) from err
    if parsed.active and positions == "composite":
        raise InvalidRequestError("recompute", COMPOSITE_RECOMPUTE)
    return parsed
