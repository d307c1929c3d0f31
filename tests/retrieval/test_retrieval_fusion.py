"""Reciprocal rank fusion of a conversation's two rankings, and the texts its two searches embed."""

from __future__ import annotations

import pytest

from service.retrieval.collection import RetrievedChunk
from service.retrieval.fusion import RRF_K, conversation_queries, reciprocal_rank_fusion


def hit(name: str, score: float = 0.5) -> RetrievedChunk:
    return RetrievedChunk(
        id=name, doc_id=f"doc-{name}", index=0, score=score, text=name, token_ids=(1,), version="v",
        kv_key=f"k-{name}", char_start=0, char_end=1,
    )  # fmt: skip


def ranking(names: str) -> list[RetrievedChunk]:
    return [hit(n, 1.0 - i / 10) for i, n in enumerate(names)]


def test_a_chunk_both_rankings_hold_rises_above_the_first_of_one() -> None:
    fused = reciprocal_rank_fusion([ranking("abc"), ranking("dcx")], limit=10)

    # c: 1/63 + 1/62 beats a and d (1/61 each), which tie and keep the order met: the first ranking's first.
    assert [h.id for h in fused] == ["c", "a", "d", "b", "x"]
    assert [h.score for h in fused] == pytest.approx(
        [1 / (RRF_K + 3) + 1 / (RRF_K + 2), 1 / (RRF_K + 1), 1 / (RRF_K + 1), 1 / (RRF_K + 2), 1 / (RRF_K + 3)]
    )
    assert fused[0].doc_id == "doc-c" and fused[0].kv_key == "k-c"  # the hit itself, its score replaced


def test_the_constant_decides_whether_agreement_beats_a_first_place() -> None:
    rankings = [ranking("apc"), ranking("bqc")]  # c: third in both; a and b: first in one

    # k = 0: a first place (1/1) outweighs two third places (2/3); the usual k flattens the ranks and agreement
    # wins (2/63 against 1/61).
    assert [h.id for h in reciprocal_rank_fusion(rankings, limit=3, k=0)] == ["a", "b", "c"]
    assert [h.id for h in reciprocal_rank_fusion(rankings, limit=3)] == ["c", "a", "b"]


def test_limit_cuts_and_one_ranking_keeps_its_order() -> None:
    assert [h.id for h in reciprocal_rank_fusion([ranking("abcde")], limit=3)] == ["a", "b", "c"]
    assert reciprocal_rank_fusion([[], []], limit=3) == []
    with pytest.raises(ValueError, match="limit"):
        reciprocal_rank_fusion([ranking("a")], limit=0)


def test_a_conversation_searches_the_question_alone_and_after_its_earlier_user_turns() -> None:
    assert conversation_queries("What about sort_keys?", []) == ("What about sort_keys?",)
    assert conversation_queries("and its second argument?", ["What does curl -o do?", "And -O?"]) == (
        "and its second argument?",
        "What does curl -o do?\nAnd -O?\nand its second argument?",
    )
