"""Inputs that JSON can carry but the service cannot use: non-finite numbers (`NaN`, `Infinity`, `1e309`, which
Python's json reads as floats) and lone surrogates (`\\ud800`, which no UTF-8 encoder can write). Each one is a 422
naming the field (a 400 under /v1, as OpenAI answers), in a body the client can parse; none reaches the engine, the
queue or a 500."""

from __future__ import annotations

import json
from typing import Any

import pytest
from api_support import QUESTION
from fastapi.testclient import TestClient

NON_FINITE = ["NaN", "Infinity", "-Infinity", "1e309"]
ASK_NUMBERS = ["temperature", "top_p", "top_k", "max_new_tokens", "seed"]
OPENAI_NUMBERS = ["temperature", "top_p", "top_k", "max_tokens", "max_completion_tokens", "seed"]
LONE = "a\ud800b"
OPENAI_BODY = {"model": "qwen2", "messages": [{"role": "user", "content": QUESTION}]}


def raw_json(body: dict[str, Any], field: str, literal: str) -> bytes:
    """`body` with `"field": literal` appended as written (json.dumps would refuse NaN with allow_nan=False)."""
    return (json.dumps(body)[:-1] + f', "{field}": {literal}}}').encode()


def post_raw(client: TestClient, path: str, content: bytes) -> Any:
    return client.post(path, content=content, headers={"content-type": "application/json"})


def post_escaped(client: TestClient, path: str, body: dict[str, Any]) -> Any:
    """json.dumps writes a lone surrogate as the escape `\\ud800`, which is how a client sends one."""
    return post_raw(client, path, json.dumps(body).encode())


@pytest.mark.parametrize("literal", NON_FINITE)
@pytest.mark.parametrize("field", ASK_NUMBERS)
def test_a_non_finite_number_in_ask_is_a_422_naming_it(module_client: TestClient, field: str, literal: str) -> None:
    reply = post_raw(module_client, "/ask", raw_json({"question": QUESTION}, field, literal))

    assert reply.status_code == 422, reply.text
    assert [error["loc"] for error in reply.json()["detail"]] == [["body", field]]


@pytest.mark.parametrize("literal", NON_FINITE)
@pytest.mark.parametrize("field", OPENAI_NUMBERS)
def test_a_non_finite_number_in_a_chat_completion_is_a_400_naming_it(
    module_client: TestClient, field: str, literal: str
) -> None:
    reply = post_raw(module_client, "/v1/chat/completions", raw_json(OPENAI_BODY, field, literal))

    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == field


@pytest.mark.parametrize("literal", NON_FINITE)
def test_a_non_finite_number_in_an_unknown_ingest_field_is_a_422_naming_it(
    module_client: TestClient, literal: str
) -> None:
    body = {"documents": [{"id": "a", "text": "t"}]}

    reply = post_raw(module_client, "/ingest", raw_json(body, "priority", literal))

    assert reply.status_code == 422, reply.text
    error = reply.json()["detail"][0]
    assert error["loc"] == ["body", "priority"] and error["type"] == "extra_forbidden"
    assert error["input"] in ("NaN", "Infinity", "-Infinity")  # written as text, so the 422 itself can be sent


def test_a_non_finite_number_in_metadata_is_a_422_naming_the_metadata(module_client: TestClient) -> None:
    content = b'{"documents": [{"id": "a", "text": "t", "metadata": {"score": NaN}}]}'

    reply = post_raw(module_client, "/ingest", content)

    assert reply.status_code == 422, reply.text
    error = reply.json()["detail"][0]
    assert error["loc"] == ["body", "documents", 0, "metadata"] and "metadata.score" in error["msg"]


METADATA = ["body", "documents", 0, "metadata"]
SURROGATES = [
    ("/ask", {"question": LONE}, ["body", "question"]),
    ("/ingest", {"documents": [{"id": LONE, "text": "t"}]}, ["body", "documents", 0, "id"]),
    ("/ingest", {"documents": [{"id": "a", "text": LONE}]}, ["body", "documents", 0, "text"]),
    ("/ingest", {"documents": [{"id": "a", "text": "t", "metadata": {LONE: 1}}]}, METADATA),
    ("/ingest", {"documents": [{"id": "a", "text": "t", "metadata": {"k": [LONE]}}]}, METADATA),
    ("/ask", {"question": QUESTION, "mode": LONE}, ["body", "mode"]),
    # pydantic cannot name a field whose name it cannot decode: the error is on the body, the name in `input`
    ("/ask", {"question": QUESTION, LONE: 1}, ["body"]),
]


@pytest.mark.parametrize(("path", "body", "loc"), SURROGATES)
def test_a_lone_surrogate_is_a_422_naming_the_field(
    module_client: TestClient, path: str, body: dict[str, Any], loc: list[Any]
) -> None:
    reply = post_escaped(module_client, path, body)

    assert reply.status_code == 422, reply.text
    errors = reply.json()["detail"]
    assert [error["loc"] for error in errors] == [loc]
    assert "\ud800" not in reply.text and "\\ud800" in json.dumps(errors)  # escaped, never raw


@pytest.mark.parametrize(
    ("content", "param"),
    [
        (LONE, "messages.0.content"),
        ([{"type": "text", "text": LONE}], "messages.0.content"),
    ],
)
def test_a_lone_surrogate_in_a_chat_message_is_a_400_naming_it(
    module_client: TestClient, content: Any, param: str
) -> None:
    body = {**OPENAI_BODY, "messages": [{"role": "user", "content": content}]}

    reply = post_escaped(module_client, "/v1/chat/completions", body)

    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_metadata_nested_too_deep_is_a_422_at_submit(module_client: TestClient) -> None:
    deep: Any = "leaf"
    for _ in range(500):
        deep = {"k": deep}

    reply = post_escaped(module_client, "/ingest", {"documents": [{"id": "deep", "text": "t", "metadata": deep}]})

    assert reply.status_code == 422, reply.text
    error = reply.json()["detail"][0]
    assert error["loc"] == ["body", "documents", 0, "metadata"] and "nested deeper than" in error["msg"]


def test_metadata_over_the_size_limit_is_a_422_at_submit(module_client: TestClient) -> None:
    metadata = {"notes": "x" * 20_000}

    reply = post_escaped(module_client, "/ingest", {"documents": [{"id": "big", "text": "t", "metadata": metadata}]})

    assert reply.status_code == 422, reply.text
    error = reply.json()["detail"][0]
    assert error["loc"] == ["body", "documents", 0, "metadata"] and "bytes" in error["msg"]


@pytest.mark.parametrize(
    "sampling",
    [{"temperature": 5e-324}, {"temperature": 1e-300}, {"temperature": 1e-7}, {"temperature": 1, "top_p": 5e-324}],
)
def test_a_vanishing_temperature_or_top_p_samples_greedily(
    module_client: TestClient, sampling: dict[str, float]
) -> None:
    body = {"question": QUESTION, **sampling, "stream": False, "max_new_tokens": 3}

    reply = module_client.post("/ask", json=body)
    greedy = module_client.post("/ask", json={**body, "temperature": 0})

    assert reply.status_code == 200, reply.text
    assert reply.json()["answer"] == greedy.json()["answer"]


@pytest.mark.parametrize(
    ("path", "change", "field"),
    [
        ("/ask", {"seed": True}, "seed"),
        ("/ask", {"top_k": "5"}, "top_k"),
        ("/ask", {"stream": 1}, "stream"),
        ("/ask", {"temperature": False}, "temperature"),
        ("/v1/chat/completions", {"max_tokens": True}, "max_tokens"),
        ("/v1/chat/completions", {"stream": "yes"}, "stream"),
    ],
)
def test_a_value_of_another_json_type_is_refused_naming_it(
    module_client: TestClient, path: str, change: dict[str, Any], field: str
) -> None:
    """What the OpenAPI document says is an integer, number or boolean must be one (pydantic would coerce)."""
    base = {"question": QUESTION, "stream": False} if path == "/ask" else OPENAI_BODY

    reply = module_client.post(path, json={**base, **change})

    assert reply.status_code == (422 if path == "/ask" else 400), reply.text
    if path == "/ask":
        assert [error["loc"] for error in reply.json()["detail"]] == [["body", field]]
    else:
        assert reply.json()["error"]["param"] == field
