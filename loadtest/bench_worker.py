"""Ingest worker throughput: chunks per second and KV-precompute tokens per second.

    python -m loadtest.bench_worker --model DIR --device cpu --docs 200 --runs 3
    python -m loadtest.bench_worker --precompute-only --shape qwen2-7b --device cuda --docs 100 --runs 3

Full mode runs the real `Ingestor` of `open_runtime` (embedded form: SQLite KV index, embedded Qdrant, the
bundled MiniLM) on a fresh data dir in a temp folder per run, one job of --docs generated documents of distinct
sentences, and reports the job's own stage times (`IngestCounts.seconds`): chunk, precompute (the batched forward
*and* `KVStore.put`, as the ingestor times them), embed, upsert, plus the end-to-end wall time, whose remainder
is Qdrant reads and deletes per document. One untimed warm-up job runs first on its own data dir.

`--precompute-only` measures the GPU part alone: the same documents chunked by the same `Chunker`, the distinct
chunk blocks grouped by `precompute_batches` into batches of at most --max-tokens padded tokens, each batch's
forward and its `KVStore.put` (file write, fsync, rename, SQLite index) to a disk cache dir, timed apart. It
imports the engine, the KV cache, the chunker (transformers only) and `service.kvcache.precompute`, never Qdrant,
sentence-transformers or pydantic, so it runs on the GPU machine. `--shape qwen2-7b` builds a Qwen2-7B-shaped
model with random bf16 weights on CUDA, as `loadtest.bench_prefill` does (its tiny BPE tokenizer stands in).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from loadtest.bench_prefill import build_engine
from service.engine.engine import StitchEngine
from service.engine.kv_layout import TokenIds
from service.jobs.documents import Document, IngestJob
from service.kvcache import device
from service.kvcache.index import SqliteIndex
from service.kvcache.precompute import precompute_and_store, precompute_batches
from service.kvcache.store import KVStore, TierBudgets
from service.retrieval.chunker import Chunker, ChunkerConfig
from service.serving.kv_source import kv_store_for

log = logging.getLogger("bench_worker")
MAX_DOCUMENT_CHARS = 2_000_000
STAGES = ("chunk", "precompute", "embed", "upsert")


# ---- the corpus ----------------------------------------------------------------------------------------------

SUBJECTS = ("The harbour master", "A field botanist", "The night ferry", "Our archivist", "The survey team", "A baker")
VERBS = ("recorded", "counted", "catalogued", "repaired", "photographed", "described", "measured", "sorted")
OBJECTS = ("storm petrels", "copper kettles", "tide pools", "signal flags", "seed packets", "lantern wicks", "maps")
PLACES = ("near the north pier", "behind the old mill", "on the salt marsh", "in the east wing", "along the canal")


def corpus(documents: int, paragraphs: int, sentences: int, seed: int = 0) -> list[Document]:
    """Documents of distinct sentences (each names its document, paragraph and sentence): no chunk repeats."""
    rng = random.Random(seed)
    docs = []
    for d in range(documents):
        body = [
            " ".join(
                f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.randint(2, 9999)} {rng.choice(OBJECTS)} "
                f"{rng.choice(PLACES)}, entry {d}.{p}.{s}."
                for s in range(sentences)
            )
            for p in range(paragraphs)
        ]
        docs.append(Document(f"bench-{seed}-{d:05d}.txt", "\n\n".join(body), {"n": d}))
    return docs


# ---- full mode -------------------------------------------------------------------------------------------------


def run_full(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Median-able rows of the real ingest path, one per run."""
    from service.retrieval.embedder import Embedder
    from service.serving.runtime import open_engine, open_runtime
    from service.settings import Settings

    def settings(data_dir: Path) -> Settings:
        return Settings(
            model=args.model,
            device=args.device,
            data_dir=data_dir,
            redis_url=None,
            qdrant_url=None,
            chunk_size=args.chunk_size,
            chunk_overlap=args.chunk_overlap,
            max_precompute_tokens=args.max_tokens,
            gpu_cache_mb=0,
            host_cache_mb=0,
            disk_cache_mb=args.disk_cache_mb,
        )

    with tempfile.TemporaryDirectory(prefix="bench-worker-") as tmp:
        root = Path(tmp)
        engine = open_engine(settings(root / "unused"))
        embedder = Embedder(device=args.embedding_device)
        rows = []
        for run in range(-1, args.runs):  # run -1: the warm-up job
            docs = corpus(2 if run < 0 else args.docs, args.paragraphs, args.sentences, seed=0 if run < 0 else 1)
            with open_runtime(settings(root / f"run{run + 1}"), engine=engine, embedder=embedder) as runtime:
                ingestor = runtime.ingestor()
                start = time.perf_counter()
                counts = ingestor.ingest(IngestJob(f"bench-{run + 1}", tuple(docs)))
                wall = time.perf_counter() - start
            if run < 0:
                continue
            row: dict[str, Any] = {
                "documents": counts.documents_done,
                "chunks": counts.chunks,
                "tokens_precomputed": counts.tokens_precomputed,
                "wall_s": wall,
                **{f"{stage}_s": counts.seconds.get(stage, 0.0) for stage in STAGES},
            }
            row["other_s"] = wall - sum(row[f"{stage}_s"] for stage in STAGES)
            row["chunks_per_s"] = counts.chunks / wall
            row["precompute_tokens_per_s"] = counts.tokens_precomputed / row["precompute_s"]
            log.info("run %d: %s", run + 1, json.dumps(row))
            rows.append(row)
    return rows


def full_table(rows: list[dict[str, Any]]) -> str:
    m = medians(rows)
    stages = " | ".join(f"{m[f'{stage}_s']:.2f}" for stage in (*STAGES, "other"))
    return "\n".join(
        [
            "| documents | chunks | tokens precomputed | chunk s | precompute + put s | embed s | upsert s | other s "
            "| end-to-end s | chunks/s | precompute tok/s |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
            f"| {m['documents']:.0f} | {m['chunks']:.0f} | {m['tokens_precomputed']:.0f} | {stages} "
            f"| {m['wall_s']:.2f} | {m['chunks_per_s']:.1f} | {m['precompute_tokens_per_s']:.0f} |",
        ]
    )


# ---- precompute only -------------------------------------------------------------------------------------------


def chunk_blocks(engine: StitchEngine, docs: list[Document], chunk_size: int, overlap: int) -> list[TokenIds]:
    """The distinct KV blocks (template-wrapped chunk ids) of the documents, as the ingestor builds them."""
    chunker = Chunker(engine.tokenizer, ChunkerConfig(chunk_size, overlap, MAX_DOCUMENT_CHARS))
    blocks = (engine.template.chunk_block(c.token_ids) for d in docs for c in chunker.chunk(d.id, d.text))
    return list(dict.fromkeys(blocks))


def run_precompute_only(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    target = torch.device(args.device)
    engine = build_engine(None if args.shape else args.model, target)
    docs = corpus(args.docs, args.paragraphs, args.sentences, seed=1)
    blocks = chunk_blocks(engine, docs, args.chunk_size, args.chunk_overlap)
    batches = [[blocks[i] for i in batch] for batch in precompute_batches([len(b) for b in blocks], args.max_tokens)]
    tokens = sum(len(b) for b in blocks)
    log.info(
        "%d blocks, %d tokens in %d batches: %.2f GB of KV files per run",
        len(blocks),
        tokens,
        len(batches),
        tokens * engine.spec.kv_bytes_per_token() / 1e9,
    )
    engine.precompute(batches[0])  # warm-up: kernels, allocator, cuBLAS handles
    device.synchronize(target)
    info = {
        "model": engine.model.source,
        "device": torch.cuda.get_device_name() if target.type == "cuda" else "cpu",
        "dtype": str(engine.spec.dtype),
        "kv_bytes_per_token": engine.spec.kv_bytes_per_token(),
    }
    rows = []
    for run in range(args.runs):
        with _disk_store(engine, args) as store:
            row = time_batches(engine, store, batches, target)
        with _disk_store(engine, args) as store:
            row.update(time_pipelined(engine, store, blocks, args.max_tokens, target))
        log.info("run %d: %s", run + 1, json.dumps(row))
        rows.append(row)
    return rows, info


@contextlib.contextmanager
def _disk_store(engine: StitchEngine, args: argparse.Namespace) -> Iterator[KVStore]:
    """A KV store with only a disk tier, on a fresh folder under --cache-root."""
    with tempfile.TemporaryDirectory(prefix="bench-worker-kv-", dir=args.cache_root) as tmp:
        index = SqliteIndex(Path(tmp) / "index.sqlite3")
        budgets = TierBudgets(gpu_bytes=0, host_bytes=0, disk_bytes=args.disk_cache_mb << 20)
        try:
            with kv_store_for(engine, Path(tmp) / "kv", index, budgets) as store:
                yield store
        finally:
            index.close()


def time_pipelined(
    engine: StitchEngine, store: KVStore, blocks: list[TokenIds], max_tokens: int, target: torch.device
) -> dict[str, Any]:
    """The worker's own path: `precompute_and_store`, writes overlapping the next batch's forward."""
    device.synchronize(target)
    start = time.perf_counter()
    precompute_and_store(engine.precompute, store.put, blocks, max_tokens)
    seconds = time.perf_counter() - start
    return {"pipelined_s": seconds, "pipelined_tokens_per_s": sum(len(b) for b in blocks) / seconds}


def time_batches(
    engine: StitchEngine, store: KVStore, batches: list[list[TokenIds]], target: torch.device
) -> dict[str, Any]:
    """Forward and put of every batch, each synchronised and timed on its own."""
    compute_s = put_s = 0.0
    written = 0
    for batch in batches:
        device.synchronize(target)
        start = time.perf_counter()
        kv = engine.precompute(batch)
        device.synchronize(target)
        middle = time.perf_counter()
        written += store.put(kv)
        compute_s += middle - start
        put_s += time.perf_counter() - middle
    tokens = sum(len(b) for batch in batches for b in batch)
    padded = sum(len(batch) * max(len(b) for b in batch) for batch in batches)
    return {
        "blocks": sum(len(batch) for batch in batches),
        "batches": len(batches),
        "tokens": tokens,
        "padded_tokens": padded,
        "compute_s": compute_s,
        "put_s": put_s,
        "bytes_written": written,
        "compute_tokens_per_s": tokens / compute_s,
        "tokens_per_s": tokens / (compute_s + put_s),
        "blocks_per_s": sum(len(batch) for batch in batches) / (compute_s + put_s),
        "write_gb_per_s": written / put_s / 1e9 if put_s else 0.0,
    }


def precompute_table(rows: list[dict[str, Any]]) -> str:
    m = medians(rows)
    return "\n".join(
        [
            "| blocks | batches | tokens (padded) | forward s | put s | KV GB written | forward tok/s "
            "| forward then put tok/s | blocks/s | write GB/s | worker path (pipelined) s | worker path tok/s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
            f"| {m['blocks']:.0f} | {m['batches']:.0f} | {m['tokens']:.0f} ({m['padded_tokens']:.0f}) "
            f"| {m['compute_s']:.2f} | {m['put_s']:.2f} | {m['bytes_written'] / 1e9:.2f} "
            f"| {m['compute_tokens_per_s']:.0f} | {m['tokens_per_s']:.0f} | {m['blocks_per_s']:.1f} "
            f"| {m['write_gb_per_s']:.2f} | {m['pipelined_s']:.2f} | {m['pipelined_tokens_per_s']:.0f} |",
        ]
    )


# ---- main ------------------------------------------------------------------------------------------------------


def medians(rows: list[dict[str, Any]]) -> dict[str, float]:
    return {key: statistics.median(float(r[key]) for r in rows) for key in rows[0]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF model folder (full mode needs one)")
    parser.add_argument("--shape", choices=("qwen2-7b",), default=None, help="precompute-only: random-weight shape")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--precompute-only", action="store_true", help="no embedding, no Qdrant: forward + put")
    parser.add_argument("--docs", type=int, default=200, help="documents in the job")
    parser.add_argument("--paragraphs", type=int, default=4, help="paragraphs per document")
    parser.add_argument("--sentences", type=int, default=5, help="sentences per paragraph")
    parser.add_argument("--chunk-size", type=int, default=384, help="chunk tokens (KVSTITCH_CHUNK_SIZE's default)")
    parser.add_argument("--chunk-overlap", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=16_384, help="padded tokens per precompute batch")
    parser.add_argument("--disk-cache-mb", type=int, default=200_000)
    parser.add_argument("--embedding-device", default="cpu")
    parser.add_argument("--cache-root", default=None, help="folder for the temp KV dirs (default: system temp)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.device == "cuda" and not torch.cuda.is_available():
        log.error("no CUDA device here")
        return 2
    if args.shape and not args.precompute_only:
        log.error("--shape needs --precompute-only (a random-weight model has no folder for the full runtime)")
        return 2
    if not args.shape and not args.model:
        log.error("give --model DIR (or --precompute-only --shape qwen2-7b)")
        return 2
    report: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "torch": torch.__version__}
    if args.precompute_only:
        rows, info = run_precompute_only(args)
        report.update(info)
        table = precompute_table(rows)
    else:
        rows = run_full(args)
        table = full_table(rows)
    report["rows"], report["median"] = rows, medians(rows)
    sys.stdout.write(f"median of {len(rows)} runs\n{table}\n")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
