"""The OpenAI-compatible API, driven by the official `openai` client."""

from __future__ import annotations

import openai
import pytest
from api_support import QUESTION, ingest
from fastapi.testclient import TestClient


@pytest.fixture
def oai(client: TestClient) -> openai.OpenAI:
    ingest(client)
    return openai.OpenAI(base_url=f"{client.base_url}/v1", api_key="unused", http_client=client, max_retries=0)


def test_models_lists_the_served_model(oai: openai.OpenAI) -> None:
    models = oai.models.list().data
    assert [m.id for m in models] == ["qwen2"] and models[0].owned_by == "kvstitch"


def test_a_completion_answers_like_ask_and_carries_the_sources(oai: openai.OpenAI, client: TestClient) -> None:
    history = [{"role": "system", "content": "be brief"}]  # every message counts: the system one too
    body = {"question": QUESTION, "history": history, "stream": False, "max_new_tokens": 8}
    expected = client.post("/ask", json=body).json()

    completion = oai.chat.completions.create(
        model="qwen2",
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": QUESTION}],
        max_tokens=8,
        temperature=0,
    )

    assert completion.object == "chat.completion"
    assert completion.choices[0].message.content == expected["answer"]
    assert completion.choices[0].finish_reason in ("stop", "length")
    assert completion.usage is not None and completion.usage.completion_tokens == expected["output_tokens"]
    extra = completion.model_extra["kvstitch"] if completion.model_extra else {}
    assert [s["doc_id"] for s in extra["sources"]] == [c["doc_id"] for c in expected["chunks"]]
    assert extra["ttft_ms"] > 0 and sum(extra["kv"].values()) == len(expected["chunks"])


def test_a_streamed_completion_joins_to_the_same_answer(oai: openai.OpenAI) -> None:
    plain = oai.chat.completions.create(
        model="qwen2",
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=8,
        temperature=0,
        extra_body={"top_k": 2},
    )

    stream = oai.chat.completions.create(
        model="qwen2",
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=8,
        temperature=0,
        stream=True,
        extra_body={"top_k": 2, "mode": "turbo"},
    )
    chunks = list(stream)

    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    last = chunks[-1]
    assert last.choices[0].finish_reason in ("stop", "length")
    extra = last.model_extra["kvstitch"] if last.model_extra else {}
    assert len(extra["sources"]) == 2 and extra["mode"] == "turbo"


def test_a_conversation_without_a_user_message_is_refused(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        oai.chat.completions.create(model="qwen2", messages=[{"role": "system", "content": "hi"}])
    assert "user" in str(refused.value)
