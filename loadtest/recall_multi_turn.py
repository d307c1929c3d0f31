"""Retrieval in conversations: recall@k of the last question alone, the question after the earlier user turn (what
the service searched before) and the two rankings fused (what it searches now), on a hand-written multi-turn set.

    python -m loadtest.recall_multi_turn              # dense search, as the embedded default
    python -m loadtest.recall_multi_turn --hybrid     # the hybrid search (dense + BM25-style sparse, RRF in Qdrant)
    python -m loadtest.recall_multi_turn --timing     # also the retrieval time of one text and of a conversation's two

The corpus is every distinct passage of `loadtest/qa/real_passages.jsonl` (233 passages of manual pages, Python
docstrings, licences and READMEs, each with its source; several passages per source share its vocabulary). Each
conversation of `loadtest/qa/multi_turn.jsonl` names the sample of that file whose gold passage answers its last
question, and its kind: `switch` (a question on another source than the earlier turns', complete in itself) or
`follow-up` (a question on the earlier turn's subject that names it only there: "and who maintains it now?"). A
conversation is found when the gold passage is among the top k; `source_share` is the share of the top k that come
from the gold passage's source (the issue counted "0 of 5 chunks from the json docs"). The texts searched and the
fusion are the service's own (`service.retrieval.fusion`), with the service's `retrieval_history_turns` default.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.retrieval.batcher import RetrievalBatcher
from service.retrieval.chunker import Chunk
from service.retrieval.collection import ChunkCollection, RetrievedChunk
from service.retrieval.embedder import Embedder
from service.retrieval.fusion import conversation_queries, reciprocal_rank_fusion
from service.settings import Settings

QA = Path(__file__).resolve().parent / "qa"
PASSAGES = QA / "real_passages.jsonl"
CONVERSATIONS = QA / "multi_turn.jsonl"
WAYS = ("last_only", "with_history", "fused")


@dataclass(frozen=True)
class Passage:
    text: str
    source: str


@dataclass(frozen=True)
class Conversation:
    id: str
    kind: str
    earlier: tuple[str, ...]  # the earlier user turns the service embeds with the question
    question: str
    gold: int  # the index of the passage that answers the question


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def load_corpus(passages: Path = PASSAGES) -> tuple[list[Passage], dict[str, int]]:
    """The distinct passages (first met first) and, per sample id, the index of its gold passage."""
    corpus: list[Passage] = []
    where: dict[str, int] = {}
    gold: dict[str, int] = {}
    for sample in read_jsonl(passages):
        for text, source in zip(sample["chunks"], sample["chunk_sources"], strict=True):
            if text not in where:
                where[text] = len(corpus)
                corpus.append(Passage(text, source))
        gold[sample["id"]] = where[sample["chunks"][sample["gold"]]]
    return corpus, gold


def load_conversations(gold: dict[str, int], path: Path = CONVERSATIONS, turns: int = 1) -> list[Conversation]:
    """The conversations, each with its last `turns` earlier user turns (as the service takes them)."""
    conversations = []
    for row in read_jsonl(path):
        users = [m["content"] for m in row["history"] if m["role"] == "user"]
        earlier = tuple(users[-turns:]) if turns else ()
        conversations.append(Conversation(row["id"], row["kind"], earlier, row["question"], gold[row["gold"]]))
    return conversations


Rankings = dict[str, list[list[int]]]  # per way, per conversation: passage indexes, best first


def rankings(search: Callable[[list[str]], list[list[int]]], conversations: Sequence[Conversation], k: int) -> Rankings:
    """Each conversation's top k by the last question alone, by the question after the earlier turns, and fused."""
    queries = [conversation_queries(c.question, c.earlier) for c in conversations]
    alone = search([q[0] for q in queries])
    joined = search([q[-1] for q in queries])  # a conversation without earlier turns searches the question twice
    fused = [_fuse(a, j, k) for a, j in zip(alone, joined, strict=True)]
    return {"last_only": alone, "with_history": joined, "fused": fused}


def _fuse(alone: list[int], joined: list[int], k: int) -> list[int]:
    def hits(order: list[int]) -> list[RetrievedChunk]:
        return [RetrievedChunk(str(i), "", i, 0.0, "", (), "", "", 0, 0) for i in order]

    return [h.index for h in reciprocal_rank_fusion([hits(alone), hits(joined)], k)]


def open_corpus(embedder: Embedder, corpus: Sequence[Passage], hybrid: bool, folder: str) -> ChunkCollection:
    """The corpus in a `ChunkCollection` (embedded Qdrant), one point a passage."""
    collection = ChunkCollection("multi-turn", embedder.dimension, path=folder, hybrid=hybrid)
    texts = [p.text for p in corpus]
    stored = [Chunk(p.source, i, 0, len(p.text), p.text, ()) for i, p in enumerate(corpus)]
    collection.upsert(stored, embedder.embed_documents(texts), version="multi-turn", texts=texts)
    return collection


def collection_search(embedder: Embedder, collection: ChunkCollection, k: int) -> Any:
    """A search function over the collection, as the service searches (batched questions)."""

    def search(questions: list[str]) -> list[list[int]]:
        found = collection.search_many(embedder.embed_queries(questions), [k] * len(questions), questions)
        return [[h.index for h in hits] for hits in found]

    return search


def retrieval_ms(embedder: Embedder, collection: ChunkCollection, conversations: Sequence[Conversation], k: int) -> Any:
    """Median milliseconds of the service's `RetrievalBatcher` for each conversation's question alone and for its two
    texts in one round (the second of two passes: the first warms up)."""
    batcher = RetrievalBatcher(embedder.embed_queries, collection.search_many)
    try:
        for _ in range(2):
            one, two = [], []
            for c in conversations:
                queries = conversation_queries(c.question, c.earlier)
                start = time.perf_counter()
                batcher.retrieve(queries[0], k)
                middle = time.perf_counter()
                batcher.retrieve_many(queries, k)
                one.append(middle - start)
                two.append(time.perf_counter() - middle)
    finally:
        batcher.close()
    median_ms = {"one_text_ms": statistics.median(one), "two_texts_ms": statistics.median(two)}
    return {name: round(seconds * 1e3, 1) for name, seconds in median_ms.items()}


def measure(ranked: Rankings, conversations: Sequence[Conversation], corpus: Sequence[Passage], k: int) -> Any:
    """Per kind (and all): recall@k, MRR@k and the source share of the top k, for each way."""
    report: dict[str, Any] = {}
    for kind in ("switch", "follow-up", "all"):
        picked = [i for i, c in enumerate(conversations) if kind in ("all", c.kind)]
        row: dict[str, Any] = {"conversations": len(picked)}
        for way in WAYS:
            orders = [(ranked[way][i][:k], conversations[i]) for i in picked]
            source = [sum(corpus[p].source == corpus[c.gold].source for p in o) / k for o, c in orders]
            reciprocal = [1 / (o.index(c.gold) + 1) if c.gold in o else 0.0 for o, c in orders]
            row[f"{way}_recall@{k}"] = round(sum(c.gold in o for o, c in orders) / len(picked), 3)
            row[f"{way}_mrr@{k}"] = round(sum(reciprocal) / len(picked), 3)
            row[f"{way}_source_share@{k}"] = round(sum(source) / len(picked), 3)
        report[kind] = row
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=5, help="recall@k (each search's top k, fused to k)")
    parser.add_argument("--hybrid", action="store_true", help="hybrid search (dense + sparse) instead of dense")
    turns = Settings.model_fields["retrieval_history_turns"].default
    parser.add_argument(
        "--turns", type=int, default=turns, help="earlier user turns searched with the question (the setting's default)"
    )
    parser.add_argument("--timing", action="store_true", help="also time retrieval through the service's batcher")
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = parser.parse_args()

    start = time.perf_counter()
    corpus, gold = load_corpus()
    conversations = load_conversations(gold, turns=args.turns)
    embedder = Embedder()
    timing: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as folder:
        collection = open_corpus(embedder, corpus, args.hybrid, folder)
        try:
            ranked = rankings(collection_search(embedder, collection, args.k), conversations, args.k)
            if args.timing:
                timing = retrieval_ms(embedder, collection, conversations, args.k)
        finally:
            collection.close()
    report = {"passages": len(corpus), "search": "hybrid" if args.hybrid else "dense", "turns": args.turns}
    report.update(measure(ranked, conversations, corpus, args.k))
    report.update(timing)
    report["seconds"] = round(time.perf_counter() - start, 1)
    print(json.dumps(report, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
