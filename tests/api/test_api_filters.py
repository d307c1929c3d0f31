"""Metadata filters, `POST /retrieve` and sources that carry their document's metadata, through the real app (tiny
Qwen2, MiniLM, embedded Qdrant; with Redis for the index, queue and job status where the `client` fixture says)."""

from __future__ import annotations

import datetime
from typing import Any

import httpx
import pytest
from api_support import ingest
from fastapi.testclient import TestClient

CORPUS = [
    {
        "id": "otters",
        "text": "Sea otters hold hands while they sleep so they do not drift apart.",
        "metadata": {
            "lang": "en",
            "year": 2021,
            "url": "https://example.org/otters",
            "title": "Otters",
            "published": "2024-05-01T00:00:00Z",
        },
    },
    {
        "id": "volcano",
        "text": "Mauna Loa on Hawaii is the largest active volcano on Earth by volume.",
        "metadata": {"lang": "en", "year": 2019, "published": "2019-03-01T00:00:00Z"},
    },
    {
        "id": "bread",
        "text": "Sourdough rises because wild yeast and bacteria ferment the flour.",
        "metadata": {"lang": "fr", "year": 2024, "tags": ["food", "baking"]},
    },
]
METADATA = {d["id"]: d["metadata"] for d in CORPUS}
QUESTION = "Why do sea otters hold hands?"


def retrieved(client: httpx.Client, search_filter: dict[str, Any] | None, **extra: Any) -> list[str]:
    body = {"question": QUESTION, "top_k": 10, **extra}
    if search_filter is not None:
        body["filter"] = search_filter
    reply = client.post("/retrieve", json=body)
    assert reply.status_code == 200, reply.text
    return sorted({c["doc_id"] for c in reply.json()["chunks"]})


def iso(when: datetime.datetime) -> str:
    return when.isoformat()


def test_retrieve_returns_the_chunks_a_filter_matches(client: TestClient) -> None:
    assert ingest(client, CORPUS)["status"] == "done"
    before = datetime.datetime.now(datetime.UTC) - datetime.timedelta(hours=1)
    after = datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=1)
    cases: list[tuple[dict[str, Any] | None, list[str]]] = [
        (None, ["bread", "otters", "volcano"]),
        ({"must": [{"key": "lang", "match": "en"}]}, ["otters", "volcano"]),
        ({"must_not": [{"key": "lang", "match": "en"}]}, ["bread"]),
        ({"must": [{"key": "doc_id", "any": ["bread", "volcano"]}]}, ["bread", "volcano"]),
        ({"must": [{"key": "doc_id", "match": "otters"}]}, ["otters"]),
        ({"must": [{"key": "year", "range": {"gte": 2020}}]}, ["bread", "otters"]),
        ({"must": [{"key": "year", "range": {"gt": 2019, "lt": 2024}}]}, ["otters"]),
        ({"must": [{"key": "published", "range": {"gte": "2024-01-01"}}]}, ["otters"]),
        ({"should": [{"key": "lang", "match": "fr"}, {"key": "year", "range": {"lt": 2020}}]}, ["bread", "volcano"]),
        ({"must": [{"key": "tags", "match": "baking"}]}, ["bread"]),
        ({"must": [{"key": "lang", "match": "en"}, {"must_not": [{"key": "year", "match": 2019}]}]}, ["otters"]),
        (
            {"must": [{"key": "ingested_at", "range": {"gte": iso(before), "lte": iso(after)}}]},
            ["bread", "otters", "volcano"],
        ),
        ({"must": [{"key": "ingested_at", "range": {"gte": after.timestamp()}}]}, []),
    ]
    for search_filter, expected in cases:
        assert retrieved(client, search_filter) == expected, search_filter
        assert retrieved(client, search_filter, hybrid=False) == expected, search_filter
        assert retrieved(client, search_filter, hybrid=True) == expected, search_filter


def test_retrieve_returns_ranked_chunks_with_their_documents_metadata(client: TestClient) -> None:
    assert ingest(client, CORPUS)["status"] == "done"
    reply = client.post("/retrieve", json={"question": QUESTION, "top_k": 2})
    assert reply.status_code == 200, reply.text
    chunks = reply.json()["chunks"]
    assert len(chunks) == 2 and "note" not in reply.json()
    assert chunks[0]["doc_id"] == "otters"  # the question's own words
    assert chunks[0]["score"] >= chunks[1]["score"]
    assert chunks[0]["text"] == CORPUS[0]["text"]
    for chunk in chunks:
        assert chunk["metadata"] == METADATA[chunk["doc_id"]]
    nothing = client.post(
        "/retrieve", json={"question": QUESTION, "filter": {"must": [{"key": "lang", "match": "de"}]}}
    )
    assert nothing.json() == {"chunks": [], "note": "no chunk matches the filter"}


def test_ask_and_chat_completions_read_only_the_filtered_chunks(client: TestClient) -> None:
    assert ingest(client, CORPUS)["status"] == "done"
    french = {"must": [{"key": "lang", "match": "fr"}]}
    answer = client.post("/ask", json={"question": QUESTION, "stream": False, "max_new_tokens": 2, "filter": french})
    assert answer.status_code == 200, answer.text
    assert [c["doc_id"] for c in answer.json()["chunks"]] == ["bread"]
    assert answer.json()["chunks"][0]["metadata"] == METADATA["bread"]
    assert "note" not in answer.json()

    none = {"must": [{"key": "year", "range": {"gt": 3000}}]}
    empty = client.post("/ask", json={"question": QUESTION, "stream": False, "max_new_tokens": 2, "filter": none})
    assert empty.status_code == 200, empty.text
    assert empty.json()["chunks"] == []
    assert empty.json()["note"] == "no chunk matches the filter: the answer has no sources"

    with client.stream("POST", "/ask", json={"question": QUESTION, "max_new_tokens": 2, "filter": none}) as reply:
        text = reply.read().decode()
    assert '"chunks": [], "dropped": 0, "note": "no chunk matches the filter: the answer has no sources"' in text
    assert text.count("no chunk matches the filter") == 2  # in retrieval and in done

    chat = {"model": client.get("/v1/models").json()["data"][0]["id"], "max_tokens": 2}
    messages = [{"role": "user", "content": QUESTION}]
    completion = client.post("/v1/chat/completions", json={**chat, "messages": messages, "filter": french})
    assert completion.status_code == 200, completion.text
    sources = completion.json()["kvstitch"]["sources"]
    assert [(s["doc_id"], s["metadata"]) for s in sources] == [("bread", METADATA["bread"])]
    unmatched = client.post("/v1/chat/completions", json={**chat, "messages": messages, "filter": none})
    assert unmatched.json()["kvstitch"]["sources"] == []
    assert unmatched.json()["kvstitch"]["note"] == "no chunk matches the filter: the answer has no sources"


def test_every_source_of_an_answer_carries_its_documents_metadata(client: TestClient) -> None:
    assert ingest(client, CORPUS)["status"] == "done"
    answer = client.post("/ask", json={"question": QUESTION, "stream": False, "max_new_tokens": 2, "top_k": 3})
    chunks = answer.json()["chunks"]
    assert sorted(c["doc_id"] for c in chunks) == ["bread", "otters", "volcano"]
    assert {c["doc_id"]: c["metadata"] for c in chunks} == METADATA


WRONG: list[tuple[Any, str]] = [
    ({"must": [{"key": "lang"}]}, "filter.must[0]: give exactly one of match, any, range"),
    ({"must": [{"key": "year", "range": {"gte": "last year"}}]}, "filter.must[0].range.gte: a number or an ISO"),
    ({"should": [{"key": "a", "match": i} for i in range(33)]}, "filter.should[32]: at most 32 conditions"),
    ({"must": [{"key": "$where", "match": 1}]}, "filter.must[0].key: 1 to 64 letters"),
    ([{"key": "lang", "match": "en"}], "Input should be a valid dictionary"),
]


@pytest.mark.parametrize(("search_filter", "message"), WRONG)
def test_a_wrong_filter_is_refused_naming_filter(module_client: TestClient, search_filter: Any, message: str) -> None:
    for path in ("/retrieve", "/ask"):
        reply = module_client.post(path, json={"question": QUESTION, "filter": search_filter})
        assert reply.status_code == 422, reply.text
        (error,) = reply.json()["detail"]
        assert error["loc"] == ["body", "filter"], error
        assert message in error["msg"]
    model = module_client.get("/v1/models").json()["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": QUESTION}], "filter": search_filter}
    reply = module_client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 400, reply.text  # /v1 answers value errors as OpenAI does
    assert reply.json()["error"]["param"] == "filter" and message in reply.json()["error"]["message"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"question": " "}, "question"),
        ({"question": "x" * 501}, "question"),
        ({"question": QUESTION, "top_k": 51}, "top_k"),
        ({"question": QUESTION, "hybrid": "yes"}, "hybrid"),
        ({"question": QUESTION, "topk": 3}, "topk"),
    ],
)
def test_retrieve_is_bounded_like_ask(module_client: TestClient, body: dict[str, Any], field: str) -> None:
    reply = module_client.post("/retrieve", json=body)
    assert reply.status_code == 422, reply.text
    assert reply.json()["detail"][0]["loc"][-1] == field


def test_retrieve_is_behind_the_api_key(make_app: Any) -> None:
    from app_server import wait_ready

    app = make_app(api_key="retrieve-key-0123", redis_url=None)
    with TestClient(app) as client:
        wait_ready(app)
        assert client.post("/retrieve", json={"question": QUESTION}).status_code == 401
        headers = {"Authorization": "Bearer retrieve-key-0123"}
        assert client.post("/retrieve", json={"question": QUESTION}, headers=headers).json() == {"chunks": []}
