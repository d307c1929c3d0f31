"""Retrieval in a conversation, against the real app (tiny Qwen2, MiniLM, local Qdrant): a follow-up that changes
topic gets the new topic's chunks, one that names its subject only in the earlier turn still gets that subject's.
Each case is set against the one search that fails it, asked through /retrieve: the question with the earlier turn
(what retrieval searched before) for the switch, the question alone for the follow-up."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from api_support import ingest
from app_server import MakeApp, wait_ready
from fastapi.testclient import TestClient

PASSAGES = Path(__file__).resolve().parents[2] / "loadtest" / "qa" / "real_passages.jsonl"
# Documents made of real passages (a man page, a docstring): several passages of one source share its vocabulary.
SOURCES = {
    "curl": ("curl-023", "curl-024", "curl-026", "curl-027"),
    "json": ("py-formats-089", "py-formats-090"),
    "gzip": ("gzip-001", "gzip-003"),
    "ssh": ("ssh-032", "ssh-034"),
}
CURL_TURN = [
    {"role": "user", "content": "How many redirects does curl follow at most with --location?"},
    {"role": "assistant", "content": "50 by default."},
]
TOP_K = 5


def documents() -> list[dict[str, Any]]:
    samples = {s["id"]: s for s in map(json.loads, PASSAGES.read_text().splitlines())}
    gold = {name: [samples[i]["chunks"][samples[i]["gold"]] for i in ids] for name, ids in SOURCES.items()}
    return [{"id": name, "text": "\n\n".join(texts)} for name, texts in gold.items()]


@pytest.fixture(scope="module")
def chat(make_module_app: MakeApp) -> Iterator[TestClient]:
    app = make_module_app(chunk_size=128, chunk_overlap=0, max_document_chars=20_000)
    with TestClient(app) as client:
        wait_ready(app)
        assert ingest(client, documents())["status"] == "done"
        yield client


def ask_chunks(client: TestClient, question: str, history: list[dict[str, str]]) -> list[dict[str, Any]]:
    body = {"question": question, "history": history, "top_k": TOP_K, "stream": False, "max_new_tokens": 1}
    reply = client.post("/ask", json=body)
    assert reply.status_code == 200, reply.text
    chunks: list[dict[str, Any]] = reply.json()["chunks"]
    return chunks


def chat_docs(client: TestClient, messages: list[dict[str, str]]) -> list[str]:
    body = {"messages": messages, "max_tokens": 1, "top_k": TOP_K}
    reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    return [s["doc_id"] for s in reply.json()["kvstitch"]["sources"]]


def retrieved(client: TestClient, text: str) -> list[dict[str, Any]]:
    reply = client.post("/retrieve", json={"question": text, "top_k": TOP_K})
    assert reply.status_code == 200, reply.text
    chunks: list[dict[str, Any]] = reply.json()["chunks"]
    return chunks


def docs(chunks: list[dict[str, Any]]) -> list[str]:
    return [c["doc_id"] for c in chunks]


def test_a_follow_up_on_a_new_topic_retrieves_the_new_topic(chat: TestClient) -> None:
    question = "What does json.dumps do with sort_keys?"
    before = docs(retrieved(chat, f"{CURL_TURN[0]['content']}\n{question}"))  # the turn embedded with the question
    alone = retrieved(chat, question)

    fused = ask_chunks(chat, question, CURL_TURN)
    in_chat = chat_docs(chat, [*CURL_TURN, {"role": "user", "content": question}])

    assert before.count("json") <= 1  # what one search of the joined text found: mostly curl
    assert fused[0]["id"] == alone[0]["id"] and docs(fused).count("json") >= 3  # the question's own best leads
    assert in_chat == docs(fused)  # /v1 searches a conversation the same way


def test_a_follow_up_on_the_same_subject_still_retrieves_it(chat: TestClient) -> None:
    question = "And what is its default?"
    turn = [
        {"role": "user", "content": "What does curl's --speed-time option do?"},
        {"role": "assistant", "content": "It aborts transfers that stay too slow for that long."},
    ]
    alone = retrieved(chat, question)

    fused = ask_chunks(chat, question, turn)
    in_chat = chat_docs(chat, [*turn, {"role": "user", "content": question}])

    assert alone[0]["doc_id"] != "curl" and docs(alone).count("curl") <= 2  # the question alone: any default
    assert fused[0]["doc_id"] == "curl" and "speed-time" in fused[0]["text"] and docs(fused).count("curl") >= 3
    assert in_chat == docs(fused)
