"""The messages between an engine's core process (the model, its engine thread) and its API process.

With `KVSTITCH_ENGINE_API_PROCESS` an engine serves its internal HTTP API from a second process (`api/engine_front.py`)
so that the event loop writing every running answer's lines no longer shares the engine thread's GIL. The two talk
over one socket pair, a message per `Connection.send_bytes` (length-prefixed by `multiprocessing.connection`; no
pickle: every message is bytes built here). A message is a kind byte, then:

    front -> core   ANSWER   id, a header's length (uint32), the header, then every chunk's ids: the request
                             the API process parsed and checked (`answer_message`: the header is its fields as
                             JSON, each chunk's ids replaced by their count; the ids follow as uint32)
                    CANCEL   id (the gateway went away)
                    CALL     JSON {"call": n, "method": ..., "args": [...]} (readiness, info, load, tiers, ...)
    core -> front   OPENED   id, the answer's start on the core (float64 `time.perf_counter()`: one clock for the
                             two processes of one host; the API process times its hops with it)
                    REFUSED  id, JSON {"type": error class, "message": ..., "field": ...} (before any line)
                    LINES    (id, length, line) ... : a step's lines of every answer in one message; length 0
                             ends that answer
                    RESULT   JSON {"call": n, "result": ...} or {"call": n, "error": {...}}
                    STOP     the core is stopping: stop accepting, finish what streams

Ids are unsigned 64-bit, little-endian; a line is one of `facade.engine`'s JSON lines, so the API process writes
it as it comes without decoding it. The API process parses each request and checks its chunks' ids against the
model's vocabulary (on its own GIL), so the core decodes a small header and one run of raw ids: parsing and checking
the gateway's JSON, thousands of packed ids a question, would hold the GIL the engine thread launches with.
"""

from __future__ import annotations

import array
import json
import struct
import sys
from collections.abc import Iterator
from typing import Any

from service.errors import BusyError, InvalidRequestError, NotReadyError, TooLargeError, UnavailableError
from service.facade.engine import EngineAnswerRequest, WireChunk, chunk_fields
from service.facade.types import ChatMessage

ANSWER = b"A"
CANCEL = b"C"
CALL = b"R"
OPENED = b"O"
REFUSED = b"X"
LINES = b"L"
RESULT = b"r"
STOP = b"S"

_ID = struct.Struct("<Q")
_HEADER = struct.Struct("<QI")  # an ANSWER's id and header length
_LINE_HEAD = struct.Struct("<QI")
_STARTED = struct.Struct("<d")
# The errors a refusal or a call may carry across; anything else arrives as a RuntimeError with its message.
_ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls for cls in (BusyError, NotReadyError, UnavailableError, InvalidRequestError, TooLargeError)
}


class LinkError(ValueError):
    """A message that is not one of this module's (a bug on the other side, never the gateway's input)."""


def with_id(kind: bytes, answer_id: int, payload: bytes = b"") -> bytes:
    return kind + _ID.pack(answer_id) + payload


def split_id(message: bytes) -> tuple[int, bytes]:
    """The id and payload of a CANCEL, OPENED or REFUSED message (and the id of an ANSWER, its first field too)."""
    if len(message) < 1 + _ID.size:
        raise LinkError(f"a {message[:1]!r} message of {len(message)} bytes has no id")
    return _ID.unpack_from(message, 1)[0], message[1 + _ID.size :]


def opened_message(answer_id: int, started: float) -> bytes:
    """OPENED for an answer the core admitted at `started` (perf_counter)."""
    return with_id(OPENED, answer_id, _STARTED.pack(started))


def opened_started(payload: bytes) -> float | None:
    """The core's start of an OPENED message's answer (None from a core that sent none)."""
    return _STARTED.unpack(payload)[0] if len(payload) == _STARTED.size else None


def answer_message(answer_id: int, request: EngineAnswerRequest) -> bytes:
    """ANSWER for a request the API process parsed and checked: `read_answer` gives it back."""
    header = request.json_with(lambda c: {**chunk_fields(c), "tokens": len(c.token_ids)})
    ids = array.array("I")
    for chunk in request.chunks:
        ids.extend(chunk.token_ids)
    if sys.byteorder != "little":
        ids.byteswap()
    encoded = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode()
    return ANSWER + _HEADER.pack(answer_id, len(encoded)) + encoded + ids.tobytes()


def read_answer(message: bytes) -> tuple[int, EngineAnswerRequest]:
    """The id and request of an ANSWER message; LinkError when it is not one `answer_message` built."""
    if len(message) < 1 + _HEADER.size:
        raise LinkError(f"an ANSWER message of {len(message)} bytes has no header")
    answer_id, length = _HEADER.unpack_from(message, 1)
    begin = 1 + _HEADER.size
    header = json_payload(message[begin : begin + length])
    ids = array.array("I")
    try:
        ids.frombytes(message[begin + length :])
    except ValueError as err:
        raise LinkError(f"an ANSWER's ids are not whole uint32 values: {err}") from err
    if sys.byteorder != "little":
        ids.byteswap()
    try:
        return answer_id, _request(header, ids)
    except (KeyError, TypeError, ValueError) as err:
        raise LinkError(f"an ANSWER's header does not match its ids: {err}") from err


def _request(header: dict[str, Any], ids: array.array[int]) -> EngineAnswerRequest:
    """The request of a header and its ids (written by `answer_message`, after the API process's checks)."""
    chunks, at = [], 0
    for c in header.pop("chunks"):
        tokens = int(c.pop("tokens"))
        chunks.append(WireChunk(**c, token_ids=tuple(ids[at : at + tokens])))
        at += tokens
    if at != len(ids):
        raise ValueError(f"{len(ids)} ids for chunks of {at}")
    history = tuple(ChatMessage(m["role"], m["text"]) for m in header.pop("history"))
    stop = tuple(header.pop("stop"))
    return EngineAnswerRequest(**header, chunks=tuple(chunks), history=history, stop=stop)


def json_message(kind: bytes, body: Any) -> bytes:
    return kind + json.dumps(body, separators=(",", ":")).encode()


def json_body(message: bytes) -> Any:
    """The JSON after a message's kind byte."""
    return json_payload(message[1:])


def json_payload(payload: bytes) -> Any:
    try:
        return json.loads(payload)
    except ValueError as err:
        raise LinkError(f"a message's payload is not JSON: {err}") from err


def lines_message(lines: list[tuple[int, bytes]]) -> bytes:
    """One LINES message of `(id, line)` pairs; an empty line ends that answer."""
    parts = [LINES]
    for answer_id, line in lines:
        parts.append(_LINE_HEAD.pack(answer_id, len(line)))
        parts.append(line)
    return b"".join(parts)


def read_lines(message: bytes) -> Iterator[tuple[int, bytes]]:
    """The `(id, line)` pairs of a LINES message, in order."""
    view = memoryview(message)
    at = 1
    while at < len(view):
        if at + _LINE_HEAD.size > len(view):
            raise LinkError("a LINES message ends inside a line's head")
        answer_id, length = _LINE_HEAD.unpack_from(view, at)
        at += _LINE_HEAD.size
        if at + length > len(view):
            raise LinkError("a LINES message ends inside a line")
        yield answer_id, bytes(view[at : at + length])
        at += length


def error_json(err: BaseException) -> dict[str, Any]:
    """An error as a refusal or a failed call carries it."""
    body: dict[str, Any] = {"type": type(err).__name__, "message": str(err)}
    if isinstance(err, InvalidRequestError):
        body["field"], body["message"] = err.field, err.message
    if isinstance(err, UnavailableError):
        body["component"] = err.component
    return body


def error_from_json(body: Any) -> Exception:
    """The error `error_json` wrote, as the same class where it is one of the service's (so the API process answers
    with the status the in-process engine gives), else a RuntimeError with its message."""
    if not isinstance(body, dict):
        return RuntimeError(f"malformed error from the engine core: {body!r}"[:300])
    message = str(body.get("message", ""))
    cls = _ERRORS.get(str(body.get("type")))
    if cls is not None and issubclass(cls, InvalidRequestError):
        return cls(str(body.get("field", "body")), message)
    if cls is UnavailableError:
        unavailable = UnavailableError(str(body.get("component", "engine")), "")
        unavailable.args = (message,)  # its message as the core wrote it, not rebuilt around the component
        return unavailable
    if cls is not None:
        return cls(message)
    return RuntimeError(f"{body.get('type')}: {message}")
