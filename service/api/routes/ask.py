"""POST /ask: the answer as server-sent events (`retrieval`, `token`..., `done` | `error`) or one JSON object."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends
from sse_starlette import EventSourceResponse

from service.api.answering import Answer, AskOptions, collect_text, open_answer
from service.api.deps import GatewayDep, ready_asker, require_api_key
from service.api.openapi import errors, streamed
from service.api.schemas import AskRequest
from service.ask import Asker, DependencyError, DoneEvent

router = APIRouter(tags=["ask"], dependencies=[Depends(require_api_key)], responses=errors(401))
AskerDep = Annotated[Asker, Depends(ready_asker)]
EVENTS = ("retrieval", "token", "done", "error")


@router.post("/ask", response_model=None, responses={**streamed("The answer", EVENTS), **errors(400, 413, 422, 503)})
async def ask(body: AskRequest, gateway: GatewayDep, asker: AskerDep) -> Any:
    """Answer a question from the retrieved chunks; streams SSE unless `stream` is false."""
    options = AskOptions(**body.model_dump(exclude={"stream"}))
    answer = await open_answer(gateway, asker, options)
    if body.stream:
        return EventSourceResponse(_sse(answer), ping=15)
    return await _collect(answer)


async def _sse(answer: Answer) -> AsyncIterator[dict[str, str]]:
    try:
        yield _event("retrieval", {"chunks": answer.sources(), "dropped": answer.retrieval.dropped})
        async for event in answer.events():
            if isinstance(event, DoneEvent):
                yield _event("done", event.summary())
            else:
                yield _event("token", {"text": event.text})
    except DependencyError as err:
        yield _event("error", {"message": str(err)})
    except Exception as err:  # the stream has started: the status is sent, only an event can say what happened
        yield _event("error", {"message": f"generation failed: {type(err).__name__}: {err}"})
    finally:
        answer.close()


async def _collect(answer: Answer) -> dict[str, Any]:
    text = await collect_text(answer)
    assert answer.done is not None
    return {"answer": text, "chunks": answer.sources(), **answer.done.summary()}


def _event(name: str, data: dict[str, Any]) -> dict[str, str]:
    return {"event": name, "data": json.dumps(data, ensure_ascii=False)}
