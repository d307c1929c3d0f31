"""OpenAI fidelity over a real uvicorn server, through the official `openai` client and LangChain's `ChatOpenAI`:
every message in the prompt, `stop`, `logprobs`, `usage`, model names, unserved options refused by name, and every
error under /v1 in OpenAI's shape."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from api_support import QUESTION, ingest
from app_server import LiveServer, MakeApp
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI
from pydantic import BaseModel
from test_api_conversation import pick_stop

from service.retrieval.fusion import RRF_K

API_KEY = "fidelity-key"
ALIASES = "gpt-4o-mini, house-model"
CONVERSATION: list[Any] = [
    {"role": "system", "content": "Answer in one sentence."},
    {"role": "user", "content": "What is Mauna Loa on Hawaii?"},
    {"role": "assistant", "content": "The largest active volcano."},
    {"role": "user", "content": QUESTION},
]


@pytest.fixture(scope="module")
def server(make_module_app: MakeApp) -> Iterator[LiveServer]:
    app = make_module_app(api_key=API_KEY, model_aliases=ALIASES, max_request_mb=1)
    with LiveServer(app) as live:
        with httpx.Client(base_url=live.url, headers={"authorization": f"Bearer {API_KEY}"}, timeout=60) as client:
            ingest(client)
        yield live


@pytest.fixture(scope="module")
def oai(server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0) as client:
        yield client


def complete(oai: openai.OpenAI, **body: Any) -> Any:
    return oai.chat.completions.create(
        **{"model": "qwen2", "messages": CONVERSATION, "max_tokens": 12, "temperature": 0, **body}
    )


def ask(server: LiveServer, **body: Any) -> dict[str, Any]:
    headers = {"authorization": f"Bearer {API_KEY}"}
    reply = httpx.post(f"{server.url}/ask", json={"stream": False, **body}, headers=headers, timeout=60)
    assert reply.status_code == 200, reply.text
    result: dict[str, Any] = reply.json()
    return result


# ---- every message, usage --------------------------------------------------------------------------------------


def test_every_message_reaches_the_prompt_as_ask_history_does(oai: openai.OpenAI, server: LiveServer) -> None:
    history = [{"role": m["role"], "content": m["content"]} for m in CONVERSATION[:-1]]
    expected = ask(server, question=QUESTION, history=history, max_new_tokens=12)
    last_only = complete(oai, messages=CONVERSATION[-1:])

    completion = complete(oai)

    assert completion.choices[0].message.content == expected["answer"]
    usage = completion.usage
    assert usage is not None and usage.prompt_tokens == expected["prompt_tokens"]  # chunks, history and question
    assert usage.completion_tokens == expected["output_tokens"]
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert last_only.usage is not None and usage.prompt_tokens > last_only.usage.prompt_tokens + 20

    def scores(reply: Any) -> list[float]:
        return [float(s["score"]) for s in reply.model_extra["kvstitch"]["sources"]]

    # Retrieval read the user turn before the question, as /ask with the same history does: two searches (the
    # question alone, and after the turn) fused by reciprocal rank, where the last message alone is one search.
    assert [s["id"] for s in completion.model_extra["kvstitch"]["sources"]] == [c["id"] for c in expected["chunks"]]
    assert all(0 < score <= 2 / (RRF_K + 1) + 1e-6 for score in scores(completion)), scores(completion)  # 6 decimals
    assert scores(completion) != scores(last_only)


def test_a_streamed_completion_carries_usage_when_asked(oai: openai.OpenAI) -> None:
    plain = complete(oai)
    chunks = list(complete(oai, stream=True, stream_options={"include_usage": True}))

    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.model_dump() == plain.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == plain.choices[0].finish_reason


# ---- stop, logprobs ----------------------------------------------------------------------------------------------


def test_stop_ends_the_text_before_it_streamed_or_not(oai: openai.OpenAI) -> None:
    free = complete(oai, max_tokens=24).choices[0].message.content
    stop, expected = pick_stop(free)

    stopped = complete(oai, max_tokens=24, stop=stop)
    streamed = list(complete(oai, max_tokens=24, stop=[stop, "\u2603"], stream=True))

    assert (stopped.choices[0].message.content, stopped.choices[0].finish_reason) == (expected, "stop")
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_logprobs_come_in_openais_shape(oai: openai.OpenAI) -> None:
    completion = complete(oai, logprobs=True, top_logprobs=3)
    streamed = list(complete(oai, logprobs=True, top_logprobs=3, stream=True))

    content = completion.choices[0].logprobs.content
    assert len(content) == completion.usage.completion_tokens - (completion.choices[0].finish_reason == "stop")
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        # A token that holds part of a character reads as U+FFFD; its bytes are its own (test_api_v1_fidelity.py).
        assert entry.bytes == list(entry.token.encode()) or entry.token == "\ufffd"
    in_chunks = [e for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in in_chunks] == [(e.token, e.logprob) for e in content]
    assert complete(oai).choices[0].logprobs is None


# ---- model names -------------------------------------------------------------------------------------------------


def test_models_lists_the_served_name_and_its_aliases(oai: openai.OpenAI) -> None:
    assert [m.id for m in oai.models.list().data] == ["qwen2", "gpt-4o-mini", "house-model"]
    assert complete(oai, model="gpt-4o-mini").model == "gpt-4o-mini"


def test_an_unknown_model_is_a_404_model_not_found(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as refused:
        complete(oai, model="gpt-5")

    assert refused.value.code == "model_not_found" and refused.value.param == "model"
    assert "gpt-5" in refused.value.message and "qwen2" in refused.value.message


# ---- what is not served ------------------------------------------------------------------------------------------

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [TOOL]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"functions": [TOOL["function"]]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}, "response_format"),
        ({"n": 2}, "n"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}, CONVERSATION[-1]]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, None),
    ],
)
def test_an_unserved_option_is_a_400_naming_it(oai: openai.OpenAI, body: dict[str, Any], param: str | None) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        complete(oai, **body)

    assert refused.value.param == (param or "messages.0.content")
    assert refused.value.body["type"] == "invalid_request_error"  # type: ignore[index]


# ---- every error in OpenAI's shape -------------------------------------------------------------------------------


def test_every_error_under_v1_has_openais_shape(server: LiveServer) -> None:
    good = {"authorization": f"Bearer {API_KEY}"}
    chat = {"model": "qwen2", "messages": CONVERSATION}
    replies = {
        "unknown route": httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"}, headers=good),
        "embeddings": httpx.post(f"{server.url}/v1/embeddings", json={"input": "x"}, headers=good),
        "no key": httpx.post(f"{server.url}/v1/chat/completions", json=chat),
        "too large": httpx.post(f"{server.url}/v1/chat/completions", content=b"x" * (2 << 20), headers=good),
        "bad field": httpx.post(f"{server.url}/v1/chat/completions", json={**chat, "temperature": 9}, headers=good),
        "bound": httpx.post(f"{server.url}/v1/chat/completions", json={**chat, "max_tokens": 5000}, headers=good),
        "method": httpx.get(f"{server.url}/v1/chat/completions", headers=good),
    }
    expected = {
        "unknown route": (404, None, "unknown_url"),
        "embeddings": (404, None, "unknown_url"),
        "no key": (401, None, "invalid_api_key"),
        "too large": (413, None, "request_too_large"),
        "bad field": (400, "temperature", "invalid_value"),
        "bound": (400, "max_tokens", "invalid_value"),
        "method": (405, None, "method_not_allowed"),
    }
    for name, reply in replies.items():
        error = reply.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, name
        assert (reply.status_code, error["param"], error["code"]) == expected[name], (name, error)
        assert error["type"] == "invalid_request_error" and error["message"], name
    assert "max_new_tokens" not in replies["bound"].json()["error"]["message"]
    assert "POST /v1/completions" in replies["unknown route"].json()["error"]["message"]


# ---- LangChain ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_model(server: LiveServer) -> ChatOpenAI:
    return ChatOpenAI(
        model="qwen2", base_url=f"{server.url}/v1", api_key=API_KEY, temperature=0, max_tokens=10, max_retries=0
    )


def test_langchain_invokes_and_streams_a_conversation(chat_model: ChatOpenAI, oai: openai.OpenAI) -> None:
    messages = [
        SystemMessage(CONVERSATION[0]["content"]),
        HumanMessage(CONVERSATION[1]["content"]),
        AIMessage(CONVERSATION[2]["content"]),
        HumanMessage(QUESTION),
    ]
    expected = complete(oai, max_tokens=10)

    answer = chat_model.invoke(messages)
    chunks = list(chat_model.stream(messages))

    assert answer.content == expected.choices[0].message.content
    assert answer.usage_metadata is not None
    assert answer.usage_metadata["input_tokens"] == expected.usage.prompt_tokens
    assert "".join(str(c.content) for c in chunks) == answer.content
    assert chunks[-1].response_metadata.get("finish_reason") in ("stop", "length") or any(
        c.response_metadata.get("finish_reason") for c in chunks
    )


class Answer(BaseModel):
    text: str


def test_langchain_structured_output_and_tools_get_a_clear_400(chat_model: ChatOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as structured:
        chat_model.with_structured_output(Answer).invoke(QUESTION)
    with pytest.raises(openai.BadRequestError) as tools:
        chat_model.bind_tools([Answer]).invoke(QUESTION)

    assert structured.value.param in ("response_format", "tools")
    assert "not served" in structured.value.message or "only the text" in structured.value.message
    assert tools.value.param == "tools" and "tool calling is not served" in tools.value.message
