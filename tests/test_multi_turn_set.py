"""The multi-turn retrieval set (`loadtest/qa/multi_turn.jsonl`) stays usable: every conversation names a sample of
the real-passage set, has an earlier user turn and a kind; the script's figures are computed as documented."""

from __future__ import annotations

from loadtest.recall_multi_turn import (
    CONVERSATIONS,
    Conversation,
    Passage,
    load_conversations,
    load_corpus,
    measure,
    rankings,
    read_jsonl,
)


def test_every_conversation_names_a_gold_passage_and_an_earlier_user_turn() -> None:
    corpus, gold = load_corpus()
    rows = read_jsonl(CONVERSATIONS)
    conversations = load_conversations(gold)

    assert len(corpus) == 233 and len(rows) == len(conversations) >= 30
    assert {r["kind"] for r in rows} == {"switch", "follow-up"} and len({r["id"] for r in rows}) == len(rows)
    assert all(c.earlier and c.question not in c.earlier for c in conversations)
    kinds = [c.kind for c in conversations]
    assert kinds.count("switch") >= 12 and kinds.count("follow-up") >= 12


def test_the_three_ways_are_measured_from_the_service_queries_and_fusion() -> None:
    corpus = [Passage("a", "s1"), Passage("b", "s1"), Passage("c", "s2"), Passage("d", "s2")]
    conversations = [Conversation("x", "switch", ("earlier",), "q", 2), Conversation("y", "follow-up", ("e",), "q2", 0)]
    asked: list[list[str]] = []

    def search(texts: list[str]) -> list[list[int]]:
        asked.append(texts)
        return [[0, 1] if "\n" in t else [2, 3] for t in texts]  # with the turn: s1's passages; alone: s2's

    ranked = rankings(search, conversations, 2)
    report = measure(ranked, conversations, corpus, 2)

    assert asked == [["q", "q2"], ["earlier\nq", "e\nq2"]]
    assert ranked["fused"] == [[2, 0], [2, 0]]  # the question alone's first, then the other's first (a tie)
    assert report["switch"]["last_only_recall@2"] == 1.0 and report["switch"]["with_history_recall@2"] == 0.0
    assert report["follow-up"]["fused_mrr@2"] == 0.5 and report["all"]["fused_recall@2"] == 1.0
    assert report["switch"]["with_history_source_share@2"] == 0.0 and report["all"]["fused_source_share@2"] == 0.5
