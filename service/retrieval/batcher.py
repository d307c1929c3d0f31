"""Retrieval for many concurrent questions: one embedding batch and one Qdrant batch query per round.

Each request thread calls `retrieve(text, top_k)` (or `retrieve_many` for a conversation's two searches) and
blocks. One retrieval thread takes every question waiting at that moment, embeds them in one batch and searches
them in one batched query, then wakes each caller with its hits. Nothing waits for a batch to fill: a lone question
goes at once (no added latency at one client), and under load the questions that arrive while a round runs form
the next round. Retrieval never runs on the engine loop, so it overlaps the GPU's work.

With `rounds` > 1 (one per question-embedder child, `QueryEmbedPool`) as many retrieval threads each take a round:
while one searches Qdrant for its round, another's questions are embedded, and rounds embed side by side.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from service.errors import UnavailableError
from service.retrieval.collection import PLAIN_SEARCH, RetrievedChunk, SearchOptions

DEFAULT_MAX_BATCH = 64
MAX_ROUNDS = 8

EmbedMany = Callable[[Sequence[str]], list[list[float]]]
# (question vectors, top_k of each, question texts[, search options of each]) → hits of each; the texts make the
# sparse half of hybrid search; the options (a filter, hybrid on/off) are passed only when a question has some.
SearchMany = Callable[..., list[list[RetrievedChunk]]]


@dataclass
class _Pending:
    text: str
    top_k: int
    options: SearchOptions
    result: concurrent.futures.Future[list[RetrievedChunk]] = field(default_factory=concurrent.futures.Future)
    queued_at: float = field(default_factory=time.perf_counter)


@dataclass(frozen=True)
class RetrievalStats:
    """What the batcher did since start. The seconds are per question and add up to its time in `retrieve`: `wait`
    from the call to its round's start (the round before it still running), `embed` and `search` its round's
    (every question of a round counts the whole round: it waited for all of it). Divided by `questions`, each is
    the mean a question spent there; `questions / rounds` is the mean round size."""

    questions: int = 0
    rounds: int = 0
    wait_s: float = 0.0
    embed_s: float = 0.0
    search_s: float = 0.0

    def seconds(self) -> dict[str, float]:
        return {"wait": self.wait_s, "embed": self.embed_s, "search": self.search_s}


class RetrievalBatcher:
    """Batches concurrent `retrieve` calls; `rounds`, `largest_round` and `stats()` tell what it did (tests,
    metrics)."""

    def __init__(
        self, embed: EmbedMany, search: SearchMany, max_batch: int = DEFAULT_MAX_BATCH, rounds: int = 1
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be positive, got {max_batch}")
        if not 1 <= rounds <= MAX_ROUNDS:
            raise ValueError(f"rounds must be 1 to {MAX_ROUNDS}, got {rounds}")
        self._embed = embed
        self._search = search
        self.max_batch = max_batch
        # One item per caller: a caller's questions are queued together, so they always share a round.
        self._waiting: queue.Queue[list[_Pending] | None] = queue.Queue()
        self.rounds = 0
        self.largest_round = 0
        self._counting = threading.Lock()  # rounds end on several threads
        self._stats = RetrievalStats()  # replaced whole after each round, so a reader never sees half an update
        names = ["retrieval"] if rounds == 1 else [f"retrieval-{i}" for i in range(rounds)]
        self._threads = [threading.Thread(target=self._run, name=name, daemon=True) for name in names]
        for thread in self._threads:
            thread.start()

    def retrieve(self, text: str, top_k: int, options: SearchOptions = PLAIN_SEARCH) -> list[RetrievedChunk]:
        """The top-k chunks for one question (blocks; errors of the embedder or Qdrant are raised here)."""
        return self.retrieve_many([text], top_k, options)[0]

    def retrieve_many(
        self, texts: Sequence[str], top_k: int, options: SearchOptions = PLAIN_SEARCH
    ) -> list[list[RetrievedChunk]]:
        """The top-k chunks for each text, searched in one round (one embedding batch, one Qdrant call)."""
        group = [_Pending(text, top_k, options) for text in texts]
        self._waiting.put(group)
        return [pending.result.result() for pending in group]

    def stats(self) -> RetrievalStats:
        return self._stats

    def close(self) -> None:
        """Each thread ends at a None of its own, after the questions queued before it."""
        for _ in self._threads:
            self._waiting.put(None)
        for thread in self._threads:
            thread.join(timeout=10)

    def _run(self) -> None:
        while (first := self._waiting.get()) is not None:
            batch = list(first)
            closing = False
            while len(batch) < self.max_batch:  # a group may take a round past max_batch by one question
                try:
                    more = self._waiting.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    closing = True
                    break
                batch.extend(more)
            self._round(batch)
            if closing:
                return

    def _round(self, batch: list[_Pending]) -> None:
        with self._counting:
            self.rounds += 1
            self.largest_round = max(self.largest_round, len(batch))
        began = time.perf_counter()
        try:
            texts = [p.text for p in batch]
            vectors = self._embed(texts)
            embedded = time.perf_counter()
            hits = self._searched(vectors, [p.top_k for p in batch], texts, [p.options for p in batch])
        except BaseException as err:  # every caller of this round learns why (a failed round is not counted)
            for pending in batch:
                pending.result.set_exception(err)
            return
        self._count(batch, began, embedded, time.perf_counter())
        for pending, found in zip(batch, hits, strict=True):
            pending.result.set_result(found)

    def _count(self, batch: list[_Pending], began: float, embedded: float, searched: float) -> None:
        n = len(batch)
        with self._counting:
            stats = self._stats
            self._stats = replace(
                stats,
                questions=stats.questions + n,
                rounds=stats.rounds + 1,
                wait_s=stats.wait_s + sum(began - p.queued_at for p in batch),
                embed_s=stats.embed_s + n * (embedded - began),
                search_s=stats.search_s + n * (searched - embedded),
            )

    def _searched(
        self, vectors: list[list[float]], top_ks: list[int], texts: list[str], options: list[SearchOptions]
    ) -> list[list[RetrievedChunk]]:
        try:
            if all(o == PLAIN_SEARCH for o in options):
                return self._search(vectors, top_ks, texts)
            return self._search(vectors, top_ks, texts, options)
        except Exception as err:  # qdrant-client raises transport-specific errors; all mean "unreachable" here
            raise UnavailableError("Qdrant", err) from err
