"""The reranker over a tiny random cross-encoder saved by `save_pretrained`: it reads `candidates` hits (at least
top_k), orders them by `CrossEncoder.predict`'s scores and keeps top_k; bad folders and bounds are refused."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
from sentence_transformers import CrossEncoder

from service.devtools.tiny_cross_encoder import build_tiny_cross_encoder
from service.retrieval.collection import PLAIN_SEARCH, RetrievedChunk, SearchOptions
from service.retrieval.reranker import MAX_CANDIDATES, RerankedSearch, Reranker

QUESTION = "where do otters sleep?"
TEXTS = [f"passage {i}: " + " ".join(["otters", "rivers", "stones", "kelp", "tides"][: 1 + i % 5]) for i in range(12)]


def hit(rank: int) -> RetrievedChunk:
    return RetrievedChunk(
        id=f"c{rank}", doc_id="d", index=rank, score=1.0 - rank / 100, text=TEXTS[rank], token_ids=(1,),
        version="v", kv_key=f"k{rank}", char_start=0, char_end=1,
    )  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_cross_encoder(tmp_path_factory.mktemp("cross-encoder"))


class SearchLog:
    """A search of several texts, each over `TEXTS` in their given order, that records the top_k it was asked for."""

    def __init__(self) -> None:
        self.asked: list[int] = []

    def __call__(self, texts: Sequence[str], top_k: int, options: SearchOptions) -> list[list[RetrievedChunk]]:
        self.asked.append(top_k)
        return [[hit(rank) for rank in range(min(top_k, len(TEXTS)))] for _ in texts]


@pytest.mark.parametrize(("candidates", "top_k"), [(8, 3), (4, 6), (20, 5)])
def test_the_first_candidates_are_reordered_by_the_model(model_dir: Path, candidates: int, top_k: int) -> None:
    search = SearchLog()
    found = RerankedSearch(search, Reranker(model_dir, batch_size=3), candidates)(QUESTION, top_k, PLAIN_SEARCH)
    read = min(max(top_k, candidates), len(TEXTS))
    assert search.asked == [max(top_k, candidates)]
    scores = CrossEncoder(str(model_dir), device="cpu").predict([(QUESTION, t) for t in TEXTS[:read]])
    expected = sorted(range(read), key=lambda i: -float(scores[i]))[:top_k]
    assert [h.index for h in found] == expected
    assert [h.score for h in found] == pytest.approx([float(scores[i]) for i in expected], abs=1e-5)
    assert [h.index for h in found] != list(range(len(found)))  # the model's order is not the search order


def test_no_hits_mean_no_forward(model_dir: Path) -> None:
    assert Reranker(model_dir).rerank(QUESTION, []) == []


def test_bad_folders_and_bounds_are_refused(model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is not a folder"):
        Reranker(tmp_path / "absent")
    with pytest.raises(ValueError, match="cannot be loaded as a sentence-transformers CrossEncoder"):
        Reranker(tmp_path)
    with pytest.raises(ValueError, match="batch_size"):
        Reranker(model_dir, batch_size=0)
    for bad in (0, MAX_CANDIDATES + 1):
        with pytest.raises(ValueError, match="candidates"):
            RerankedSearch(SearchLog(), Reranker(model_dir), bad)


def test_each_ranking_of_a_conversation_is_reordered_by_its_own_text(model_dir: Path) -> None:
    reranker = Reranker(model_dir)
    texts = [QUESTION, f"where do rivers end?\n{QUESTION}"]

    found = RerankedSearch(SearchLog(), reranker, 6).many(texts, 3, PLAIN_SEARCH)

    for text, hits in zip(texts, found, strict=True):
        assert [h.index for h in hits] == [h.index for h in reranker.rerank(text, [hit(r) for r in range(6)])][:3]
    assert [h.index for h in found[0]] != [h.index for h in found[1]]  # the two texts order the candidates apart
