"""POST /ask: the answer as server-sent events (`retrieval`, `token`..., `done` | `error`) or one JSON object."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from sse_starlette import EventSourceResponse

from service.api.answers import collect_text, filter_note, open_answer, sources_and_summary
from service.api.deps import FacadeDep
from service.api.openapi import errors, streamed
from service.api.request_id import request_id_of
from service.api.schemas import AskRequest, stop_strings
from service.api.validation import Sampling, answer_request
from service.facade import AnswerStream
from service.facade.errors import UnavailableError
from service.facade.types import AnswerLimits, AnswerRequest, ChatMessage, DoneEvent

router = APIRouter(tags=["ask"], responses=errors(401))
EVENTS = ("retrieval", "token", "done", "error")


@router.post("/ask", response_model=None, responses={**streamed("The answer", EVENTS), **errors(400, 413, 422, 503)})
async def ask(body: AskRequest, facade: FacadeDep, request: Request) -> Any:
    """Answer a question from the retrieved chunks; streams SSE unless `stream` is false."""
    stream = await open_answer(facade, lambda limits: _request(body, limits))
    request_id = request_id_of(request)
    if body.stream:
        return EventSourceResponse(_sse(stream, body.filter is not None, request_id), ping=15)
    text = await collect_text(stream, request)
    assert stream.done is not None
    summary = sources_and_summary(stream, stream.done, body.filter is not None)
    return {"answer": text, "chunks": summary.pop("sources"), **summary, "request_id": request_id}


def _request(body: AskRequest, limits: AnswerLimits) -> AnswerRequest:
    history = tuple(ChatMessage(m.role, m.content) for m in body.history)
    sampling = Sampling(body.max_new_tokens, body.temperature, body.top_p, body.seed, stop_strings(body.stop))
    return answer_request(
        limits,
        body.question,
        history,
        sampling,
        top_k=body.top_k,
        mode=body.mode,
        positions=body.positions,
        recompute=body.recompute,
        search_filter=body.filter,
    )


async def _sse(stream: AnswerStream, filtered: bool, request_id: str) -> AsyncIterator[dict[str, str]]:
    note = filter_note(stream, filtered)  # said in the retrieval event and again in done
    try:
        yield _event("retrieval", {"chunks": stream.sources, "dropped": stream.dropped, **note})
        async for event in stream:
            if isinstance(event, DoneEvent):
                yield _event("done", {**event.summary(), **note, "request_id": request_id})
            else:
                yield _event("token", {"text": event.text})
    except UnavailableError as err:
        yield _event("error", {"message": str(err)})
    except Exception as err:  # the stream has started: the status is sent, only an event can say what happened
        yield _event("error", {"message": f"generation failed: {type(err).__name__}: {err}"})
    finally:
        stream.cancel()  # a no-op once the answer ended; it frees the place of one never started (a client gone)


def _event(name: str, data: dict[str, Any]) -> dict[str, str]:
    return {"event": name, "data": json.dumps(data, ensure_ascii=False)}
