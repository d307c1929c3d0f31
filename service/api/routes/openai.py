"""OpenAI-compatible `POST /v1/chat/completions` and `GET /v1/models`.

The last user message is the question; retrieval and stitching apply as for `/ask`, and the sources, TTFT and
tier hits travel in an extra `kvstitch` field (on the last chunk when streaming). kvstitch's own options
(`top_k`, `mode`, `positions`, `recompute`) can be sent through the openai client's `extra_body`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from sse_starlette import EventSourceResponse

from service.answer import DoneEvent
from service.api.deps import FacadeDep, field_error, require_api_key
from service.api.openapi import openai_errors, streamed
from service.api.schemas import ChatCompletionRequest, ChatMessage
from service.api.streaming import collect_text, events, open_answer, sources_and_summary
from service.facade import AnswerRequest, AnswerSession

router = APIRouter(prefix="/v1", tags=["openai"], dependencies=[Depends(require_api_key)], responses=openai_errors(401))
FINISH_REASONS = {"stop": "stop", "length": "length"}


@router.get("/models")
def models(facade: FacadeDep) -> dict[str, Any]:
    """The one model this server answers with."""
    entry = {"id": facade.model_name, "object": "model", "created": 0, "owned_by": "kvstitch"}
    return {"object": "list", "data": [entry]}


@router.post(
    "/chat/completions",
    response_model=None,
    responses={**streamed("The completion"), **openai_errors(400, 413, 422, 503)},
)
async def chat_completions(body: ChatCompletionRequest, facade: FacadeDep, http: Request) -> Any:
    """A chat completion answered with retrieval and stitched chunk KV."""
    request = AnswerRequest(
        question=_last_user_text(body.messages),
        top_k=body.top_k,
        mode=body.mode,
        positions=body.positions,
        max_new_tokens=body.max_completion_tokens or body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        recompute=body.recompute,
    )
    session = await open_answer(facade, request)
    completion_id = f"chatcmpl-{uuid.uuid4().hex}"
    if body.stream:
        return EventSourceResponse(_chunks(session, completion_id, facade.model_name), ping=15)
    return await _completion(session, completion_id, facade.model_name, http)


def _last_user_text(messages: list[ChatMessage]) -> str:
    for message in reversed(messages):
        if message.role == "user":
            return _text_of(message.content)
    raise field_error("messages", "needs at least one message with role 'user' (it is the question)")


def _text_of(content: str | list[dict[str, Any]] | None) -> str:
    if isinstance(content, str):
        return content
    parts = [p.get("text", "") for p in content or [] if isinstance(p, dict) and p.get("type") == "text"]
    return "\n".join(str(p) for p in parts)


async def _completion(session: AnswerSession, completion_id: str, model: str, request: Request) -> dict[str, Any]:
    text = await collect_text(session, request)
    done = session.done
    assert done is not None
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": FINISH_REASONS.get(done.finish_reason, "stop"),
            }
        ],
        "usage": _usage(done),
        "kvstitch": sources_and_summary(session, done),
    }


async def _chunks(session: AnswerSession, completion_id: str, model: str) -> AsyncIterator[dict[str, str]]:
    created = int(time.time())

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, str]:
        body = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            **extra,
        }
        return {"data": json.dumps(body, ensure_ascii=False)}

    try:
        yield chunk({"role": "assistant", "content": ""})
        async for event in events(session):
            if isinstance(event, DoneEvent):
                finish = FINISH_REASONS.get(event.finish_reason, "stop")
                yield chunk({}, finish, usage=_usage(event), kvstitch=sources_and_summary(session, event))
            else:
                yield chunk({"content": event.text})
        yield {"data": "[DONE]"}
    except Exception as err:  # mid-stream: OpenAI clients read an `error` object from a data line
        yield {"data": json.dumps({"error": {"message": str(err), "type": type(err).__name__}})}


def _usage(done: DoneEvent) -> dict[str, int]:
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.output_tokens,
        "total_tokens": done.prompt_tokens + done.output_tokens,
    }
