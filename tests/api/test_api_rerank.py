"""Optional reranking through the real app (tiny Qwen2, MiniLM, embedded Qdrant) with a tiny random cross-encoder
saved by `save_pretrained`: the expected order is computed here by `CrossEncoder.predict` itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from api_support import ingest
from app_server import MakeApp, server_of, wait_ready
from fastapi.testclient import TestClient
from sentence_transformers import CrossEncoder

from service.devtools.tiny_cross_encoder import build_tiny_cross_encoder
from service.retrieval.embedder import Embedder

QUESTION = "Which animal holds hands, and which mountain is a volcano?"
FACTS = [
    ("otters", "en", "Sea otters hold hands while they sleep so they do not drift apart."),
    ("volcano", "en", "Mauna Loa on Hawaii is the largest active volcano on Earth by volume."),
    ("bread", "fr", "Sourdough rises because wild yeast and bacteria ferment the flour."),
    ("tides", "en", "The Moon's pull raises the tides twice a day along most coasts."),
    ("bees", "fr", "Honey bees dance to tell the hive where the flowers are."),
    ("ice", "en", "Antarctica holds about seventy percent of the world's fresh water as ice."),
]
CORPUS = [{"id": doc, "text": text, "metadata": {"lang": lang}} for doc, lang, text in FACTS]


@pytest.fixture(scope="module")
def cross_encoder_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_cross_encoder(tmp_path_factory.mktemp("cross-encoder"))


def retrieve(client: TestClient, top_k: int, **extra: Any) -> list[dict[str, Any]]:
    reply = client.post("/retrieve", json={"question": QUESTION, "top_k": top_k, **extra})
    assert reply.status_code == 200, reply.text
    chunks: list[dict[str, Any]] = reply.json()["chunks"]
    return chunks


def predicted_order(model_dir: Path, texts: list[str]) -> tuple[list[str], list[float]]:
    """The texts ordered by the cross-encoder's own scores, best first, and those scores."""
    scores = [float(s) for s in CrossEncoder(str(model_dir), device="cpu").predict([(QUESTION, t) for t in texts])]
    ranked = sorted(zip(scores, texts, strict=True), key=lambda pair: -pair[0])
    return [t for _, t in ranked], [s for s, _ in ranked]


def test_retrieve_and_ask_return_the_reranker_order(make_app: MakeApp, cross_encoder_dir: Path) -> None:
    app = make_app(rerank_model=str(cross_encoder_dir), rerank_candidates=20)
    with TestClient(app) as client:
        wait_ready(app)
        assert ingest(client, CORPUS)["status"] == "done"
        every = retrieve(client, top_k=len(FACTS), hybrid=False)
        assert len(every) == len(FACTS)
        doc_of = {c["text"]: c["doc_id"] for c in every}
        expected, scores = predicted_order(cross_encoder_dir, [c["text"] for c in every])
        assert [c["text"] for c in every] == expected
        assert [c["score"] for c in every] == pytest.approx(scores, abs=1e-5)
        # Fewer than the candidates: the reranker still reads all of them and the best two come back.
        assert [c["text"] for c in retrieve(client, top_k=2, hybrid=False)] == expected[:2]
        assert [c["text"] for c in retrieve(client, top_k=len(FACTS), hybrid=True)] == expected

        english = {"must": [{"key": "lang", "match": "en"}]}
        filtered = [c["text"] for c in retrieve(client, top_k=len(FACTS), filter=english)]
        assert filtered == [t for t in expected if t in {text for _, lang, text in FACTS if lang == "en"}]

        body = {"question": QUESTION, "stream": False, "max_new_tokens": 2, "top_k": 3}
        answer = client.post("/ask", json=body)
        assert answer.status_code == 200, answer.text
        assert [c["text"] for c in answer.json()["chunks"]] == expected[:3]

        chat = {"model": client.get("/v1/models").json()["data"][0]["id"], "max_tokens": 2, "top_k": 3}
        messages = [{"role": "user", "content": QUESTION}]
        completion = client.post("/v1/chat/completions", json={**chat, "messages": messages})
        assert completion.status_code == 200, completion.text
        assert [s["doc_id"] for s in completion.json()["kvstitch"]["sources"]] == [doc_of[t] for t in expected[:3]]


def test_without_a_reranker_the_order_is_the_retrieval_order(
    make_app: MakeApp, api_embedder: Embedder, cross_encoder_dir: Path
) -> None:
    app = make_app()
    with TestClient(app) as client:
        wait_ready(app)
        assert ingest(client, CORPUS)["status"] == "done"
        chunks = retrieve(client, top_k=len(FACTS), hybrid=False)
    texts = [c["text"] for c in chunks]
    question = api_embedder.embed_query(QUESTION)
    cosine = [sum(a * b for a, b in zip(question, v, strict=True)) for v in api_embedder.embed_documents(texts)]
    assert texts == [t for _, t in sorted(zip(cosine, texts, strict=True), key=lambda pair: -pair[0])]
    assert [c["score"] for c in chunks] == pytest.approx(cosine, abs=1e-4)
    # The random cross-encoder orders these chunks otherwise, so the reranked test above can tell the two apart.
    assert predicted_order(cross_encoder_dir, texts)[0] != texts


@pytest.mark.parametrize("bad", ["missing-folder", "empty-folder"])
def test_a_rerank_model_that_does_not_load_stops_start_up(make_app: MakeApp, tmp_path: Path, bad: str) -> None:
    folder = tmp_path / bad
    if bad == "empty-folder":
        folder.mkdir()
    app = make_app(rerank_model=str(folder))
    with TestClient(app) as client:
        server = server_of(app)
        assert server.started.wait(120)
        assert not server.ready
        assert "rerank model" in (server.startup_error or "")
        assert str(folder) in (server.startup_error or "")
        assert "KVSTITCH_RERANK_MODEL" in (server.startup_error or "")
        assert client.get("/readyz").status_code == 503


def test_rerank_candidates_are_bounded(make_app: MakeApp) -> None:
    for bad in (0, 201):
        with pytest.raises(ValueError, match="rerank_candidates"):
            make_app(rerank_candidates=bad)
