"""How fast each KV cache tier puts a request's chunk KV on the GPU, and what that does to TTFT.

    python -m loadtest.bench_tiers --json tiers.json                       # H200: Qwen2-7B shape, 8K context
    python -m loadtest.bench_tiers --device cpu --model DIR --context 2048 --chunk-tokens 256   # smoke run
    python -m loadtest.bench_tiers --disk-format native int8 --tiers disk_cold disk_warm   # 8-bit files

With several --disk-format values each form gets its own cache dir, files and table (one engine for all);
"disk GB/s" is then the files' bytes over the fetch time, which for an 8-bit form is about half the KV's bytes.

Without --model it builds a Qwen2-7B-shaped model with random bf16 weights on the GPU (as bench_prefill does).
The context (default 8K tokens of 512-token chunks) is precomputed once and `put` on disk, then, median of
--runs after --warmup:

- fetch, per tier: wall time of `KVStore.fetch` until every block is on the GPU (synchronised), for blocks
  already in the GPU tier, in the pinned host pool, on disk with the page cache dropped before each run
  (posix_fadvise DONTNEED on every file; whether the kernel honoured it shows as cold vs warm), on disk in
  the page cache, and for a miss (one batched precompute);
- reference bandwidths on the same machine and files: raw disk reads with O_DIRECT into an aligned buffer
  (cache dropped first) and a plain pinned-host-to-GPU copy of the same number of bytes;
- TTFT: fetch + stitch + question prefill + first token id on the host, per tier, against a naive prefill
  of the whole prompt, in the same process.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import mmap
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from loadtest.bench_prefill import build_engine, context_chunks, question_ids, timed
from service.engine.engine import StitchEngine
from service.engine.prompt import PromptIds
from service.kvcache import device
from service.kvcache.fileformat import ALIGNMENT
from service.kvcache.index import SQLITE_FILENAME, SqliteIndex
from service.kvcache.quant import DISK_FORMATS, DiskFormat
from service.kvcache.store import FetchResult, KVStore, TierBudgets
from service.kvcache.tiers import Tier
from service.serving.kv_source import kv_store_for

log = logging.getLogger("bench_tiers")
GB = 1e9
DIRECT_CHUNK = 64 << 20
TIERS = ("gpu", "host", "disk_cold", "disk_warm", "miss")


# ---- setup -------------------------------------------------------------------------------------------------


def make_prompt(engine: StitchEngine, args: argparse.Namespace) -> PromptIds:
    chunks = context_chunks(engine, args.context, args.chunk_tokens, seed=args.context)
    return engine.template.prompt(chunks, question_ids(engine, args.question_tokens))


def fill_disk(engine: StitchEngine, prompt: PromptIds, store: KVStore, batch: int) -> list[Path]:
    """Precompute every block once and store it on disk; returns the block files."""
    blocks = list(prompt.blocks)
    for i in range(0, len(blocks), batch):
        store.put(engine.precompute(blocks[i : i + batch]))
    return [store.disk.path_of(store.key_of(ids)) for ids in blocks]


# ---- timing helpers ----------------------------------------------------------------------------------------


def drop_page_cache(paths: list[Path]) -> None:
    """Ask the kernel to drop the files' cached pages (clean pages only; the files were fsynced)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_disk_read(paths: list[Path], runs: int) -> tuple[list[float], str]:
    """GB/s of reading every file whole with O_DIRECT into an aligned buffer (cache dropped first).

    Falls back to buffered reads after the fadvise where the filesystem refuses O_DIRECT (tmpfs, some
    overlays); the returned mode says which one was measured.
    """
    total = sum(p.stat().st_size for p in paths)
    buffer = mmap.mmap(-1, _aligned(max(p.stat().st_size for p in paths)))  # page-aligned anonymous memory
    mode = "O_DIRECT"
    speeds = []
    for _ in range(runs):
        drop_page_cache(paths)
        start = time.perf_counter()
        try:
            for path in paths:
                _read_whole(path, buffer, os.O_DIRECT if mode == "O_DIRECT" else 0)
        except OSError as err:
            log.warning("O_DIRECT read failed (%s); measuring buffered reads after fadvise instead", err)
            mode = "buffered after fadvise"
            continue
        speeds.append(total / (time.perf_counter() - start) / GB)
    buffer.close()
    return speeds, mode


def _read_whole(path: Path, buffer: mmap.mmap, flags: int) -> None:
    fd = os.open(path, os.O_RDONLY | flags)
    try:
        size, done, view = os.fstat(fd).st_size, 0, memoryview(buffer)
        while done < size:
            length = min(DIRECT_CHUNK, _aligned(size) - done)  # O_DIRECT lengths stay block multiples
            n = os.preadv(fd, [view[done : done + length]], done)
            if n <= 0:
                raise OSError(f"short read of {path} at {done} of {size} bytes")
            done += n
        view.release()
    finally:
        os.close(fd)


def _aligned(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


def pinned_h2d(nbytes: int, target: torch.device, runs: int, warmup: int) -> list[float]:
    """GB/s of one plain copy of `nbytes` from pinned host memory to the device (a host copy on a CPU)."""
    host = device.allocate_host(nbytes, pinned=device.uses_cuda(target))
    destination = torch.empty(nbytes, dtype=torch.uint8, device=target)
    times = timed(lambda: destination.copy_(host, non_blocking=True), runs, warmup, target)
    return [nbytes / (ms / 1e3) / GB for ms in times]


def filesystem_of(path: Path) -> str:
    """The filesystem type the cache dir lives on (tmpfs would make "disk" numbers meaningless)."""
    best, kind = "", "unknown"
    for line in Path("/proc/mounts").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 3 and str(path.resolve()).startswith(fields[1]) and len(fields[1]) > len(best):
            best, kind = fields[1], fields[2]
    return kind


# ---- the tiers ---------------------------------------------------------------------------------------------


class Bench:
    """The engine, the prompt, its block files and a store per tier, over one cache dir and index."""

    def __init__(
        self,
        engine: StitchEngine,
        prompt: PromptIds,
        cache_dir: Path,
        args: argparse.Namespace,
        disk_format: DiskFormat = "native",
    ) -> None:
        self.engine, self.prompt, self.args = engine, prompt, args
        self.disk_format = disk_format
        self.target = engine.spec.device
        self.cache_dir = cache_dir
        self.index = SqliteIndex(cache_dir / SQLITE_FILENAME)
        self.kv_bytes = sum(len(b) for b in prompt.blocks) * engine.spec.kv_bytes_per_token()
        self.room = 2 * self.kv_bytes + (64 << 20)  # each budget holds the whole context with room to spare
        with self.store(gpu=0, host=0) as filler:
            self.files = fill_disk(engine, prompt, filler, args.precompute_batch)
        self.warm = {"gpu": self.store(gpu=self.room, host=0), "host": self.store(gpu=0, host=self.room)}
        # Misses: an empty cache dir and index, and no tier that keeps anything, so every fetch computes.
        self.miss_index = SqliteIndex(cache_dir / "miss" / SQLITE_FILENAME)
        self.miss = kv_store_for(engine, cache_dir / "miss", self.miss_index, TierBudgets())
        self.file_bytes = sum(p.stat().st_size for p in self.files)
        self.cold: KVStore | None = None

    def store(self, gpu: int, host: int) -> KVStore:
        budgets = TierBudgets(gpu_bytes=gpu, host_bytes=host, disk_bytes=4 * self.room)
        return kv_store_for(self.engine, self.cache_dir, self.index, budgets, disk_format=self.disk_format)

    def fetcher(self, tier: str) -> Callable[[], FetchResult]:
        """A fetch that `tier` serves entirely (after `preparer(tier)` ran); checks that it did."""
        blocks = self.prompt.blocks
        if tier in self.warm:
            store = self.warm[tier]
            self._expect(store.fetch(blocks), Tier.DISK)  # fills the tier
            return lambda: self._expect(store.fetch(blocks), Tier(tier))
        if tier == "miss":
            return lambda: self._expect(self.miss.fetch(blocks), Tier.MISS)
        return lambda: self._expect(self._cold().fetch(blocks), Tier.DISK)

    def preparer(self, tier: str) -> Callable[[], None] | None:
        """Untimed work before each disk run: a store with empty memory tiers, and for a cold run no page cache."""
        if not tier.startswith("disk"):
            return None

        def prepare() -> None:
            if self.cold is not None:
                self.cold.close()
            self.cold = self.store(gpu=0, host=self.room)
            if tier == "disk_cold":
                drop_page_cache(self.files)

        return prepare

    def _cold(self) -> KVStore:
        if self.cold is None:
            raise RuntimeError("a disk run needs its preparer first")
        return self.cold

    def _expect(self, result: FetchResult, tier: Tier) -> FetchResult:
        if result.counts[tier] != len(self.prompt.blocks):
            raise RuntimeError(f"expected every block from the {tier} tier, got {result.counts}")
        return result

    def close(self) -> None:
        for store in [*self.warm.values(), self.miss, *([self.cold] if self.cold else [])]:
            store.close()
        self.index.close()
        self.miss_index.close()


def measure_tier(bench: Bench, tier: str, runs: int, warmup: int) -> dict[str, Any]:
    """Fetch time (and its parts) and TTFT of requests served by one tier."""
    engine, question = bench.engine, bench.prompt.question
    fetch, prepare = bench.fetcher(tier), bench.preparer(tier)
    results: list[FetchResult] = []

    def fetch_only() -> None:
        results.append(fetch())

    def first_token() -> int:
        _, logits, _ = engine.prefill_stitched(fetch().blocks, question)
        return int(torch.argmax(logits))

    fetch_ms = timed(fetch_only, runs, warmup, bench.target, prepare)
    kept = results[warmup:]
    return {
        "fetch_ms": fetch_ms,
        "load_ms": [r.timings.load_ms for r in kept],
        "h2d_ms": [r.timings.h2d_ms for r in kept],
        "precompute_ms": [r.timings.precompute_ms for r in kept],
        "ttft_ms": timed(first_token, runs, warmup, bench.target, prepare),
    }


def measure_naive(bench: Bench, runs: int, warmup: int) -> list[float]:
    engine, prompt = bench.engine, bench.prompt
    return timed(lambda: int(torch.argmax(engine.prefill_naive(prompt)[1])), runs, warmup, bench.target)


# ---- report ------------------------------------------------------------------------------------------------


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summarise(report: dict[str, Any]) -> dict[str, Any]:
    """Medians, achieved GB/s and their share of the measured reference bandwidths."""
    kv_gb = report["kv_bytes"] / GB
    references = {"host": median(report["pinned_h2d_gbps"]), "disk_cold": median(report["raw_disk_gbps"])}
    naive = median(report["naive_ttft_ms"])
    rows = {}
    for tier, raw in report["tiers"].items():
        fetch = median(raw["fetch_ms"])
        achieved = kv_gb / (fetch / 1e3)
        reference = references.get(tier, float("nan"))
        rows[tier] = {
            **{f"median_{k}": median(v) for k, v in raw.items()},
            "achieved_gbps": achieved,
            "disk_gbps": report["file_bytes"] / GB / (fetch / 1e3) if tier.startswith("disk") else float("nan"),
            "reference_gbps": reference,
            "share_of_reference": achieved / reference,
            "ttft_speedup_vs_naive": naive / median(raw["ttft_ms"]),
        }
    return rows


def _num(value: float, spec: str) -> str:
    return "—" if math.isnan(value) else format(value, spec)


def table(report: dict[str, Any]) -> str:
    rows = report["summary"]
    lines = [
        "| tier | fetch ms | GB/s | reference GB/s | of reference | disk read ms | H2D ms | precompute ms "
        "| TTFT ms | TTFT speedup vs naive | disk GB/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    columns = [
        ("median_fetch_ms", ".2f"),
        ("achieved_gbps", ".1f"),
        ("reference_gbps", ".1f"),
        ("share_of_reference", ".0%"),
        ("median_load_ms", ".2f"),
        ("median_h2d_ms", ".2f"),
        ("median_precompute_ms", ".2f"),
        ("median_ttft_ms", ".2f"),
        ("ttft_speedup_vs_naive", ".1f"),
    ]
    for tier, r in rows.items():
        cells = " | ".join(_num(r[name], spec) for name, spec in columns)
        lines.append(f"| {tier} | {cells}x | {_num(r['disk_gbps'], '.2f')} |")
    lines.append(f"| naive (no cache, full prefill) | | | | | | | | {median(report['naive_ttft_ms']):.2f} | 1.0x |")
    lines.append("")
    lines.append(
        f"{report['device']}, {report['context_tokens']} context tokens in {report['blocks']} blocks, "
        f"{report['kv_bytes'] / 1e6:.0f} MB of chunk KV, stored {report['disk_format']} in "
        f"{report['file_bytes'] / 1e6:.0f} MB of files; cache dir on {report['filesystem']}; "
        f"raw disk read {median(report['raw_disk_gbps']):.2f} GB/s ({report['raw_disk_mode']}); "
        f"pinned H2D {median(report['pinned_h2d_gbps']):.1f} GB/s; median of {report['runs']} runs."
    )
    return "\n".join(lines)


# ---- main --------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder; default: random Qwen2-7B shape")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run with --model")
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--question-tokens", type=int, default=128)
    parser.add_argument("--precompute-batch", type=int, default=16)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--cache-dir", type=Path, default=None, help="parent of the bench's cache (default: /var/tmp)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--disk-format", nargs="+", choices=DISK_FORMATS, default=["native"])
    parser.add_argument("--tiers", nargs="+", choices=TIERS, default=list(TIERS))
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
    reports = {}
    for disk_format in args.disk_format:
        with tempfile.TemporaryDirectory(prefix="kvstitch-bench-tiers-", dir=parent) as tmp:
            reports[disk_format] = run(args, Path(tmp), engine, disk_format)
        sys.stdout.write(table(reports[disk_format]) + "\n\n")
    if args.json:
        only = reports[args.disk_format[0]] if len(reports) == 1 else reports
        args.json.write_text(json.dumps(only, indent=2))
    return 0


def run(
    args: argparse.Namespace, cache_dir: Path, engine: StitchEngine, disk_format: DiskFormat = "native"
) -> dict[str, Any]:
    started = time.perf_counter()
    prompt = make_prompt(engine, args)
    bench = Bench(engine, prompt, cache_dir, args, disk_format)
    try:
        log.info(
            "filled %d blocks (%.0f MB) in %.1f s",
            len(prompt.blocks),
            bench.kv_bytes / 1e6,
            time.perf_counter() - started,
        )
        report: dict[str, Any] = {
            "device": device.device_name(bench.target),
            "torch": torch.__version__,
            "context_tokens": prompt.context_tokens,
            "blocks": len(prompt.blocks),
            "kv_bytes": bench.kv_bytes,
            "disk_format": disk_format,
            "file_bytes": bench.file_bytes,
            "runs": args.runs,
            "filesystem": filesystem_of(cache_dir),
            "pinned_h2d_gbps": pinned_h2d(bench.kv_bytes, bench.target, args.runs, args.warmup),
        }
        report["raw_disk_gbps"], report["raw_disk_mode"] = raw_disk_read(bench.files, args.runs)
        report["naive_ttft_ms"] = measure_naive(bench, args.runs, args.warmup)
        report["tiers"] = {tier: measure_tier(bench, tier, args.runs, args.warmup) for tier in args.tiers}
        report["summary"] = summarise(report)
        report["seconds"] = time.perf_counter() - started
        return report
    finally:
        bench.close()


if __name__ == "__main__":
    raise SystemExit(main())
