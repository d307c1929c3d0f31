"""`/ask` with a conversation (`history`) and `stop`, against the real app (tiny Qwen2, MiniLM, local Qdrant)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from api_support import QUESTION, ask_events, ingest
from app_server import MakeApp, server_of, wait_ready
from fastapi.testclient import TestClient

from service.engine.conversation import Turn

HISTORY = [
    {"role": "system", "content": "Answer in one sentence."},
    {"role": "user", "content": "What is Mauna Loa on Hawaii?"},
    {"role": "assistant", "content": "The largest active volcano."},
]
FOLLOW_UP = "Tell me more about that."


@pytest.fixture(scope="module")
def chat(make_module_app: MakeApp) -> Iterator[TestClient]:
    """One app for the module, the corpus ingested once (every test here only reads)."""
    app = make_module_app(max_history_messages=4, max_history_chars=400)
    with TestClient(app) as client:
        wait_ready(app)
        ingest(client)
        yield client


def ask(client: TestClient, **body: Any) -> dict[str, Any]:
    reply = client.post("/ask", json={"question": QUESTION, "stream": False, "max_new_tokens": 12, **body})
    assert reply.status_code == 200, reply.text
    result: dict[str, Any] = reply.json()
    return result


def pick_stop(text: str) -> tuple[str, str]:
    """A two-character stop string from the middle of `text` and the text before its first occurrence."""
    for at in range(2, len(text) - 2):
        stop = text[at : at + 2]
        if "\ufffd" not in stop and text.find(stop) == at:
            return stop, text[:at]
    raise AssertionError(f"no usable stop string in {text!r}")


def test_history_goes_into_the_prompt(chat: TestClient) -> None:
    alone = ask(chat, top_k=1)
    with_history = ask(chat, top_k=1, history=HISTORY)

    engine = server_of(chat.app).runtime.engine  # what the suffixes must be, built here from the same ids
    turns = [Turn(m["role"], engine.encode_question(m["content"])) for m in HISTORY]
    question = Turn("user", engine.encode_question(QUESTION))
    grown = len(engine.conversation.suffix([*turns, question])) - len(engine.conversation.suffix([question]))

    assert with_history["chunks"][0]["id"] == alone["chunks"][0]["id"]  # same chunk: only the suffix grew
    assert with_history["prompt_tokens"] == alone["prompt_tokens"] + grown and grown > 20
    assert with_history["context_tokens"] == alone["context_tokens"]  # the chunk KV is reused, history prefilled


def test_turbo_and_naive_answer_a_conversation_alike(chat: TestClient) -> None:
    turbo = ask(chat, history=HISTORY, top_k=2)
    naive = ask(chat, history=HISTORY, top_k=2, mode="naive")

    assert turbo["prompt_tokens"] == naive["prompt_tokens"]
    assert turbo["kv"]["miss"] + turbo["kv"]["disk"] + turbo["kv"]["host"] + turbo["kv"]["gpu"] == 2


def test_retrieval_uses_the_user_turn_before_the_question(chat: TestClient) -> None:
    alone = ask(chat, question=FOLLOW_UP, top_k=3)
    followed = ask(chat, question=FOLLOW_UP, top_k=3, history=HISTORY)
    settings = server_of(chat.app).settings  # type: ignore[arg-type]
    settings.retrieval_history_turns = 0
    try:
        ignored = ask(chat, question=FOLLOW_UP, top_k=3, history=HISTORY)
    finally:
        settings.retrieval_history_turns = 1

    def rank(result: dict[str, Any], doc: str) -> int:
        return [c["doc_id"] for c in result["chunks"]].index(doc)

    # The search with the turn ranks "volcano" first; fused with the question's own ranking it stays in the first
    # two (the other first place), above where the vague question alone put it.
    assert rank(alone, "volcano") == 2 and rank(followed, "volcano") <= 1
    assert [c["id"] for c in ignored["chunks"]] == [c["id"] for c in alone["chunks"]]


@pytest.mark.parametrize(
    ("history", "message"),
    [
        ([{"role": "user", "content": "hi"}] * 5, "at most 4 earlier messages"),
        ([{"role": "user", "content": "x" * 401}], "at most 400 characters"),
    ],
)
def test_history_beyond_the_settings_is_a_422_naming_it(chat: TestClient, history: Any, message: str) -> None:
    reply = chat.post("/ask", json={"question": QUESTION, "history": history})

    assert reply.status_code == 422
    assert reply.json()["detail"][0]["loc"] == ["body", "history"] and message in reply.json()["detail"][0]["msg"]


@pytest.mark.parametrize(
    ("change", "loc"),
    [
        ({"history": [{"role": "tool", "content": "x"}]}, ["body", "history", 0, "role"]),
        ({"history": [{"role": "user"}]}, ["body", "history", 0, "content"]),
        ({"history": "hi"}, ["body", "history"]),
        ({"stop": ["a", "b", "c", "d", "e"]}, ["body", "stop"]),
        ({"stop": ""}, ["body", "stop"]),
        ({"stop": ["x" * 257]}, ["body", "stop"]),
    ],
)
def test_malformed_history_or_stop_is_a_422_naming_it(chat: TestClient, change: dict[str, Any], loc: list[Any]) -> None:
    reply = chat.post("/ask", json={"question": QUESTION, **change})

    assert reply.status_code == 422
    assert loc in [e["loc"] for e in reply.json()["detail"]]


def test_stop_cuts_the_answer_before_it(chat: TestClient) -> None:
    free = ask(chat, max_new_tokens=24)
    stop, expected = pick_stop(free["answer"])

    stopped = ask(chat, max_new_tokens=24, stop=[stop, "\u2603never"])

    assert (stopped["answer"], stopped["finish_reason"]) == (expected, "stop")
    events = ask_events(chat, max_new_tokens=24, stop=stop)
    tokens = [data["text"] for name, data in events if name == "token"]
    # Streamed, the text held back while it might begin the stop string is never sent: no partial leak.
    assert "".join(tokens) == expected and events[-1][1]["finish_reason"] == "stop"
