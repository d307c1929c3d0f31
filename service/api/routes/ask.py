"""POST /ask: the answer as server-sent events (`retrieval`, `token`..., `done` | `error`) or one JSON object."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from sse_starlette import EventSourceResponse

from service.api.deps import FacadeDep, require_api_key
from service.api.openapi import errors, streamed
from service.api.schemas import AskRequest, stop_strings
from service.api.streaming import collect_text, events, open_answer, sources_and_summary
from service.errors import UnavailableError
from service.facade import AnswerRequest, AnswerSession
from service.usecases.answer import ChatMessage, DoneEvent

router = APIRouter(tags=["ask"], dependencies=[Depends(require_api_key)], responses=errors(401))
EVENTS = ("retrieval", "token", "done", "error")


@router.post("/ask", response_model=None, responses={**streamed("The answer", EVENTS), **errors(400, 413, 422, 503)})
async def ask(body: AskRequest, facade: FacadeDep, request: Request) -> Any:
    """Answer a question from the retrieved chunks; streams SSE unless `stream` is false."""
    session = await open_answer(facade, _request(body))
    if body.stream:
        return EventSourceResponse(_sse(session), ping=15)
    text = await collect_text(session, request)
    assert session.done is not None
    summary = sources_and_summary(session, session.done)
    return {"answer": text, "chunks": summary.pop("sources"), **summary}


def _request(body: AskRequest) -> AnswerRequest:
    fields = body.model_dump(exclude={"stream", "history", "stop"})
    history = tuple(ChatMessage(m.role, m.content) for m in body.history)
    return AnswerRequest(**fields, history=history, stop=stop_strings(body.stop))


async def _sse(session: AnswerSession) -> AsyncIterator[dict[str, str]]:
    try:
        yield _event("retrieval", {"chunks": session.sources(), "dropped": session.retrieval.dropped})
        async for event in events(session):
            if isinstance(event, DoneEvent):
                yield _event("done", event.summary())
            else:
                yield _event("token", {"text": event.text})
    except UnavailableError as err:
        yield _event("error", {"message": str(err)})
    except Exception as err:  # the stream has started: the status is sent, only an event can say what happened
        yield _event("error", {"message": f"generation failed: {type(err).__name__}: {err}"})


def _event(name: str, data: dict[str, Any]) -> dict[str, str]:
    return {"event": name, "data": json.dumps(data, ensure_ascii=False)}
