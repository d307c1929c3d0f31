"""OpenAI-compatible `POST /v1/chat/completions` and `GET /v1/models`.

Every message counts: the last user message is the question (and, with the user turns before it, what retrieval
embeds); the system messages and earlier turns go into the prompt after the stitched chunks, before the question
(`service/engine/conversation.py`). Retrieval and stitching apply as for `/ask`; the sources, TTFT and tier hits
travel in an extra `kvstitch` field (on the last choice chunk when streaming). kvstitch's own options (`top_k`,
`mode`, `positions`, `recompute`, `filter`) can be sent through the openai client's `extra_body`.

What OpenAI offers and kvstitch does not serve (tools, functions, JSON response formats, n > 1) is a 400 naming
the field, never silently ignored; an unknown `model` is a 404 `model_not_found`; errors come in OpenAI's shape
(`service/api/openai_errors.py`).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi import APIRouter, FastAPI, HTTPException, Request
from sse_starlette import EventSourceResponse

from service.api.answers import collect_text, open_answer, sources_and_summary
from service.api.deps import FacadeDep
from service.api.openai_errors import OpenAIError
from service.api.openapi import openai_errors, streamed
from service.api.request_id import request_id_of
from service.api.schemas import ChatCompletionRequest, ChatMessage, stop_strings
from service.api.validation import Sampling, answer_request
from service.facade import AnswerStream, Facade
from service.facade.types import AnswerLimits, AnswerRequest, DoneEvent, Logprob, Role, TokenChoice
from service.facade.types import ChatMessage as Turn

router = APIRouter(prefix="/v1", tags=["openai"], responses=openai_errors(401))
FINISH_REASONS = {"stop": "stop", "length": "length"}
ROLES: dict[str, Role] = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


@router.get("/models")
def models(facade: FacadeDep) -> dict[str, Any]:
    """The model this server answers with, and its aliases (KVSTITCH_MODEL_ALIASES)."""
    names = _served_names(facade)
    return {
        "object": "list",
        "data": [{"id": n, "object": "model", "created": 0, "owned_by": "kvstitch"} for n in names],
    }


@router.post(
    "/chat/completions",
    response_model=None,
    responses={**streamed("The completion"), **openai_errors(400, 404, 413, 503)},
)
async def chat_completions(body: ChatCompletionRequest, facade: FacadeDep, http: Request) -> Any:
    """A chat completion answered with retrieval and stitched chunk KV, the whole conversation in the prompt."""
    _refuse_unserved(body)
    model = _check_model(body.model, facade)
    history, question = _conversation(body.messages)

    def request(limits: AnswerLimits) -> AnswerRequest:
        sampling = Sampling(
            max_new_tokens=body.max_completion_tokens or body.max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            seed=body.seed,
            stop=stop_strings(body.stop),
            logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        )
        return answer_request(
            limits,
            question,
            history,
            sampling,
            top_k=body.top_k,
            mode=body.mode,
            positions=body.positions,
            recompute=body.recompute,
            search_filter=body.filter,
        )

    stream = await _open(facade, request, body)
    completion_id = f"chatcmpl-{request_id_of(http)}"  # vLLM's: the X-Request-Id, sent or generated
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        chunks = _chunks(stream, completion_id, model, body.logprobs, usage, body.filter is not None)
        return EventSourceResponse(chunks, ping=15)
    return await _completion(stream, completion_id, model, body.logprobs, http, body.filter is not None)


def document_v1(app: FastAPI, names: Sequence[str]) -> None:
    """Give the document's `model` field the names served (an enum), so generated clients and the schema fuzz
    test send a model that exists (another name is the documented 404); and drop the 422 FastAPI adds to every
    route with a body: under /v1 a refused body is a 400."""
    plain = app.openapi

    def openapi() -> dict[str, Any]:
        schema = plain()
        properties = schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]
        properties["model"] = {"type": "string", "enum": list(names), "description": "Unset: the served model."}
        for path, operations in schema["paths"].items():
            if path.startswith("/v1/"):
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


# ---- the request ---------------------------------------------------------------------------------------------


def _refuse_unserved(body: ChatCompletionRequest) -> None:
    """A 400 naming the first OpenAI option that kvstitch does not serve, rather than an answer without it."""
    if body.n > 1:
        raise _unsupported("n", "only n = 1 is served: one answer per request")
    if body.tools:
        raise _unsupported("tools", "tool calling is not served by kvstitch")
    if body.tool_choice not in (None, "none"):
        raise _unsupported("tool_choice", "tool calling is not served by kvstitch")
    if body.functions:
        raise _unsupported("functions", "function calling is not served by kvstitch")
    if body.function_call not in (None, "none"):
        raise _unsupported("function_call", "function calling is not served by kvstitch")
    kind = (body.response_format or {}).get("type", "text")
    if kind != "text":
        raise _unsupported("response_format", f"only the text response format is served (got {kind!r})")
    for penalty in ("frequency_penalty", "presence_penalty"):
        if getattr(body, penalty) not in (None, 0.0):
            raise _unsupported(penalty, f"{penalty} is not served by kvstitch (only 0)")
    if body.logit_bias:
        raise _unsupported("logit_bias", "logit_bias is not served by kvstitch")
    if body.modalities not in (None, ["text"]):
        raise _unsupported("modalities", 'only the modalities ["text"] are served')
    for option in ("audio", "prediction", "web_search_options"):
        if getattr(body, option) is not None:
            raise _unsupported(option, f"{option} is not served by kvstitch")
    if body.top_logprobs is not None and not body.logprobs:
        raise OpenAIError(400, "top_logprobs needs logprobs set to true", "top_logprobs", "invalid_value")
    if body.stream_options is not None and not body.stream:
        raise OpenAIError(400, "stream_options is only allowed when stream is true", "stream_options", "invalid_value")


def _unsupported(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, message, param, "unsupported_parameter")


def _served_names(facade: Facade) -> list[str]:
    return list(dict.fromkeys((facade.model_name, *facade.model_aliases)))


def _check_model(model: str | None, facade: Facade) -> str:
    """The model named, or the served one where none is (as vLLM answers)."""
    names = _served_names(facade)
    if model is None:
        return names[0]
    if model not in names:
        served = ", ".join(repr(n) for n in names)
        raise OpenAIError(404, f"the model {model!r} does not exist here; served: {served}", "model", "model_not_found")
    return model


def _conversation(messages: Sequence[ChatMessage]) -> tuple[tuple[Turn, ...], str]:
    """The earlier messages and the question (the last user message, which must be the last message but for
    system ones after it)."""
    last = max((i for i, m in enumerate(messages) if m.role == "user"), default=None)
    if last is None:
        refusal = "messages: needs at least one message with role 'user' (it is the question)"
        raise OpenAIError(400, refusal, "messages", "invalid_value")
    if any(m.role not in ("system", "developer") for m in messages[last + 1 :]):
        raise OpenAIError(400, "the last non-system message must be the user's question", "messages", "invalid_value")
    turns = []
    for index, message in enumerate(messages):
        if message.role == "tool":
            raise _unsupported(f"messages.{index}.role", "tool messages are not served by kvstitch (no tool calling)")
        if index != last:
            turns.append(Turn(ROLES[message.role], _text_of(message.content, index)))
    return tuple(turns), _text_of(messages[last].content, last)


def _text_of(content: str | list[dict[str, Any]] | None, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    other = [p.get("type") for p in content if not (isinstance(p, dict) and p.get("type") == "text")]
    if other:
        raise _unsupported(f"messages.{index}.content", f"only text content parts are served (got {other[0]!r})")
    return "\n".join(str(p.get("text", "")) for p in content)


async def _open(
    facade: Facade, request: Callable[[AnswerLimits], AnswerRequest], body: ChatCompletionRequest
) -> AnswerStream:
    """Check, admit and retrieve; a bound from the settings names the field the client sent."""
    try:
        return await open_answer(facade, request)
    except HTTPException as err:
        if body.max_completion_tokens is not None and isinstance(err.detail, list):
            for error in err.detail:
                if error.get("loc") == ["body", "max_new_tokens"]:
                    error["loc"] = ["body", "max_completion_tokens"]
        raise


# ---- the answer ----------------------------------------------------------------------------------------------


async def _completion(
    stream: AnswerStream, completion_id: str, model: str, logprobs: bool, request: Request, filtered: bool
) -> dict[str, Any]:
    text = await collect_text(stream, request)
    done = stream.done
    assert done is not None
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": text},
        "logprobs": _logprobs(done.logprobs) if logprobs else None,
        "finish_reason": FINISH_REASONS.get(done.finish_reason, "stop"),
    }
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": _usage(done),
        "kvstitch": sources_and_summary(stream, done, filtered),
    }


async def _chunks(
    stream: AnswerStream, completion_id: str, model: str, logprobs: bool, include_usage: bool, filtered: bool
) -> AsyncIterator[dict[str, str]]:
    created = int(time.time())
    usage: dict[str, Any] = {"usage": None} if include_usage else {}

    def chunk(delta: dict[str, Any], finish: str | None = None, lps: Sequence[Logprob] = (), **extra: Any) -> str:
        choice = {"index": 0, "delta": delta, "logprobs": _logprobs(lps) if logprobs else None, "finish_reason": finish}
        body = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [choice],
            **usage,
            **extra,
        }
        return json.dumps(body, ensure_ascii=False)

    sent = 0  # log-probability entries sent so far (the rest go with the last chunk)
    try:
        yield {"data": chunk({"role": "assistant", "content": ""})}
        async for event in stream:
            if isinstance(event, DoneEvent):
                finish = FINISH_REASONS.get(event.finish_reason, "stop")
                summary = sources_and_summary(stream, event, filtered)
                yield {"data": chunk({}, finish, event.logprobs[sent:], kvstitch=summary)}
                if include_usage:  # OpenAI's form: one more chunk, no choices, the usage
                    final = {"id": completion_id, "object": "chat.completion.chunk", "created": created}
                    yield {"data": json.dumps({**final, "model": model, "choices": [], "usage": _usage(event)})}
            else:
                sent += len(event.logprobs)
                yield {"data": chunk({"content": event.text}, lps=event.logprobs)}
        yield {"data": "[DONE]"}
    except Exception as err:  # mid-stream: OpenAI clients read an `error` object from a data line
        error = {"message": f"{type(err).__name__}: {err}", "type": "server_error", "param": None, "code": None}
        yield {"data": json.dumps({"error": error})}
    finally:
        stream.cancel()  # a no-op once the answer ended; it frees the place of one never started (a client gone)


def _logprobs(entries: Sequence[Logprob]) -> dict[str, Any]:
    """OpenAI's `logprobs` of a choice: per token its text, log-probability, own bytes and top alternatives."""

    def entry(choice: TokenChoice) -> dict[str, Any]:
        # OpenAI's floor for a token the model all but rules out; JSON has no -Infinity.
        return {"token": choice.token, "logprob": max(choice.logprob, -9999.0), "bytes": list(choice.token_bytes)}

    return {
        "content": [{**entry(e), "top_logprobs": [entry(t) for t in e.top]} for e in entries],
        "refusal": None,
    }


def _usage(done: DoneEvent) -> dict[str, int]:
    """Tokens of the whole prompt (template, chunks, conversation, question) and of the answer."""
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.output_tokens,
        "total_tokens": done.prompt_tokens + done.output_tokens,
    }
