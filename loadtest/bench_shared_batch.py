"""The shared-chunk path against the copy path inside the engine: decode step time and tokens/s against the batch.

    python -m loadtest.bench_shared_batch --out $OUT --batches 1 8 32 64 128 256 --chunks 192 --zipf 1.1

Builds the random bf16 Qwen2-7B-shaped engine (`bench_prefill.build_engine`), precomputes a corpus of `--chunks`
chunks of `--chunk-tokens` each once on the device, and gives every answer `--reads` of them (distinct, drawn by
Zipf popularity, or uniformly with `--zipf 0`) and a question of `--question-tokens`. Per batch size B and path,
the B requests are added to one scheduler at once and stepped to their last token (`--max-new-tokens`, EOS
ignored), as `true_batch` does but with the chunk KV already on the device (a `ChunkSource` over the corpus: no
tier, no copy in), so what differs between the paths is only where the answers' chunk KV lives and how attention
reads it:

- `copy`: the server's scheduler as built by `build_scheduler` (each answer stitches its own rotated copy of its
  chunks into its pool slab; CUDA graphs for the decode step where the engine has them, captured before timing);
- `shared`: the same with a `ChunkArena` (each chunk held once at local positions, read by segment attention),
  its decode steps through CUDA graphs (`shared_graph.py`) where the kernels run; `shared-eager`: the same with
  every step eager; `shared-by-chunk`: `shared` with the question prefill planned by chunk, as the decode step
  is (`shared_decode.PREFILL_BY_REQUEST` off), to compare the two prefill plans.

Reports per path and B: the median decode step (the scheduler's own `decode` phase at the full batch), tokens/s
over the whole batch (B x new tokens / the batch's wall time, admissions and question prefills included), the
TTFT of the batch's median request, KV pool bytes per running answer, and the distinct chunks the batch reads.
`--profile` runs the largest shared batch once more under cProfile and prints its 40 costliest functions, so host
overhead that grows with the batch shows up by name. `--kernels N` runs the largest batch of each path twice more
under torch's profiler (first token only, then whole) and prints each run's N costliest device kernels, so each
kernel's time splits between the question prefill and the decode steps.

`--ttft N` adds each path's TTFT of one request alone (`lone_ttft`): N requests one after another on an idle
scheduler (after `--warmup` runs, which capture the graphs), each timed from its admission to its first token
(question prefill and first logits; chunk KV resident). Between `shared` and `shared-eager` it isolates the
graphed question prefill (`shared_extend_graph.py`).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import logging
import pstats
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from loadtest.bench_prefill import build_engine, precompute_all, question_ids
from service.engine import shared_decode
from service.engine.batch_request import BatchRequest
from service.engine.chunk_arena import ChunkArena
from service.engine.engine import GenerationMode, StitchEngine
from service.engine.gate import synthetic_ids
from service.engine.kv_layout import KVBlock
from service.engine.kv_pool import KVPool
from service.engine.prompt import PromptIds
from service.engine.sampling import SamplingParams
from service.engine.scheduler import Scheduler
from service.engine.scheduler_config import (
    BatchingOptions,
    build_scheduler,
    graphs_on,
    release,
    scratch_slots,
    shared_scratch_slots,
)
from service.engine.stitch import BlockReady
from service.kvcache import device

log = logging.getLogger("bench_shared_batch")
PATHS = ("copy", "shared", "shared-eager", "shared-by-chunk")
LONE_SEED = 1_000_003  # the lone-TTFT requests' draws of chunks, apart from every batch's


@dataclass(frozen=True)
class Resident:
    """A fetch whose blocks are already on the device: nothing to wait for."""

    blocks: Sequence[KVBlock]
    ready: Sequence[BlockReady | None] = ()


class ResidentChunks:
    """The corpus's precomputed chunk KV as the scheduler's chunk source (the GPU tier without its bookkeeping)."""

    def __init__(self, blocks: dict[tuple[int, ...], KVBlock]) -> None:
        self.blocks = blocks

    def fetch(self, blocks: Sequence[Sequence[int]]) -> Resident:
        return Resident([self.blocks[tuple(b)] for b in blocks])


@dataclass
class Corpus:
    """Every chunk's block ids and device KV, the question, and the answers' draws of chunks."""

    blocks: list[tuple[int, ...]]
    kv: dict[tuple[int, ...], KVBlock]
    question: list[int]
    chunk_ids: list[list[int]] = field(default_factory=list)

    def prompts(self, engine: StitchEngine, count: int, reads: int, zipf: float, seed: int) -> list[PromptIds]:
        """`count` prompts of `reads` distinct chunks each, drawn by popularity rank^-zipf (uniform at 0)."""
        rng = np.random.default_rng(seed)
        weights = 1.0 / np.arange(1, len(self.chunk_ids) + 1) ** zipf
        weights /= weights.sum()
        prompts = []
        for _ in range(count):
            picked = rng.choice(len(self.chunk_ids), size=reads, replace=False, p=weights)
            prompts.append(engine.template.prompt([self.chunk_ids[i] for i in picked], self.question))
        return prompts


def build_corpus(engine: StitchEngine, args: argparse.Namespace) -> Corpus:
    chunk_ids = synthetic_ids(engine, [args.chunk_tokens] * args.chunks, seed=7)
    question = question_ids(engine, args.question_tokens)
    blocks = [engine.template.prompt([ids], question).blocks[0] for ids in chunk_ids]
    kv, seconds = precompute_all(engine, blocks, 8)
    log.info("precomputed %d chunks (%d tokens) in %.1f s", len(blocks), sum(len(b) for b in blocks), seconds)
    return Corpus(blocks, {b: k for b, k in zip(blocks, kv, strict=True)}, question, chunk_ids)


def scheduler_for(
    engine: StitchEngine, prompts: Sequence[PromptIds], sampling: SamplingParams, path: str, corpus: Corpus
) -> Scheduler:
    """The server's scheduler for these requests at once: a pool that holds every one (on the shared path their
    tails only), the arena the corpus (shared), graphs captured before timing (copy path, CUDA)."""
    per_token = engine.spec.kv_bytes_per_token()
    arena = None
    if path.startswith("shared"):
        tails = sum(len(p.prefix) + len(p.question) + sampling.max_new_tokens for p in prompts)
        slots = tails + 64 * len(prompts) + shared_scratch_slots(engine)
        chunk_tokens = sum(len(b) for b in corpus.blocks)
        arena = ChunkArena(engine.spec, engine.forward.rotary, (chunk_tokens + 4096) * per_token, engine.chunk_start)
    else:
        slots = sum(len(p.joined()) + sampling.max_new_tokens for p in prompts) + scratch_slots(engine)
    pool = KVPool(engine.spec, slots * per_token)
    scheduler = build_scheduler(
        engine, pool, BatchingOptions(max_batch=len(prompts)), kv_source=ResidentChunks(corpus.kv), arena=arena
    )
    if path == "shared-eager" and scheduler.shared is not None:
        scheduler.shared.close()  # its graphs dropped: every step and question prefill eager
    if path == "copy" and graphs_on(engine):
        for length in {n for p in prompts for n in (len(p.joined()) + 1, len(p.joined()) + sampling.max_new_tokens)}:
            scheduler.warm(length)
    return scheduler


def run_once(scheduler: Scheduler, prompts: Sequence[PromptIds], sampling: SamplingParams) -> dict[str, Any]:
    """Add every prompt at once, step to the end; the batch's figures."""
    requests = [BatchRequest(p, sampling, GenerationMode.TURBO) for p in prompts]
    device.synchronize(scheduler.engine.spec.device)
    started = time.perf_counter()
    for request in requests:
        scheduler.add(request)
    steps: list[tuple[int, float]] = []
    busy = scheduler.runner.busy_s
    while scheduler.has_work():
        before = busy["decode"]
        scheduler.step()
        if scheduler.runner.last_batch:
            steps.append((scheduler.runner.last_batch, busy["decode"] - before))
    device.synchronize(scheduler.engine.spec.device)
    wall = time.perf_counter() - started
    for request in requests:
        if request.error is not None:
            raise request.error
    full = [s * 1e3 for n, s in steps if n == len(prompts)]
    tokens = sum(len(r.result.token_ids) for r in requests)
    return {
        "decode_ms_per_step": statistics.median(full) if full else float("nan"),
        "full_steps": len(full),
        "tokens_per_s": tokens / wall,
        "batch_s": wall,
        "ttft_p50_ms": statistics.median((r.first_token_at - started) * 1e3 for r in requests),
    }


@contextmanager
def prefill_plan(path: str) -> Iterator[None]:
    """The question prefill planned by chunk on `shared-by-chunk`, by request elsewhere, for the block."""
    saved, shared_decode.PREFILL_BY_REQUEST = shared_decode.PREFILL_BY_REQUEST, path != "shared-by-chunk"
    try:
        yield
    finally:
        shared_decode.PREFILL_BY_REQUEST = saved


def measure(engine: StitchEngine, corpus: Corpus, path: str, count: int, args: argparse.Namespace) -> dict[str, Any]:
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    prompts = corpus.prompts(engine, count, args.reads, args.zipf, seed=count)
    scheduler = scheduler_for(engine, prompts, sampling, path, corpus)
    try:
        runs = [run_once(scheduler, prompts, sampling) for _ in range(args.warmup + args.runs)][args.warmup :]
        row = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        row["pool_bytes_per_answer"] = scheduler.pool.capacity_bytes / count
        row["distinct_chunks"] = len({b for p in prompts for b in p.blocks})
        if engine.spec.device.type == "cuda":  # the device's peak so far: weights, corpus, pool, arena, activations
            row["peak_device_gib"] = torch.cuda.max_memory_allocated(engine.spec.device) / 2**30
            row["device_gib"] = torch.cuda.get_device_properties(engine.spec.device).total_memory / 2**30
        if args.profile and path.startswith("shared") and count == max(args.batches):
            row["profile"] = profiled(scheduler, prompts, sampling)
        if args.kernels and count == max(args.batches):
            row["kernels"] = kernel_table(scheduler, prompts, sampling, args.kernels)
        return row
    finally:
        release(scheduler)
        if engine.spec.device.type == "cuda":
            torch.cuda.empty_cache()


def lone_ttft(engine: StitchEngine, corpus: Corpus, path: str, args: argparse.Namespace) -> dict[str, Any]:
    """TTFT of one request alone: `--ttft` requests (their own draws of chunks) one after another on an idle
    scheduler, after `--warmup` runs of the first; each stops at its first token."""
    sampling = SamplingParams(max_new_tokens=1, ignore_eos=True)
    prompts = corpus.prompts(engine, args.ttft, args.reads, args.zipf, seed=LONE_SEED)
    scheduler = scheduler_for(engine, prompts[:1], sampling, path, corpus)
    try:
        for _ in range(args.warmup):
            run_once(scheduler, prompts[:1], sampling)
        ttft = [run_once(scheduler, [p], sampling)["ttft_p50_ms"] for p in prompts]
    finally:
        release(scheduler)
        if engine.spec.device.type == "cuda":
            torch.cuda.empty_cache()
    ordered = sorted(ttft)
    return {
        "path": path,
        "requests": len(ttft),
        "ttft_p50_ms": statistics.median(ttft),
        "ttft_p90_ms": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
        "ttft_min_ms": ordered[0],
    }


def profiled(scheduler: Scheduler, prompts: Sequence[PromptIds], sampling: SamplingParams) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    run_once(scheduler, prompts, sampling)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(40)
    return text.getvalue()


def kernel_table(scheduler: Scheduler, prompts: Sequence[PromptIds], sampling: SamplingParams, top: int) -> str:
    """The batch twice more under torch's profiler, its `top` device kernels by total device time each: first
    answering one token only (admission and question prefill), then whole (the difference is the decode steps),
    so each phase's share of a kernel (segment attention, GEMMs, merges, copies) shows."""
    first_only = SamplingParams(max_new_tokens=1, ignore_eos=True)
    tables = [_profiled_kernels(scheduler, prompts, first_only, top, "first token only (prefill)")]
    tables.append(_profiled_kernels(scheduler, prompts, sampling, top, f"{sampling.max_new_tokens} tokens (whole)"))
    return "\n".join(tables)


def _profiled_kernels(
    scheduler: Scheduler, prompts: Sequence[PromptIds], sampling: SamplingParams, top: int, what: str
) -> str:
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    began = time.perf_counter()
    with profile(activities=activities) as recorded:
        run_once(scheduler, prompts, sampling)
    wall_ms = (time.perf_counter() - began) * 1e3
    kernels = recorded.key_averages().table(sort_by="device_time_total", row_limit=top)
    return f"{len(prompts)} answers, {what}: {wall_ms:.0f} ms wall under the profiler\n{kernels}"


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| batch | path | distinct chunks | decode step (ms) | tokens/s | TTFT p50 (ms) | batch (s) "
        "| pool MiB/answer |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['batch']} | {r['path']} | | failed: {r['error']} | | | | |")
            continue
        lines.append(
            f"| {r['batch']} | {r['path']} | {r['distinct_chunks']} | {r['decode_ms_per_step']:.2f} | "
            f"{r['tokens_per_s']:,.0f} | {r['ttft_p50_ms']:.1f} | {r['batch_s']:.2f} | "
            f"{r['pool_bytes_per_answer'] / 2**20:.1f} |"
        )
    return "\n".join(lines)


def ttft_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| path | lone requests | TTFT p50 (ms) | p90 | min |", "|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['path']} | failed: {r['error']} | | | |")
            continue
        lines.append(
            f"| {r['path']} | {r['requests']} | {r['ttft_p50_ms']:.2f} | {r['ttft_p90_ms']:.2f} | "
            f"{r['ttft_min_ms']:.2f} |"
        )
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder; default: random Qwen2-7B shape")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    parser.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    parser.add_argument("--chunks", type=int, default=192, help="distinct chunks in the corpus")
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--reads", type=int, default=16, help="chunks per answer")
    parser.add_argument("--zipf", type=float, default=1.1, help="popularity exponent; 0 = uniform")
    parser.add_argument("--question-tokens", type=int, default=51)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--kernels",
        type=int,
        default=0,
        metavar="N",
        help="the largest batch twice more under torch's profiler, answering its first token only and then "
        "whole: each run's N costliest device kernels, per path",
    )
    parser.add_argument("--ttft", type=int, default=0, metavar="N", help="each path's TTFT of N lone requests")
    parser.add_argument("--out", type=Path, default=Path("bench-shared-out"))
    args = parser.parse_args(argv)
    if args.reads > args.chunks:
        parser.error("--reads must not exceed --chunks")
    if args.kernels < 0:
        parser.error("--kernels takes a count of kernels to list, 0 (none) or more")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    target = torch.device(args.device)
    if target.type == "cuda" and not torch.cuda.is_available():
        log.error("no CUDA device: pass --device cpu --model DIR for a smoke run")
        return 2
    engine = build_engine(args.model, target)
    corpus = build_corpus(engine, args)
    rows: list[dict[str, Any]] = []
    for count in args.batches:
        for path in args.paths:
            try:
                with prefill_plan(path):
                    row = measure(engine, corpus, path, count, args)
            except (RuntimeError, ValueError) as err:  # out of memory, a plan over capacity: reported, not fatal
                log.exception("batch %d path %s failed", count, path)
                row = {"error": f"{type(err).__name__}: {str(err)[:120]}"}
            rows.append({"batch": count, "path": path, **row})
            log.info("%s", {k: v for k, v in rows[-1].items() if k not in ("profile", "kernels")})
    lone = [lone_row(engine, corpus, path, args) for path in args.paths] if args.ttft > 0 else []
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"args": vars(args) | {"out": str(args.out)}, "rows": rows, "ttft": lone}
    (args.out / "report.json").write_text(json.dumps(report))
    for row in rows:
        for key in ("profile", "kernels"):
            if key in row:
                print(f"## {row['path']}, {row['batch']} answers: {key}\n{row[key]}")
    print(table(rows))
    if lone:
        print(ttft_table(lone))
    return 0


def lone_row(engine: StitchEngine, corpus: Corpus, path: str, args: argparse.Namespace) -> dict[str, Any]:
    try:
        with prefill_plan(path):
            row = lone_ttft(engine, corpus, path, args)
    except (RuntimeError, ValueError) as err:
        log.exception("lone TTFT on path %s failed", path)
        return {"path": path, "error": f"{type(err).__name__}: {str(err)[:120]}"}
    log.info("lone TTFT %s", row)
    return row


if __name__ == "__main__":
    raise SystemExit(main())
