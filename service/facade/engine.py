"""What an engine process serves a gateway (`kvstitch engine`'s internal API), as plain values and one protocol.

A gateway retrieves, then hands an engine an `EngineAnswerRequest`: the question, its conversation, its sampling
and the retrieved chunks with their token ids (the engine keys and stitches their KV, it never searches). The answer
comes back as JSON lines, one event each (`event_line` / `parse_event`): tokens, then `done` or `error`. Both sides
import this module, the engine's HTTP layer and the gateway's client, so the two cannot drift apart; it imports no
torch and no client library (tests/test_facade_weight.py).
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Protocol

from service.errors import InvalidRequestError, UnavailableError
from service.facade.types import AnswerEvent, ChatMessage, DoneEvent, Logprob, TokenChoice, TokenEvent
from service.packed_ids import pack_token_ids, unpack_token_ids

# Bounds of a request an engine accepts: the gateway's own limits sit below them (KVSTITCH_MAX_*), these only keep
# a stray or hostile caller of the internal port from asking for unbounded work.
MAX_CHUNKS = 64
MAX_CHUNK_TOKENS = 1 << 16
MAX_TOKEN_ID = (1 << 31) - 1
MAX_TEXT_CHARS = 1 << 20
MAX_HISTORY = 256
MAX_NEW_TOKENS = 1 << 16
MAX_STOP = 16
MAX_LOGPROBS = 20
ROLES = ("system", "user", "assistant")
# How long an engine keeps an idle connection from a gateway open (seconds). A gateway retires its idle connections
# to an engine well before (`GATEWAY_KEEP_ALIVE_S`): one reused just as the engine closed it would fail the question's
# post, and a failed post takes the engine out of routing until its next probe.
ENGINE_KEEP_ALIVE_S = 5
GATEWAY_KEEP_ALIVE_S = ENGINE_KEEP_ALIVE_S / 2


@dataclass(frozen=True)
class WireChunk:
    """A retrieved chunk as the gateway sends it: what the prompt needs (token ids) and what the answer reports."""

    id: str
    doc_id: str
    score: float
    text: str
    token_ids: tuple[int, ...]
    metadata: Mapping[str, Any] = field(default_factory=dict)
    context: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineAnswerRequest:
    """An already-retrieved question for one engine."""

    question: str
    chunks: tuple[WireChunk, ...]
    mode: str = "turbo"
    positions: str = "reordered"
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    recompute: str = "none"
    history: tuple[ChatMessage, ...] = ()
    dropped: int = 0  # chunks the gateway retrieved but left out (they would not fit)

    def to_json(self) -> dict[str, Any]:
        """The request as JSON values (lists, objects), what `parse_answer_request` reads back."""
        return self.json_with(_chunk_json)

    def json_with(self, chunk_json: Callable[[WireChunk], dict[str, Any]]) -> dict[str, Any]:
        """The request as JSON values, each chunk as `chunk_json` writes it (the gateway's body packs its ids, the
        engine link's header counts them). Built field by field: `asdict` would walk (and copy) every token id of
        every chunk, milliseconds a question."""
        body = {f.name: getattr(self, f.name) for f in fields(self)}
        body["chunks"] = [chunk_json(c) for c in self.chunks]
        body["stop"] = list(self.stop)
        body["history"] = [{"role": m.role, "text": m.text} for m in self.history]
        return body

    def body(self) -> bytes:
        """The request's JSON body, as an HTTP client encodes `to_json()` (compact, UTF-8, no NaN)."""
        text = json.dumps(self.to_json(), ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        return text.encode("utf-8")


def _chunk_json(chunk: WireChunk) -> dict[str, Any]:
    return {**chunk_fields(chunk), "token_ids": pack_token_ids(chunk.token_ids)}


def chunk_fields(chunk: WireChunk) -> dict[str, Any]:
    """A chunk's fields as JSON values, all but its token ids (each form of the request carries those its own way)."""
    return {
        "id": chunk.id,
        "doc_id": chunk.doc_id,
        "score": chunk.score,
        "text": chunk.text,
        "metadata": dict(chunk.metadata),
        "context": dict(chunk.context),
    }


def parse_answer_request(body: Any) -> EngineAnswerRequest:
    """The request an engine received, every field checked; ValueError naming the first wrong one."""
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    known = {f.name for f in fields(EngineAnswerRequest)}
    unknown = sorted(set(body) - known)
    if unknown:
        raise ValueError(f"unknown fields: {', '.join(unknown)}")
    question = _text(body.get("question"), "question")
    if not question.strip():
        raise ValueError("question: blank")
    chunks = body.get("chunks", [])
    if not isinstance(chunks, list) or len(chunks) > MAX_CHUNKS:
        raise ValueError(f"chunks: a list of at most {MAX_CHUNKS}")
    history = body.get("history", [])
    if not isinstance(history, list) or len(history) > MAX_HISTORY:
        raise ValueError(f"history: a list of at most {MAX_HISTORY} messages")
    stop = body.get("stop", [])
    if not isinstance(stop, list) or len(stop) > MAX_STOP:
        raise ValueError(f"stop: a list of at most {MAX_STOP} strings")
    logprobs = body.get("logprobs")
    return EngineAnswerRequest(
        question=question,
        chunks=tuple(_chunk(c, i) for i, c in enumerate(chunks)),
        mode=_choice(body.get("mode", "turbo"), "mode", ("turbo", "naive")),
        positions=_choice(body.get("positions", "reordered"), "positions", ("reordered", "composite")),
        max_new_tokens=_int(body.get("max_new_tokens", 256), "max_new_tokens", 1, MAX_NEW_TOKENS),
        temperature=_number(body.get("temperature", 0.0), "temperature", 0.0, 100.0),
        top_p=_number(body.get("top_p", 1.0), "top_p", 0.0, 1.0),
        seed=None if body.get("seed") is None else _int(body["seed"], "seed", 0, 2**63 - 1),
        stop=tuple(_text(s, "stop") for s in stop),
        logprobs=None if logprobs is None else _int(logprobs, "logprobs", 0, MAX_LOGPROBS),
        recompute=_text(body.get("recompute", "none"), "recompute"),
        history=tuple(_message(m) for m in history),
        dropped=_int(body.get("dropped", 0), "dropped", 0, 1 << 20),
    )


def parse_answer_body(body: bytes) -> EngineAnswerRequest:
    """A request as an engine receives it, a JSON body; `InvalidRequestError` naming the body for one that is not
    JSON or not a valid request (the 422 both forms of the engine's API give)."""
    try:
        return parse_answer_request(json.loads(body))
    except json.JSONDecodeError as err:
        raise InvalidRequestError("body", f"not JSON: {err}") from err
    except ValueError as err:
        raise InvalidRequestError("body", str(err)) from err


def out_of_vocabulary(chunks: Sequence[Sequence[int]], vocab_size: int) -> tuple[int, int] | None:
    """The first chunk holding an id the model has no embedding for, and that id; None when every id fits. Such an
    id would index past the embedding table: on CUDA a device-side assert that ends the process."""
    for i, ids in enumerate(chunks):
        if ids and (top := max(ids)) >= vocab_size:
            return i, top
    return None


def check_vocabulary(chunks: Sequence[Sequence[int]], vocab_size: int) -> None:
    """InvalidRequestError (the 422 of either form of the engine's API) for a chunk holding an id outside the
    model's vocabulary: the engine's port takes ids from any caller, and a gateway's collection may hold another
    tokenizer's."""
    found = out_of_vocabulary(chunks, vocab_size)
    if found is not None:
        index, top = found
        raise InvalidRequestError(
            f"chunks[{index}].token_ids", f"ids of this model's vocabulary (below {vocab_size}); got {top}"
        )


def _chunk(value: Any, i: int) -> WireChunk:
    if not isinstance(value, dict):
        raise ValueError(f"chunks[{i}]: an object")
    ids = _token_ids(value.get("token_ids"), i)
    metadata, context = value.get("metadata", {}), value.get("context", {})
    if not isinstance(metadata, dict) or not isinstance(context, dict):
        raise ValueError(f"chunks[{i}]: metadata and context are objects")
    return WireChunk(
        id=_text(value.get("id"), f"chunks[{i}].id"),
        doc_id=_text(value.get("doc_id"), f"chunks[{i}].doc_id"),
        score=_number(value.get("score", 0.0), f"chunks[{i}].score", -1e9, 1e9),
        text=_text(value.get("text", ""), f"chunks[{i}].text"),
        token_ids=ids,
        metadata=metadata,
        context=context,
    )


def _token_ids(value: Any, i: int) -> tuple[int, ...]:
    """A chunk's ids: packed (`service.packed_ids`, what a gateway sends: a list of ints cost the engine's event
    loop milliseconds a question to decode and check) or a plain list of ints."""
    name = f"chunks[{i}].token_ids"
    if isinstance(value, str):
        if len(value) > MAX_TEXT_CHARS:
            raise ValueError(f"{name}: packed ids of at most {MAX_CHUNK_TOKENS} tokens")
        try:
            ids = unpack_token_ids(value)
        except ValueError as err:
            raise ValueError(f"{name}: {err}") from err
    elif isinstance(value, list):
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN_ID for t in value):
            raise ValueError(f"{name}: integers 0 to {MAX_TOKEN_ID}")
        ids = tuple(value)
    else:
        raise ValueError(f"{name}: packed ids or a list of token ids")
    if not 0 < len(ids) <= MAX_CHUNK_TOKENS:
        raise ValueError(f"{name}: 1 to {MAX_CHUNK_TOKENS} token ids")
    return ids  # below the model's vocabulary: the engine checks (a packed id is below 2**32)


def _message(value: Any) -> ChatMessage:
    if not isinstance(value, dict):
        raise ValueError("history: objects with role and text")
    role = _choice(value.get("role"), "history.role", ROLES)
    return ChatMessage(role, _text(value.get("text"), "history.text"))  # type: ignore[arg-type]


def _text(value: Any, name: str) -> str:
    if not isinstance(value, str) or len(value) > MAX_TEXT_CHARS:
        raise ValueError(f"{name}: a string of at most {MAX_TEXT_CHARS} characters")
    return value


def _choice(value: Any, name: str, allowed: Sequence[str]) -> str:
    if value not in allowed:
        raise ValueError(f"{name}: one of {', '.join(allowed)}")
    return str(value)


def _int(value: Any, name: str, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"{name}: an integer from {low} to {high}")
    return value


def _number(value: Any, name: str, low: float, high: float) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name}: a number")
    if not low <= value <= high:
        raise ValueError(f"{name}: from {low:g} to {high:g}")
    return float(value)


# ---- events as JSON lines -----------------------------------------------------------------------------------


class EngineStreamError(RuntimeError):
    """An `error` line of an engine's answer: the answer failed on the engine after it started."""


def event_line(event: AnswerEvent) -> bytes:
    """One event as a JSON line."""
    if isinstance(event, DoneEvent):
        body: dict[str, Any] = {"event": "done", "done": {**asdict(event), "logprobs": _logprobs(event.logprobs)}}
    else:
        body = {"event": "token", "text": event.text, "logprobs": _logprobs(event.logprobs)}
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


DONE_LINE_START = b'{"event":"done"'  # how `event_line` starts a done event's line


def with_relays(line: bytes, relay_in_ms: float, written_ms: float) -> bytes:
    """A done event's line (else `line` as it is) with the engine API process's two hops as stages: `relay_in`
    (the question's arrival there to its start on the core) and `relay_out` (its first token on the core to that
    token's write from the API process, `written_ms` after its start on the core), its TTFT counted from the
    arrival to the write: the engine's TTFT as its API saw it (a gateway's `transport` then holds its own hops)."""
    if not line.startswith(DONE_LINE_START):
        return line
    body = json.loads(line)
    done = body["done"]
    relay_out_ms = max(0.0, written_ms - float(done["ttft_ms"]))
    done["timings_ms"] = {**done["timings_ms"], "relay_in": relay_in_ms, "relay_out": relay_out_ms}
    done["ttft_ms"] = relay_in_ms + max(written_ms, float(done["ttft_ms"]))
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


def error_line(message: str) -> bytes:
    return json.dumps({"event": "error", "message": message}, ensure_ascii=False).encode() + b"\n"


def failure_line(err: BaseException) -> bytes:
    """The error line of an answer that failed after it started: a backing service away by its message, anything
    else as a failed generation."""
    if isinstance(err, UnavailableError):
        return error_line(str(err))
    return error_line(f"generation failed: {type(err).__name__}: {err}")


def parse_event(line: bytes | str) -> AnswerEvent:
    """The event of one line; `EngineStreamError` for an error line, ValueError for a malformed one."""
    try:
        body = json.loads(line)
        kind = body["event"]
        if kind == "token":
            return TokenEvent(str(body["text"]), _parse_logprobs(body.get("logprobs", [])))
        if kind == "done":
            done = dict(body["done"])
            done["logprobs"] = _parse_logprobs(done.get("logprobs", []))
            return DoneEvent(**done)
        if kind == "error":
            raise EngineStreamError(str(body.get("message", "the engine failed")))
    except (KeyError, TypeError, json.JSONDecodeError) as err:
        raise ValueError(f"malformed engine event: {str(line)[:200]!r}") from err
    raise ValueError(f"unknown engine event {kind!r}")


def _choice_json(c: TokenChoice) -> dict[str, Any]:
    return {"token": c.token, "logprob": c.logprob, "bytes": base64.b64encode(c.token_bytes).decode()}


def _logprobs(entries: Sequence[Logprob]) -> list[dict[str, Any]]:
    return [{**_choice_json(e), "top": [_choice_json(t) for t in e.top]} for e in entries]


def _parse_choice(d: dict[str, Any]) -> TokenChoice:
    return TokenChoice(str(d["token"]), float(d["logprob"]), base64.b64decode(d["bytes"]))


def _parse_logprobs(entries: list[dict[str, Any]]) -> tuple[Logprob, ...]:
    out = []
    for d in entries:
        c = _parse_choice(d)
        out.append(Logprob(c.token, c.logprob, c.token_bytes, tuple(_parse_choice(t) for t in d.get("top", []))))
    return tuple(out)


# ---- the engine as its HTTP layer sees it -------------------------------------------------------------------


class EngineAnswer(Protocol):
    """One admitted answer on an engine: its events, then the end; `cancel` when the gateway went away."""

    def __aiter__(self) -> AsyncIterator[AnswerEvent]: ...

    def cancel(self) -> None: ...


class EngineStatus(Protocol):
    """`kvstitch engine` as its internal HTTP API uses it, but for answers (`EngineFacade`, or the API process's
    link to the core process, which forwards answers as they come)."""

    def start(self) -> None: ...

    def close(self) -> None: ...

    def readiness(self) -> dict[str, Any]:
        """`{"ready": bool, "checks": {...}}`, as the gateway's /readyz."""
        ...

    def info(self) -> dict[str, Any]:
        """Engine id, model, key space (fingerprint and digest), load: what a gateway checks before routing."""
        ...

    def load(self) -> dict[str, int]:
        """Answers running and waiting."""
        ...

    def tiers(self, limit: int) -> dict[str, Any]:
        """The blocks held per tier (at most `limit` keys each)."""
        ...

    async def precompute(self, chunks: Sequence[Sequence[int]]) -> dict[str, int]:
        """Bring the chunks' KV into this engine's tiers (computed where missing); blocks by the tier they were
        found in."""
        ...

    def metrics_text(self) -> bytes: ...


class EngineFacade(EngineStatus, Protocol):
    """`kvstitch engine` as its internal HTTP API uses it in one process."""

    async def answer(self, request: EngineAnswerRequest) -> EngineAnswer:
        """Admit the question (`BusyError`, `NotReadyError`, `InvalidRequestError` before any event)."""
        ...
