"""Concurrent questions share one embedding batch and one batched Qdrant query; each caller gets its own hits."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import pytest

from service.errors import UnavailableError
from service.retrieval.batcher import RetrievalBatcher
from service.retrieval.collection import RetrievedChunk


def chunk(text: str, rank: int) -> RetrievedChunk:
    return RetrievedChunk(
        id=f"{text}-{rank}",
        doc_id=text,
        index=rank,
        score=1.0 / (rank + 1),
        text=text,
        token_ids=(1, 2),
        version="v",
        kv_key="k",
        char_start=0,
        char_end=len(text),
    )


class SlowBackend:
    """Embeds a text as [len(text)]; the first round blocks until released, so later questions pile up."""

    def __init__(self) -> None:
        self.embed_batches: list[list[str]] = []
        self.search_batches: list[list[int]] = []
        self.search_texts: list[list[str]] = []
        self.release = threading.Event()

    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        self.embed_batches.append(list(texts))
        if len(self.embed_batches) == 1:
            assert self.release.wait(10)
        return [[float(len(t))] for t in texts]

    def search(
        self, vectors: Sequence[Sequence[float]], top_ks: Sequence[int], texts: Sequence[str]
    ) -> list[list[RetrievedChunk]]:
        self.search_batches.append(list(top_ks))
        self.search_texts.append(list(texts))
        return [[chunk(f"len{int(v[0])}", r) for r in range(k)] for v, k in zip(vectors, top_ks, strict=True)]


def test_questions_arriving_during_a_round_go_together_in_the_next() -> None:
    backend = SlowBackend()
    batcher = RetrievalBatcher(backend.embed, backend.search)
    results: dict[str, list[RetrievedChunk]] = {}

    def ask(text: str, k: int) -> None:
        results[text] = batcher.retrieve(text, k)

    first = threading.Thread(target=ask, args=("a", 1))
    first.start()
    while not backend.embed_batches:  # the first round is running (and blocked)
        pass
    others = [threading.Thread(target=ask, args=("b" * n, n)) for n in range(2, 7)]
    for thread in others:
        thread.start()
    while batcher._waiting.qsize() < len(others):
        pass
    backend.release.set()
    for thread in [first, *others]:
        thread.join(10)
    batcher.close()

    assert backend.embed_batches[0] == ["a"]
    assert sorted(backend.embed_batches[1]) == sorted("b" * n for n in range(2, 7))  # one round for all five
    assert batcher.rounds == 2 and batcher.largest_round == 5
    assert backend.search_texts == backend.embed_batches  # each question's text goes to the (hybrid) search
    for n in range(2, 7):
        assert [c.id for c in results["b" * n]] == [f"len{n}-{r}" for r in range(n)]  # each its own hits
    assert [c.id for c in results["a"]] == ["len1-0"]


def test_a_search_failure_reaches_every_caller_as_qdrant_unavailable() -> None:
    def down(
        vectors: Sequence[Sequence[float]], top_ks: Sequence[int], texts: Sequence[str]
    ) -> list[list[RetrievedChunk]]:
        raise ConnectionRefusedError("connection refused")

    batcher = RetrievalBatcher(lambda texts: [[1.0] for _ in texts], down)
    with pytest.raises(UnavailableError, match="Qdrant is unreachable"):
        batcher.retrieve("q", 3)
    batcher.close()


def test_stats_split_each_questions_time_into_wait_embed_and_search() -> None:
    """Round 1 ("a") embeds for ~0.2 s while five questions queue behind it; round 2 (the five) searches for ~0.1 s.
    Per question: "a" waited ~0 and embedded ~0.2; each of the five waited ~0.2 (round 1) and searched ~0.1."""
    backend = SlowBackend()

    def search(
        vectors: Sequence[Sequence[float]], top_ks: Sequence[int], texts: Sequence[str]
    ) -> list[list[RetrievedChunk]]:
        if len(vectors) > 1:
            time.sleep(0.1)
        return backend.search(vectors, top_ks, texts)

    batcher = RetrievalBatcher(backend.embed, search)
    first = threading.Thread(target=batcher.retrieve, args=("a", 1))
    first.start()
    while not backend.embed_batches:
        pass
    others = [threading.Thread(target=batcher.retrieve, args=("b" * n, 1)) for n in range(2, 7)]
    for thread in others:
        thread.start()
    while batcher._waiting.qsize() < len(others):
        pass
    time.sleep(0.2)
    backend.release.set()
    for thread in [first, *others]:
        thread.join(10)
    batcher.close()

    stats = batcher.stats()
    assert (stats.questions, stats.rounds) == (6, 2)
    assert 0.2 <= stats.embed_s < 0.2 + 0.15  # "a"'s blocked embedding, counted once (its round held one question)
    assert 5 * 0.1 <= stats.search_s < 5 * 0.1 + 0.15  # the five's search, counted for each of them
    assert 5 * 0.2 <= stats.wait_s < 5 * 0.2 + 0.5  # the five waited for round 1; "a" waited for nothing
    assert stats.seconds() == {"wait": stats.wait_s, "embed": stats.embed_s, "search": stats.search_s}


def test_a_conversations_texts_share_one_round_and_each_gets_its_own_hits() -> None:
    backend = SlowBackend()
    backend.release.set()
    batcher = RetrievalBatcher(backend.embed, backend.search, max_batch=1)  # one caller's group is never split

    found = batcher.retrieve_many(["q", "earlier\nq"], 2)
    batcher.close()

    assert backend.embed_batches == [["q", "earlier\nq"]] and batcher.rounds == 1
    assert [[c.id for c in hits] for hits in found] == [["len1-0", "len1-1"], ["len9-0", "len9-1"]]


def test_with_two_rounds_a_round_runs_while_another_is_still_embedding() -> None:
    """Round 1 ("a") blocks in its embedding; with `rounds=2` a question asked meanwhile gets its hits from the
    second thread before round 1 is released, and the stats count both rounds once each."""
    backend = SlowBackend()
    batcher = RetrievalBatcher(backend.embed, backend.search, rounds=2)
    results: dict[str, list[RetrievedChunk]] = {}

    def ask(text: str, k: int) -> None:
        results[text] = batcher.retrieve(text, k)

    first = threading.Thread(target=ask, args=("a", 1))
    first.start()
    while not backend.embed_batches:
        pass
    second = threading.Thread(target=ask, args=("bb", 2))
    second.start()
    second.join(10)

    assert not second.is_alive() and first.is_alive()  # answered while round 1 is held
    assert [c.id for c in results["bb"]] == ["len2-0", "len2-1"]
    backend.release.set()
    first.join(10)
    batcher.close()

    assert [c.id for c in results["a"]] == ["len1-0"]
    assert backend.embed_batches == [["a"], ["bb"]]
    assert (batcher.rounds, batcher.stats().rounds, batcher.stats().questions) == (2, 2, 2)
    assert not any(t.is_alive() for t in batcher._threads)  # close ended both threads
    assert [t.name for t in batcher._threads] == ["retrieval-0", "retrieval-1"]


def test_the_rounds_in_flight_are_bounded() -> None:
    backend = SlowBackend()
    for wrong in (0, 9):
        with pytest.raises(ValueError, match=f"rounds must be 1 to 8, got {wrong}"):
            RetrievalBatcher(backend.embed, backend.search, rounds=wrong)
