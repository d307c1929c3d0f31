"""TurboRAG Table 5 / Table 6 shape: TTFT by context length x batch size, naive vs stitched from each KV tier.

    python -m loadtest.bench_tables --runs 5 --json $OUT/tables.json --plot $OUT/tables.png
    python -m loadtest.bench_tables --device cpu --model /tmp/tiny --contexts 512 1024 --batches 1 2 --runs 2

Without --model it builds a Qwen2-7B-shaped model with random bf16 weights on the GPU (see bench_prefill); the
engine is the default one (CUDA graphs for the question prefill and decode, fused Triton stitch, host-tier copies
layer-pipelined under the prefill).

**True batches (the default):** a "batch of B" is B independent requests (each its own chunks) submitted together
to one `Scheduler` built as the server builds it (`loadtest/true_batch.py`: a KV pool with a slab per request, the
server's `prefill_chunk` and `batch_prefill_min`, the batched decode step through CUDA graphs on CUDA, captured
before anything is timed). Each turbo request's chunk KV is fetched at its admission by the server's own
KV source (`StoreChunks`) from the tier under test; turbo questions admitted together are prefilled in
one forward where the server does that; naive prompts are prefilled by the scheduler, `prefill_chunk` tokens per
step between the running requests' decode steps. Per batch: the TTFT of the first and of the last request to get
its first token and the median, all counted from the batch start; the batch's total (to its last token); decode
ms per batched step (at the largest batch a step decoded); the speedup of each tier vs naive on the last-request
TTFT and on the total. One scheduler (pool and graphs) per batch size serves every tier, freed before the next.

**--sequential:** the batch of B is the B requests run back to back through `KVStore.fetch(overlap=True)` + the server's
scheduler (`service.engine.offline`), one at a time; the last request's TTFT counts from the start of the batch (it
includes waiting for the B - 1 requests before it). By default each run is one back-to-back sequence of max(--batches)
requests and batch B is its first B requests (nothing is shared between requests but the tiers, prepared before the
sequence); --separate-batches runs each batch size as its own sequence instead.

Tiers (each request's chunks entirely in that tier): `gpu` (KVStore GPU tier), `host` (pinned host pool),
`disk_cold` (a fresh store, page cache dropped with posix_fadvise before each batch, as bench_tiers), `miss`
(the chunks precomputed inside the fetch), and `naive` (one causal prefill of the whole prompt, no cache).
Per request: the wait for admission (queue: true batches only), the store's load (disk read), h2d
(host-to-device copies until the last landed), precompute (miss) and the engine's stitch and prefill times (a
question prefilled with others counts the group's), TTFT, and decode ms/token over --decode-tokens greedy tokens.
With the pipelined host path the stitch is interleaved with the prefill and counted in it (stitch 0).

A context above the model's window (context + question + answer > max_position_embeddings, e.g. 32K on Qwen2-7B's
32,768) is trimmed by whole chunks to fit; the table shows the context actually used. Medians of --runs after
--warmup; a cell that fails (out of memory, say: a tier in sequential mode, a tier at one batch size with true
batches) is reported as failed and the sweep goes on.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from loadtest.bench_prefill import build_engine, question_ids
from loadtest.bench_tiers import drop_page_cache, filesystem_of, fill_disk
from loadtest.true_batch import BatchRun, batch_scheduler, run_batch
from service.engine.batching_defaults import BATCH_PREFILL_MIN, PREFILL_CHUNK
from service.engine.engine import GenerationMode, StitchEngine
from service.engine.gate import synthetic_ids
from service.engine.offline import OfflineScheduler, generate
from service.engine.prompt import PromptIds
from service.engine.sampling import SamplingParams
from service.engine.scheduler import Scheduler
from service.engine.scheduler_config import release
from service.kvcache import device
from service.kvcache.index import SQLITE_FILENAME, SqliteIndex
from service.kvcache.store import KVStore, TierBudgets
from service.kvcache.tiers import Tier
from service.serving.kv_source import kv_store_for

log = logging.getLogger("bench_tables")
TIERS = ("naive", "gpu", "host", "disk_cold", "miss")
EXPECTED = {"gpu": Tier.GPU, "host": Tier.HOST, "disk_cold": Tier.DISK, "miss": Tier.MISS}
STAGES = (
    "queue_ms",
    "fetch_ms",
    "load_ms",
    "h2d_ms",
    "precompute_ms",
    "stitch_ms",
    "prefill_ms",
    "ttft_ms",
    "decode_ms_per_token",
)
# What a failed cell may raise (CUDA's out-of-memory error is a RuntimeError too; named to say which).
CELL_ERRORS = (RuntimeError, torch.cuda.OutOfMemoryError)
TRUE_BATCHES = (
    "true batches: batch B = B requests submitted together to one scheduler (as the server runs them)",
    "'first' / 'median' / 'last' = TTFT of the first, median and last request to get its first token, from the "
    "batch start; total = the whole batch to its last token; decode = ms per batched step (at the largest batch "
    "a step decoded, '@n' when fewer than B: naive prompts are prefilled one after another).",
)
SEQUENTIAL = (
    "sequential: batch B = B independent requests run back to back",
    "'first' = TTFT of the batch's first request, 'median' / 'last' = the median and the last request's TTFT "
    "counted from the start of the batch (each waits for the requests before it); total = the whole batch to its "
    "last token; decode = ms per step of one request.",
)
# TurboRAG (Lu et al.), A100 80GB, Qwen2-7B, HF transformers + FlashAttention2, real batching, query 128 tokens.
PAPER_TABLE5 = {  # 8,192 context tokens; batch: (naive, turbo with h2d, turbo without h2d) ms
    1: (711.0, 175.0, 44.0),
    2: (1408.0, 325.0, 56.0),
    4: (2842.0, 666.0, 97.0),
    6: (4373.0, 928.0, 134.0),
    8: (5812.0, 1429.0, 177.0),
}
PAPER_TABLE6 = {  # (sequence length, batch): (naive, turbo) ms
    (256, 1): (44.00, 41.62),
    (256, 2): (68.19, 195.96),
    (256, 4): (127.19, 165.73),
    (256, 8): (242.31, 120.62),
    (512, 1): (59.16, 37.16),
    (512, 2): (101.84, 47.58),
    (512, 4): (205.61, 133.14),
    (512, 8): (398.18, 179.94),
    (1024, 1): (97.89, 48.79),
    (1024, 2): (186.02, 89.08),
    (1024, 4): (359.95, 139.70),
    (1024, 8): (711.19, 189.81),
}


# ---- setup -------------------------------------------------------------------------------------------------


def request_chunks(engine: StitchEngine, context: int, args: argparse.Namespace, seed: int) -> list[list[int]]:
    """Chunk ids filling about `context` tokens, trimmed by whole chunks to fit the model's window."""
    template = engine.template
    per_chunk = args.chunk_tokens + len(template.doc_open) + len(template.doc_close)
    fixed = len(template.prefix)
    count = max(1, round((context - fixed) / per_chunk))
    limit = engine.spec.max_context - args.question_tokens - args.decode_tokens
    while count > 1 and fixed + count * per_chunk > limit:
        count -= 1
    return synthetic_ids(engine, [args.chunk_tokens] * count, seed)


@dataclass
class Context:
    """One context length: its B prompts (distinct chunks each), their block files and a store per tier."""

    engine: StitchEngine
    context: int  # the length asked for (the prompts may hold less: trimmed to the model's window)
    prompts: list[PromptIds]
    cache_dir: Path
    index: SqliteIndex
    kv_bytes: int
    files: list[list[Path]] = field(default_factory=list)
    stores: dict[str, KVStore] = field(default_factory=dict)

    @classmethod
    def build(cls, engine: StitchEngine, context: int, count: int, args: argparse.Namespace, parent: Path) -> Context:
        question = question_ids(engine, args.question_tokens)
        prompts = [
            engine.template.prompt(request_chunks(engine, context, args, seed=context * 16 + i), question)
            for i in range(count)
        ]
        cache_dir = parent / f"ctx{context}"
        cache_dir.mkdir(parents=True)
        tokens = sum(len(b) for p in prompts for b in p.blocks)
        made = cls(
            engine,
            context,
            prompts,
            cache_dir,
            SqliteIndex(cache_dir / SQLITE_FILENAME),
            tokens * engine.spec.kv_bytes_per_token(),
        )
        with made.store(gpu=0, host=0) as filler:
            made.files = [fill_disk(engine, p, filler, args.precompute_batch) for p in prompts]
        return made

    @property
    def room(self) -> int:
        # Every request's KV with slack for slot alignment; not 2x: the host pool is pinned up front, once per store.
        return self.kv_bytes + (256 << 20)

    def store(self, gpu: int, host: int, cache_dir: Path | None = None, index: SqliteIndex | None = None) -> KVStore:
        budgets = TierBudgets(gpu_bytes=gpu, host_bytes=host, disk_bytes=4 * self.room)
        return kv_store_for(self.engine, cache_dir or self.cache_dir, index or self.index, budgets)

    def prepare(self, tier: str, count: int) -> Callable[[], KVStore | None]:
        """A function run untimed before each batch; returns the store the batch fetches from (None: naive)."""
        engine = self.engine
        if tier == "naive":
            return lambda: None
        if tier in ("gpu", "host"):
            store = self.stores.get(tier)
            if store is None:
                store = self.stores[tier] = self.store(
                    gpu=self.room if tier == "gpu" else 0, host=self.room if tier == "host" else 0
                )
                for prompt in self.prompts:
                    store.fetch(prompt.blocks)  # disk → the tier
            return lambda: store
        if tier == "miss":
            if "miss" not in self.stores:  # an empty cache dir and index, no tier that keeps anything
                miss_dir = self.cache_dir / "miss"
                miss_dir.mkdir()
                self.stores["miss"] = kv_store_for(
                    engine, miss_dir, SqliteIndex(miss_dir / SQLITE_FILENAME), TierBudgets()
                )
            return lambda: self.stores["miss"]

        def cold() -> KVStore:
            old = self.stores.pop("disk_cold", None)
            if old is not None:  # free its pinned pool before the next one is pinned
                old.close()
                del old
                gc.collect()
            store = self.stores["disk_cold"] = self.store(gpu=0, host=self.room)
            drop_page_cache([f for files in self.files[:count] for f in files])
            return store

        return cold

    def close(self) -> None:
        for store in self.stores.values():
            store.close()
        self.stores.clear()
        self.index.close()
        shutil.rmtree(self.cache_dir, ignore_errors=True)


# ---- measuring ---------------------------------------------------------------------------------------------


def one_request(
    runner: OfflineScheduler, prompt: PromptIds, sampling: SamplingParams, store: KVStore | None, tier: str
) -> dict[str, float]:
    """One request to its last token through the server's scheduler, alone; TTFT = fetch wall time + the
    scheduler's TTFT (from its admission to its first token id on the host)."""
    start = time.perf_counter()
    fetch = None
    if store is None:
        result = generate(runner.engine, prompt, sampling, mode=GenerationMode.NAIVE, runner=runner)
        fetched = start
    else:
        fetch = store.fetch(prompt.blocks, overlap=True)
        if fetch.counts[EXPECTED[tier]] != len(prompt.blocks):
            raise RuntimeError(f"expected every block from the {tier} tier, got {fetch.counts}")
        fetched = time.perf_counter()
        result = generate(
            runner.engine, prompt, sampling, chunk_kv=fetch.blocks, chunk_ready=list(fetch.ready), runner=runner
        )
    end = time.perf_counter()
    timings, tokens = result.timings, len(result.token_ids)
    return {
        "fetch_ms": (fetched - start) * 1e3,
        "load_ms": fetch.timings.load_ms if fetch else 0.0,
        "h2d_ms": fetch.timings.h2d_ms if fetch else 0.0,  # read after the stitch: every copy has landed
        "precompute_ms": (fetch.timings.precompute_ms if fetch else 0.0) + timings.precompute_ms,
        "stitch_ms": timings.stitch_ms,
        "prefill_ms": timings.prefill_ms,
        "queue_ms": 0.0,
        "ttft_ms": (fetched - start) * 1e3 + timings.ttft_ms,
        "decode_ms_per_token": timings.decode_ms / max(1, tokens - 1),
        "total_ms": (end - start) * 1e3,
    }


def sequence(
    ctx: Context, runner: OfflineScheduler, tier: str, count: int, sampling: SamplingParams
) -> list[dict[str, float]]:
    """`count` requests back to back (the store prepared untimed first); each with its offset in the sequence."""
    store = ctx.prepare(tier, count)()
    device.synchronize(ctx.engine.spec.device)
    start = time.perf_counter()
    out = []
    for prompt in ctx.prompts[:count]:
        offset = (time.perf_counter() - start) * 1e3
        row = one_request(runner, prompt, sampling, store, tier)
        row["offset_ms"] = offset
        out.append(row)
    return out


def batch_figures(requests: list[dict[str, float]]) -> dict[str, float]:
    """A sequential batch's figures, with the keys of a true batch's (`BatchRun.figures`)."""
    last = requests[-1]
    return {
        "first_ttft_ms": requests[0]["ttft_ms"],
        "p50_ttft_ms": median([r["offset_ms"] + r["ttft_ms"] for r in requests]),
        "last_ttft_ms": last["offset_ms"] + last["ttft_ms"],
        "batch_ms": last["offset_ms"] + last["total_ms"],
        "decode_ms_per_step": median([r["decode_ms_per_token"] for r in requests]),
        "decode_batch": 1.0,
    }


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def measure_tier(
    ctx: Context, runner: OfflineScheduler, tier: str, batches: list[int], args: argparse.Namespace
) -> dict[str, Any]:
    sampling = SamplingParams(max_new_tokens=args.decode_tokens, ignore_eos=True)
    lengths = sorted(set(batches)) if args.separate_batches else [max(batches)]
    runs: dict[int, list[list[dict[str, float]]]] = {n: [] for n in lengths}
    for i in range(args.warmup + args.runs):
        for n in lengths:
            done = sequence(ctx, runner, tier, n, sampling)
            if i >= args.warmup:
                runs[n].append(done)
    out: dict[str, Any] = {"batches": {}}
    for b in batches:
        source = runs[b] if args.separate_batches else runs[max(batches)]
        figures = [batch_figures(seq[:b]) for seq in source]
        out["batches"][str(b)] = batch_entry(figures, [r for seq in source for r in seq[:b]])
    return out


def batch_entry(figures: list[dict[str, float]], requests: list[dict[str, float]]) -> dict[str, Any]:
    """Medians over the runs of each batch figure, and over every request of those runs of each stage."""
    entry: dict[str, Any] = {k: median([f[k] for f in figures]) for k in figures[0]}
    entry.update({f"median_{k}": median([r[k] for r in requests]) for k in STAGES})
    entry["runs"] = figures
    return entry


def failure(what: str, err: BaseException, engine: StitchEngine) -> dict[str, str]:
    """A failed cell's entry (the sweep goes on); device memory the failure left cached is given back."""
    log.warning("%s failed: %s", what, err)
    free_device_memory(engine)
    first_line = (str(err).splitlines() or [""])[0]
    return {"error": f"{type(err).__name__}: {first_line[:200]}"}


def free_device_memory(engine: StitchEngine) -> None:
    """Drop what is unreferenced now and give the device memory torch caches back (before the next allocation)."""
    gc.collect()
    if device.uses_cuda(engine.spec.device):
        torch.cuda.empty_cache()


# ---- true batches ------------------------------------------------------------------------------------------


def measure_true_batches(ctx: Context, args: argparse.Namespace) -> dict[str, Any]:
    """Every tier at every batch size; batch sizes outside, so one scheduler (its pool and graphs) serves
    every tier of a size and is freed before the next size's is allocated."""
    sampling = SamplingParams(max_new_tokens=args.decode_tokens, ignore_eos=True)
    tiers: dict[str, Any] = {t: {"batches": {}, "seconds": 0.0} for t in args.tiers}
    for count in sorted(set(args.batches)):
        prompts = ctx.prompts[:count]
        try:
            scheduler = batch_scheduler(ctx.engine, prompts, sampling)
        except CELL_ERRORS as err:
            failed = failure(f"context {ctx.context} batch {count}: the scheduler", err, ctx.engine)
            for tier in args.tiers:
                tiers[tier]["batches"][str(count)] = failed
            continue
        try:
            for tier in args.tiers:
                started = time.perf_counter()
                tiers[tier]["batches"][str(count)] = true_batch_cell(ctx, scheduler, tier, count, args)
                tiers[tier]["seconds"] += time.perf_counter() - started
        finally:
            release(scheduler)
            del scheduler
            free_device_memory(ctx.engine)
    return tiers


def true_batch_cell(
    ctx: Context, scheduler: Scheduler, tier: str, count: int, args: argparse.Namespace
) -> dict[str, Any]:
    """One tier at one batch size: --warmup then --runs batches through the scheduler (stores prepared untimed)."""
    sampling = SamplingParams(max_new_tokens=args.decode_tokens, ignore_eos=True)
    runs: list[BatchRun] = []
    try:
        prepare = ctx.prepare(tier, count)
        for i in range(args.warmup + args.runs):
            store = prepare()
            device.synchronize(ctx.engine.spec.device)
            run = run_batch(scheduler, ctx.prompts[:count], sampling, store, EXPECTED.get(tier))
            if i >= args.warmup:
                runs.append(run)
    except CELL_ERRORS as err:
        return failure(f"context {ctx.context} tier {tier} batch {count}", err, ctx.engine)
    entry = batch_entry([r.figures() for r in runs], [s for r in runs for s in r.stages()])
    entry["mode"] = "true batch"
    return entry


def measure_sequential(ctx: Context, args: argparse.Namespace) -> dict[str, Any]:
    """Every tier, each as back-to-back sequences (a tier that fails is reported whole), through one kept
    scheduler (its graphs captured in the warm-up runs)."""
    tiers: dict[str, Any] = {}
    runner = OfflineScheduler(ctx.engine)
    try:
        for tier in args.tiers:
            started = time.perf_counter()
            try:
                tiers[tier] = measure_tier(ctx, runner, tier, args.batches, args)
            except CELL_ERRORS as err:
                runner.close()  # its state after a failed step is unknown: the next tier builds a new one
                tiers[tier] = failure(f"context {ctx.context} tier {tier}", err, ctx.engine)
            tiers[tier]["seconds"] = time.perf_counter() - started
    finally:
        runner.close()
    return tiers


def measure_context(engine: StitchEngine, context: int, args: argparse.Namespace, parent: Path) -> dict[str, Any]:
    started = time.perf_counter()
    ctx = Context.build(engine, context, max(args.batches), args, parent)
    row: dict[str, Any] = {
        "context": context,
        "context_tokens": ctx.prompts[0].context_tokens,
        "chunks": len(ctx.prompts[0].blocks),
        "kv_bytes_per_request": ctx.kv_bytes // len(ctx.prompts),
        "fill_s": time.perf_counter() - started,
        "tiers": {},
    }
    try:
        row["tiers"] = measure_sequential(ctx, args) if args.sequential else measure_true_batches(ctx, args)
    finally:
        ctx.close()
    row["seconds"] = time.perf_counter() - started
    return row


# ---- report ------------------------------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    if value is None or value != value:
        return "—"
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def _entry(row: dict[str, Any], tier: str, batch: int) -> dict[str, Any] | None:
    """The tier's figures at that batch size, or None where it failed or was not run."""
    found = row["tiers"].get(tier)
    if found is None or "error" in found:
        return None
    entry: dict[str, Any] | None = found["batches"].get(str(batch))
    return None if entry is None or "error" in entry else entry


def _failed(row: dict[str, Any], tier: str, batch: int) -> bool:
    found = row["tiers"].get(tier)
    if found is None:
        return False
    return "error" in found or "error" in found["batches"].get(str(batch), {})


def _speedup(naive: dict[str, Any] | None, entry: dict[str, Any] | None, key: str) -> str:
    if naive is None or entry is None:
        return "—"
    return f"{naive[key] / entry[key]:.1f}x"


def _decode(entry: dict[str, Any], batch: int) -> str:
    steps = int(entry["decode_batch"])
    return _ms(entry["decode_ms_per_step"]) + (f" @{steps}" if steps != batch else "")


def ttft_table(rows: list[dict[str, Any]], tiers: list[str], batches: list[int], sequential: bool) -> str:
    """Table 5/6 shape: per context and batch, first / median / last request TTFT per tier, the batch's total,
    decode ms per step, and each tier's speedup vs naive on the last TTFT and on the total."""
    mode, legend = SEQUENTIAL if sequential else TRUE_BATCHES
    stitched = [t for t in tiers if t != "naive"]
    head = " | ".join(f"{t} TTFT first / median / last ms" for t in tiers)
    lines = [
        f"Batching: {mode}. {legend}",
        "",
        f"| context (tokens used) | batch | {head} | total ms, {' / '.join(tiers)} | decode ms/step, "
        f"{' / '.join(tiers)} | speedup vs naive on last TTFT, {' / '.join(stitched)} | speedup vs naive on "
        f"total, {' / '.join(stitched)} |",
        "|---|---|" + "---|" * len(tiers) + "---|---|---|---|",
    ]
    for r in rows:
        for b in batches:
            lines.append(_ttft_line(r, tiers, b))
    return "\n".join(lines)


def _ttft_line(row: dict[str, Any], tiers: list[str], batch: int) -> str:
    cells, totals, decodes = [], [], []
    for t in tiers:
        e = _entry(row, t, batch)
        ttft = "—" if e is None else " / ".join(_ms(e[k]) for k in ("first_ttft_ms", "p50_ttft_ms", "last_ttft_ms"))
        cells.append("failed" if _failed(row, t, batch) else ttft)
        totals.append("—" if e is None else _ms(e["batch_ms"]))
        decodes.append("—" if e is None else _decode(e, batch))
    naive = _entry(row, "naive", batch)
    stitched = [_entry(row, t, batch) for t in tiers if t != "naive"]
    last = " / ".join(_speedup(naive, e, "last_ttft_ms") for e in stitched)
    total = " / ".join(_speedup(naive, e, "batch_ms") for e in stitched)
    return (
        f"| {row['context']} ({row['context_tokens']}) | {batch} | "
        + " | ".join(cells)
        + f" | {' / '.join(totals)} | {' / '.join(decodes)} | {last} | {total} |"
    )


def stage_table(rows: list[dict[str, Any]], tiers: list[str], batch: int) -> str:
    """Per-stage medians per request (over every request of the batch's runs)."""
    lines = [
        f"Per-request stage medians (ms) over the {batch}-request batches' requests; queue = from the batch start to "
        "the request's admission (true batches); stitch 0 where the pipelined host path counts it in prefill; "
        "a question prefilled with others counts the group's stitch and prefill.",
        "",
        "| context | tier | queue | fetch | load (disk) | h2d | precompute | stitch | prefill | TTFT "
        "| decode ms/token |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for t in tiers:
            found = r["tiers"].get(t)
            cell = found["batches"].get(str(batch), {}) if found and "batches" in found else {}
            error = (found or {}).get("error") or cell.get("error")
            if error:
                lines.append(f"| {r['context_tokens']} | {t} | failed: {error} ||||||||| ")
                continue
            e = _entry(r, t, batch)
            if e is None:
                continue
            lines.append(f"| {r['context_tokens']} | {t} | " + " | ".join(_ms(e[f"median_{k}"]) for k in STAGES) + " |")
    return "\n".join(lines)


def paper_table(rows: list[dict[str, Any]], batches: list[int], sequential: bool) -> str:
    """Ours beside TurboRAG's Table 5 (8K) and Table 6 (512, 1K): last-request TTFT (the batch's)."""
    ours = "sequential" if sequential else "true batch"
    lines = [
        "| context | batch | paper naive ms | paper turbo (h2d) ms | paper turbo w/o h2d ms | "
        f"ours naive ms ({ours}) | ours host tier ms | ours GPU tier ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for b in batches:
            if r["context"] == 8192 and b in PAPER_TABLE5:
                paper = tuple(_ms(v) for v in PAPER_TABLE5[b])
            elif (r["context"], b) in PAPER_TABLE6:
                naive, turbo = PAPER_TABLE6[(r["context"], b)]
                paper = (_ms(naive), "—", _ms(turbo))  # Table 6 does not say; its turbo is read as KV on the GPU
            else:
                continue
            found = [_entry(r, t, b) for t in ("naive", "host", "gpu")]
            cells = " | ".join("—" if e is None else _ms(e["last_ttft_ms"]) for e in found)
            lines.append(f"| {r['context_tokens']} | {b} | " + " | ".join(paper) + f" | {cells} |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], tiers: list[str], batches: list[int], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    _plot_contexts(left, rows, tiers, min(batches))
    at = min(rows, key=lambda r: abs(r["context"] - 8192)) if rows else None
    if at is not None:
        _plot_batches(right, at, tiers, batches, "sequential" in title)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_contexts(axes: Any, rows: list[dict[str, Any]], tiers: list[str], batch: int) -> None:
    for t in tiers:
        points = [(r["context_tokens"], e["first_ttft_ms"]) for r in rows if (e := _entry(r, t, batch)) is not None]
        if points:
            axes.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=t)
    paper_x = [512, 1024, 8192]
    naive = [PAPER_TABLE6[(512, 1)][0], PAPER_TABLE6[(1024, 1)][0], PAPER_TABLE5[1][0]]
    turbo = [PAPER_TABLE6[(512, 1)][1], PAPER_TABLE6[(1024, 1)][1], PAPER_TABLE5[1][2]]
    axes.plot(paper_x, naive, "k--", marker="x", label="paper naive (A100)")
    axes.plot(paper_x, turbo, "k:", marker="x", label="paper turbo w/o h2d (A100)")
    title = f"batch {batch}: TTFT vs context"
    axes.set(xscale="log", yscale="log", xlabel="context tokens", ylabel="TTFT ms", title=title)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=8)


def _plot_batches(axes: Any, row: dict[str, Any], tiers: list[str], batches: list[int], sequential: bool) -> None:
    for t in tiers:
        points = [(b, e["last_ttft_ms"]) for b in batches if (e := _entry(row, t, b)) is not None]
        if points:
            axes.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=f"{t} (last request)")
    paper = sorted(PAPER_TABLE5)
    for i, name, style in ((0, "naive", "k--"), (1, "turbo h2d", "k-."), (2, "turbo w/o h2d", "k:")):
        axes.plot(paper, [PAPER_TABLE5[b][i] for b in paper], style, marker="x", label=f"paper {name} (A100)")
    axes.set(
        xlabel=f"batch size (ours: {'sequential requests' if sequential else 'true batch'})",
        ylabel="TTFT ms",
        yscale="log",
        title=f"context {row['context_tokens']}: TTFT of the batch's last request",
    )
    axes.set_xticks(sorted(set(batches) | set(paper)))
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=8)


def render(report: dict[str, Any], args: argparse.Namespace) -> str:
    rows, tiers = report["rows"], [t for t in args.tiers]
    parts = [
        f"{report['device']}, torch {report['torch']}, {report['model']}, cache dir on {report['filesystem']}, "
        f"{args.runs} runs after {args.warmup} warm-up, {args.question_tokens}-token question, "
        f"{args.chunk_tokens}-token chunks, {args.decode_tokens} decode tokens; batching: {report['batching']}; "
        f"{report['seconds']:.0f} s.",
        ttft_table(rows, tiers, args.batches, args.sequential),
        stage_table(rows, tiers, max(args.batches)),
        paper_table(rows, args.batches, args.sequential),
    ]
    if report.get("skipped"):
        parts.append(f"Skipped (time budget): contexts {report['skipped']}")
    return "\n\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder; default: random Qwen2-7B shape")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run with --model")
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 4096, 8192, 16384, 32768])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--tiers", nargs="+", default=list(TIERS), choices=TIERS)
    parser.add_argument(
        "--sequential", action="store_true", help="a batch of B = B requests back to back (the old, unbatched rows)"
    )
    parser.add_argument(
        "--separate-batches", action="store_true", help="with --sequential: run each batch size as its own sequence"
    )
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--question-tokens", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--precompute-batch", type=int, default=16)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--budget-s", type=float, default=None, help="start no new context after this many seconds")
    parser.add_argument("--cache-dir", type=Path, default=None, help="parent of the stores' files (/var/tmp)")
    parser.add_argument("--json", type=Path, default=None, help="written after every context")
    parser.add_argument("--markdown", type=Path, default=None, help="the tables, written after every context")
    parser.add_argument("--plot", type=Path, default=None, help="PNG: TTFT vs context, and vs batch at 8K")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if torch.device(args.device).type == "cuda" and not device.uses_cuda(args.device):
        log.error("no CUDA device: pass --device cpu --model DIR for a smoke run")
        return 2
    started = time.perf_counter()
    engine = build_engine(args.model, torch.device(args.device))
    parent = args.cache_dir or Path("/var/tmp")
    parent.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "device": device.device_name(engine.spec.device),
        "torch": torch.__version__,
        "model": args.model or "random Qwen2-7B shape, bf16",
        "max_context": engine.spec.max_context,
        "cuda_graphs": engine.stitch_graphs is not None,
        "fused_stitch": engine.fused_stitch is not None,
        "pipeline_layers": engine.pipeline_layers,
        "batching": (SEQUENTIAL if args.sequential else TRUE_BATCHES)[0],
        "batching_defaults": {"prefill_chunk": PREFILL_CHUNK, "batch_prefill_min": BATCH_PREFILL_MIN},
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "build_s": time.perf_counter() - started,
        "rows": [],
        "skipped": [],
        "seconds": 0.0,
    }
    with tempfile.TemporaryDirectory(prefix="kvstitch-bench-tables-", dir=parent) as tmp:
        report["filesystem"] = filesystem_of(Path(tmp))
        for context in args.contexts:
            if args.budget_s is not None and time.perf_counter() - started > args.budget_s:
                report["skipped"].append(context)
                continue
            row = measure_context(engine, context, args, Path(tmp))
            report["rows"].append(row)
            report["seconds"] = time.perf_counter() - started
            log.info("context %d (%d tokens) done in %.0f s", context, row["context_tokens"], row["seconds"])
            if args.json:
                args.json.write_text(json.dumps(report, indent=1))
            if args.markdown:
                args.markdown.write_text(render(report, args))
            free_device_memory(engine)
    report["seconds"] = time.perf_counter() - started
    text = render(report, args)
    sys.stdout.write(text)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    if args.markdown:
        args.markdown.write_text(text)
    if args.plot:
        batching = "sequential" if args.sequential else "true batches"
        title = f"{report['device']}, {report['model']}; {batching}; medians of {args.runs} runs"
        plot(report["rows"], list(args.tiers), args.batches, args.plot, title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
