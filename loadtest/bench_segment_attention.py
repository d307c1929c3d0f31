"""Decode-step attention over shared chunks (segment_launch.py) against the copy path, on random data (issue 27).

    python -m loadtest.bench_segment_attention --json seg.json

Qwen2-7B's attention shape (28 query heads, 4 KV heads, head_dim 128, bf16), one layer timed as 28 layers run back
to back (each "layer" reads its own copy of the data, cycled so the working set is larger than the L2 cache). B
requests each read `--reads` chunks of ~`--chunk-tokens` tokens plus a tail of ~`--tail-tokens`, at three sharing
levels: every request reads the same chunks (`same`), chunks drawn from 192 (`pool192`), from 4,000 by Zipf 1.1
(`zipf4000`). The copy path is what runs today: each request's own stitched slab (its context copied and rotated,
then its tail) read by batch_decode's decode attention, flash varlen through torch's own flash op where it runs and
sdpa_gather. Times are the median of `--runs` CUDA-event timings of the 28 layers replayed from a CUDA graph (as
the engine runs a decode step); the segment path also eagerly (its launches timed too). KV bytes held per running
answer cover all 28 layers: the copy path's slab; the segment path's tail plus its share (1/B) of the distinct
chunks the batch reads. Building the plan on the host (once per step, shared by the layers) is reported apart.

Before timing, the kernels are checked against the torch reference (segment_attention.py) on a small case at the
same shape, and the largest absolute error is printed.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen2Config
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

from service.engine import segment_launch, segment_plan, shared_graph
from service.engine.attention import FLASH_VARLEN
from service.engine.batch_decode import SDPA_GATHER, DecodeRows, batch_attention
from service.engine.fused_stitch import triton_runs_on
from service.engine.rotary import Rotary
from service.engine.segment_attention import (
    ChunkRange,
    RequestSegments,
    Segment,
    SegmentBatch,
    Tail,
    reference_attention,
)
from service.engine.segment_launch import SegmentAttention, SegmentPlan

log = logging.getLogger("bench_segment_attention")

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 28, 4, 128, 28
LEVELS = ("same", "pool192", "zipf4000")  # see draw_chunks
PREFIX_TOKENS = 24  # template prefix at the head of every tail; chunks are placed after it
L2_SPAN_BYTES = 256 << 20  # data cycled through between two reads of one layer's copy (an H100 has 50 MB of L2)


@dataclass(frozen=True)
class Workload:
    """One batch: the call's metadata, the chunk lengths (arena order) and each request's stitched length."""

    batch: SegmentBatch
    chunk_lengths: list[int]
    context: list[int]  # per request: chunk tokens + tail tokens (its copy-path slab)

    @property
    def arena_tokens(self) -> int:
        return sum(self.chunk_lengths)

    @property
    def tail_tokens(self) -> int:
        return sum(r.tail.used for r in self.batch.requests)


def draw_chunks(level: str, requests: int, reads: int, gen: torch.Generator) -> list[list[int]]:
    """Chunk ids each request reads (distinct within a request): the first `reads` for everyone (`same`), drawn
    uniformly (`poolN`) or by Zipf 1.1 (`zipfN`) from N chunks."""
    if level == "same":
        return [list(range(reads)) for _ in range(requests)]
    match = re.fullmatch(r"(pool|zipf)(\d+)", level)
    if match is None or int(match[2]) < reads:
        raise ValueError(f"sharing level {level!r}: same, poolN or zipfN with N >= {reads}")
    kind, universe = match[1], int(match[2])
    weights = torch.ones(universe, dtype=torch.float64)
    if kind == "zipf":
        weights = torch.arange(1, universe + 1, dtype=torch.float64) ** -1.1
    return [torch.multinomial(weights, reads, replacement=False, generator=gen).tolist() for _ in range(requests)]


def build_workload(
    level: str, requests: int, reads: int, chunk_tokens: int, tail_tokens: int, seed: int, rows_per_request: int = 1
) -> Workload:
    """Chunk lengths chunk_tokens +- 4 %, tails tail_tokens +- 10 % (the prefix, the question, the answer so far);
    each request places its chunks back to back after the prefix, its query rows the last tail slots."""
    gen = torch.Generator().manual_seed(seed)
    picks = draw_chunks(level, requests, reads, gen)
    index: dict[int, int] = {}
    ranges: list[ChunkRange] = []
    lengths: list[int] = []
    spread_c, spread_t = max(1, chunk_tokens // 25), max(1, tail_tokens // 10)
    placed: list[RequestSegments] = []
    rows: list[int] = []
    positions: list[int] = []
    context: list[int] = []
    tail_start = 0
    for r, chunk_ids in enumerate(picks):
        segments, offset = [], PREFIX_TOKENS
        for chunk in chunk_ids:
            if chunk not in index:
                index[chunk] = len(ranges)
                length = chunk_tokens + int(torch.randint(-spread_c, spread_c + 1, (1,), generator=gen))
                ranges.append(ChunkRange(sum(lengths), length, PREFIX_TOKENS))
                lengths.append(length)
            segments.append(Segment(index[chunk], offset))
            offset += lengths[index[chunk]]
        used = max(
            PREFIX_TOKENS + rows_per_request,
            tail_tokens + int(torch.randint(-spread_t, spread_t + 1, (1,), generator=gen)),
        )
        placed.append(RequestSegments(tuple(segments), Tail(tail_start, used)))
        last = offset + used - PREFIX_TOKENS  # one past the position of the tail's last token
        rows += [r] * rows_per_request
        positions += range(last - rows_per_request, last)
        context.append(offset - PREFIX_TOKENS + used)
        tail_start += used
    return Workload(SegmentBatch(tuple(ranges), tuple(placed), tuple(rows), tuple(positions)), lengths, context)


def qwen2_rotary(device: torch.device) -> Rotary:
    """Qwen2-7B's rotary embedding (head_dim 128, theta 1e6), built from its config."""
    config = Qwen2Config(
        hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, rope_theta=1e6
    )
    return Rotary(Qwen2RotaryEmbedding(config).to(device), HEAD_DIM, device)


def random_kv(slots: int, device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn((2, KV_HEADS, slots, HEAD_DIM), generator=gen, device=device, dtype=dtype)


def check_kernels(device: torch.device, rotary: Rotary, dtypes: tuple[torch.dtype, ...]) -> dict[str, float]:
    """Largest |kernels - reference| per dtype on a small case at the real shape: 6 requests reading 3 of 5 chunks
    (shared), the last one a 3-row prefill, NaN around every range the call names."""
    work = build_workload("pool5", 6, 3, 96, 40, seed=7)
    batch = _with_prefill(work.batch, rows=3)
    plan = SegmentPlan.build(batch, HEADS // KV_HEADS, KV_HEADS, device)
    return {str(dtype).removeprefix("torch."): plan_error(work, batch, plan, rotary, dtype, 3) for dtype in dtypes}


def plan_error(
    work: Workload, batch: SegmentBatch, plan: SegmentPlan, rotary: Rotary, dtype: torch.dtype, seed: int
) -> float:
    """Largest |kernels - reference| of `plan` (of `batch`, over `work`'s chunks and tails) on random `dtype` data,
    80 NaN slots past the arena and the tails so that a read past any range shows."""
    device = plan.q_rows.device
    gen = torch.Generator(device=device).manual_seed(seed)
    arena = torch.full((2, KV_HEADS, work.arena_tokens + 80, HEAD_DIM), float("nan"), device=device, dtype=dtype)
    arena[:, :, : work.arena_tokens] = random_kv(work.arena_tokens, device, dtype, gen)
    pool = torch.full((2, KV_HEADS, work.tail_tokens + 80, HEAD_DIM), float("nan"), device=device, dtype=dtype)
    pool[:, :, : work.tail_tokens] = random_kv(work.tail_tokens, device, dtype, gen)
    q = torch.randn((len(batch.rows), HEADS, HEAD_DIM), generator=gen, device=device, dtype=dtype)
    scale = HEAD_DIM**-0.5
    want = reference_attention(q, batch, arena, pool, rotary, scale)
    got = SegmentAttention(plan, rotary)(q, arena, pool, scale)
    return float((got.float() - want.float()).abs().max())


def _with_prefill(batch: SegmentBatch, rows: int) -> SegmentBatch:
    """`batch` with its last row turned into `rows` causal rows of the same request (the last tail slots)."""
    last = batch.rows[-1]
    position = batch.positions[-1]
    return SegmentBatch(
        batch.chunks,
        batch.requests,
        batch.rows[:-1] + (last,) * rows,
        batch.positions[:-1] + tuple(range(position - rows + 1, position + 1)),
    )


def time_layers(fn: Callable[[int], Any], runs: int, warmup: int, graph: bool, device: torch.device) -> float:
    """Median ms of LAYERS calls fn(0) .. fn(LAYERS - 1), from a CUDA graph of them when `graph` (wall clock on
    the CPU, a smoke run's)."""
    for _ in range(warmup):
        for layer in range(LAYERS):
            fn(layer)
    step: Callable[[], Any] = lambda: [fn(layer) for layer in range(LAYERS)]  # noqa: E731
    if device.type != "cuda":
        if graph:
            raise ValueError("CUDA graphs need a CUDA device")
        return float(statistics.median(_wall_ms(step) for _ in range(runs)))
    torch.cuda.synchronize()
    if graph:
        captured = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()  # warm the side stream's allocator before capture
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(captured):
            step()
        step = captured.replay
        step()
    times = []
    for _ in range(runs):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(statistics.median(times))


def _wall_ms(step: Callable[[], Any]) -> float:
    started = time.perf_counter()
    step()
    return (time.perf_counter() - started) * 1e3


def copies(nbytes: int, cap: int = LAYERS) -> int:
    """Copies of one layer's data to cycle through so that L2_SPAN_BYTES pass between two reads of one copy."""
    return max(1, min(cap, -(-L2_SPAN_BYTES // max(nbytes, 1))))


def time_segment(work: Workload, rotary: Rotary, args: argparse.Namespace, graph: bool) -> float:
    plan = SegmentPlan.build(work.batch, HEADS // KV_HEADS, KV_HEADS, args.device, args.pieces)
    return time_plan(work, plan, rotary, args, graph)


def time_padded(work: Workload, rotary: Rotary, args: argparse.Namespace, programs: int) -> float:
    """The plan as a captured decode step runs it: padded to its graph bucket's capacity (`shared_graph`), its
    launches holding `programs` programs per KV head at most (0: one per tile, live or dead)."""
    requests = len(work.context)
    bucket = next((b for b in shared_graph.SHARED_BUCKETS if b >= requests), None)
    if bucket is None:
        raise ValueError(f"no decode graph holds {requests} rows")
    pieces = shared_graph.pieces_for(bucket)
    capacity = shared_graph.capacity_for(bucket, shared_graph.reads_bucket(args.reads), pieces)
    before = segment_launch.PADDED_PROGRAMS
    segment_launch.PADDED_PROGRAMS = programs or None
    try:
        plan = SegmentPlan.build(work.batch, HEADS // KV_HEADS, KV_HEADS, args.device, pieces, capacity)
    finally:
        segment_launch.PADDED_PROGRAMS = before
    return time_plan(work, plan, rotary, args, graph=True)


def time_plan(work: Workload, plan: SegmentPlan, rotary: Rotary, args: argparse.Namespace, graph: bool) -> float:
    """Median ms of `plan` (of `work`'s call) run for LAYERS layers, each over its own copy of random chunks and
    tails (`copies`), from a CUDA graph when `graph`."""
    device, dtype = args.device, args.dtype
    gen = torch.Generator(device=device).manual_seed(0)
    kv_bytes = (work.arena_tokens + work.tail_tokens) * 2 * KV_HEADS * HEAD_DIM * 2
    data = [
        (random_kv(work.arena_tokens, device, dtype, gen), random_kv(work.tail_tokens, device, dtype, gen))
        for _ in range(copies(kv_bytes))
    ]
    q = torch.randn((len(work.batch.rows), HEADS, HEAD_DIM), generator=gen, device=device, dtype=dtype)
    attend = SegmentAttention(plan, rotary)
    scale = HEAD_DIM**-0.5
    return time_layers(lambda layer: attend(q, *data[layer % len(data)], scale), args.runs, args.warmup, graph, device)


def kernel_breakdown(work: Workload, rotary: Rotary, args: argparse.Namespace) -> dict[str, float]:
    """Device ms per step (LAYERS layers, replayed from a CUDA graph) of each launch of the segment path on its
    own: the chunk partials by query-block width, the tails, the merge. Says where the step's time goes."""
    plan = SegmentPlan.build(work.batch, HEADS // KV_HEADS, KV_HEADS, args.device, args.pieces)
    gen = torch.Generator(device=args.device).manual_seed(0)
    arena = random_kv(work.arena_tokens, args.device, args.dtype, gen)
    tails = random_kv(work.tail_tokens, args.device, args.dtype, gen)
    q = torch.randn((len(work.batch.rows), HEADS, HEAD_DIM), generator=gen, device=args.device, dtype=args.dtype)
    attend = SegmentAttention(plan, rotary)
    scale = HEAD_DIM**-0.5
    launches, merge = attend.launches(q, arena, tails, scale)
    phases: dict[str, Callable[[], Any]] = {
        kind if launch is None else f"{kind} m{launch.block_m} x{launch.programs}": run
        for kind, launch, run in launches
    }
    phases["merge"] = merge
    phases["whole"] = lambda: attend(q, arena, tails, scale)
    return {
        name: round(time_layers(_each_layer(run), args.runs, args.warmup, True, args.device), 3)
        for name, run in phases.items()
    }


def _each_layer(run: Callable[[], Any]) -> Callable[[int], Any]:
    """`run` as `time_layers` calls a layer (the same launch for every layer: one copy of the data)."""
    return lambda _layer: run()


def time_copy(work: Workload, backend: str, args: argparse.Namespace, graph: bool) -> float:
    """The copy path: request b's stitched slab (context[b] live slots, end to end in one pool) read by
    batch_decode's decode attention."""
    device, dtype = args.device, args.dtype
    gen = torch.Generator(device=device).manual_seed(0)
    slots = sum(work.context)
    pools = [random_kv(slots, device, dtype, gen) for _ in range(copies(slots * 2 * KV_HEADS * HEAD_DIM * 2))]
    starts = [sum(work.context[:b]) for b in range(len(work.context))]
    spans = list(zip(starts, work.context, strict=True))
    batch = len(spans)
    rows = DecodeRows.build([0] * batch, [c - 1 for c in work.context], spans, device)
    attend = batch_attention(backend, rows, slots)
    q = torch.randn((batch, HEADS, HEAD_DIM), generator=gen, device=device, dtype=dtype)
    scale = HEAD_DIM**-0.5

    def layer(index: int) -> torch.Tensor:
        kv = pools[index % len(pools)]
        return attend(q, kv[0], kv[1], scale)

    return time_layers(layer, args.runs, args.warmup, graph, device)


def kv_bytes_per_answer(work: Workload) -> tuple[float, float]:
    """MiB of KV (all LAYERS) a running answer holds: the copy path's slab; the segment path's tail plus its
    share of the distinct chunks the batch reads."""
    per_token = LAYERS * 2 * KV_HEADS * HEAD_DIM * 2
    requests = len(work.context)
    copy = sum(work.context) / requests * per_token
    segment = (work.tail_tokens + work.arena_tokens) / requests * per_token
    return copy / (1 << 20), segment / (1 << 20)


def timed_or_none(fn: Callable[[], float], what: str) -> float | None:
    try:
        return fn()
    except Exception as err:  # a path this build cannot run is reported as missing, not fatal
        log.warning("%s failed: %s", what, err)
        return None


def measure(level: str, requests: int, rotary: Rotary, args: argparse.Namespace) -> dict[str, Any]:
    work = build_workload(level, requests, args.reads, args.chunk_tokens, args.tail_tokens, seed=requests)
    started = time.perf_counter()
    plan = SegmentPlan.build(work.batch, HEADS // KV_HEADS, KV_HEADS, args.device, args.pieces)
    plan_ms = (time.perf_counter() - started) * 1e3
    row: dict[str, Any] = {"level": level, "batch": requests, "distinct_chunks": len(work.chunk_lengths)}
    row["plan_ms"] = plan_ms
    # The plan's shape: partials written and merged, chunk tiles by query-block width (programs = tiles x KV heads).
    row["pairs"] = plan.pairs
    row["chunk_tiles"] = {launch.block_m: launch.tiles.shape[0] for launch in plan.chunks}
    graph = args.device.type == "cuda"  # a CPU smoke run times everything eagerly, under the same keys
    if args.profile and graph:
        row["kernels_ms_per_step"] = kernel_breakdown(work, rotary, args)
    if args.segment_only:
        row["segment_graph_ms"] = timed_or_none(functools.partial(time_segment, work, rotary, args, graph), "segment")
        return row
    row["segment_graph_ms"] = timed_or_none(functools.partial(time_segment, work, rotary, args, graph), "segment")
    row["segment_eager_ms"] = timed_or_none(functools.partial(time_segment, work, rotary, args, False), "eager")
    if graph:
        row["segment_padded_ms"] = {
            str(n): timed_or_none(functools.partial(time_padded, work, rotary, args, n), f"padded {n}")
            for n in args.padded_programs
        }
    for backend in (FLASH_VARLEN, SDPA_GATHER):
        copy = functools.partial(time_copy, work, backend, args, graph)
        row[f"copy_{backend}_graph_ms"] = timed_or_none(copy, f"copy {backend}")
        if graph:
            torch.cuda.empty_cache()
    row["kv_mib_copy"], row["kv_mib_segment"] = kv_bytes_per_answer(work)
    return row


def _ms(value: float | None, layers: int = 1) -> str:
    return "—" if value is None else f"{value / layers:.3f}"


def _padded(row: dict[str, Any]) -> str:
    timed = row.get("segment_padded_ms") or {}
    return ", ".join(f"{_ms(ms)} ({'per tile' if n == '0' else n})" for n, ms in timed.items()) or "—"


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: per sharing level and batch, ms per layer and per step (x28) of each path (graph replay), the
    eager segment step, the speedup over the faster copy path, KV MiB held per running answer, the host plan."""
    head = (
        "| sharing | B | distinct chunks | segment ms/layer | segment ms x28 | copy flash ms x28 | copy gather ms x28"
        " | speedup | segment eager ms x28 | KV MiB/answer copy | KV MiB/answer segment | plan ms (host)"
        " | padded as a graph's, ms x28 (programs per KV head) |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        segment, flash, gather = r["segment_graph_ms"], r["copy_flash_varlen_graph_ms"], r["copy_sdpa_gather_graph_ms"]
        copy = min((v for v in (flash, gather) if v is not None), default=None)
        speedup = f"{copy / segment:.1f}x" if copy is not None and segment else "—"
        lines.append(
            f"| {r['level']} | {r['batch']} | {r['distinct_chunks']} | {_ms(segment, LAYERS)} | {_ms(segment)}"
            f" | {_ms(flash)} | {_ms(gather)} | {speedup} | {_ms(r['segment_eager_ms'])}"
            f" | {r['kv_mib_copy']:.0f} | {r['kv_mib_segment']:.1f} | {r['plan_ms']:.1f} | {_padded(r)} |"
        )
    return head + "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    parser.add_argument("--levels", nargs="+", default=list(LEVELS), help="same, poolN, zipfN (see draw_chunks)")
    parser.add_argument("--reads", type=int, default=16, help="chunks each request reads")
    parser.add_argument("--chunk-tokens", type=int, default=520)
    parser.add_argument("--tail-tokens", type=int, default=100)
    parser.add_argument("--pieces", type=int, default=None, help="ranges each chunk is cut into (default: auto)")
    parser.add_argument("--max-block-m", type=int, default=None, help="query items per tile at most (default: 64)")
    parser.add_argument("--block-n", type=int, default=None, help="keys per K/V tile (default: 64)")
    parser.add_argument("--stages", type=int, default=None, help="Triton pipeline stages (default: Triton's)")
    parser.add_argument(
        "--maxnreg",
        type=int,
        default=segment_launch.PARTIALS_MAXNREG,
        help="registers a thread of the partials (segment_launch.PARTIALS_MAXNREG; 0: as many as ptxas takes)",
    )
    parser.add_argument(
        "--prerotate",
        action=argparse.BooleanOptionalAction,
        default=segment_launch.PREROTATE,
        help="rotate every query entry once before the partials (segment_launch.PREROTATE) instead of in each tile",
    )
    parser.add_argument(
        "--kv-descriptors",
        action=argparse.BooleanOptionalAction,
        default=segment_launch.KV_DESCRIPTORS,
        help="read K/V tiles through a tensor descriptor, TMA on Hopper (segment_launch.KV_DESCRIPTORS)",
    )
    parser.add_argument(
        "--padded-programs",
        type=int,
        nargs="*",
        default=[],
        help="also time the plan padded as its decode graph's (shared_graph's bucket), with at most N programs "
        "per KV head a launch (0: one per tile), once per N",
    )
    parser.add_argument("--profile", action="store_true", help="also each launch's device ms per step, alone (CUDA)")
    parser.add_argument(
        "--segment-only", action="store_true", help="time the segment path's graph only (a parameter sweep)"
    )
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--device", type=torch.device, default=torch.device("cuda"), help="cpu: a smoke run")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    args = parser.parse_args(argv)
    if any(n < 0 for n in args.padded_programs):
        parser.error("--padded-programs takes counts of programs per KV head, 0 (one per tile) or more")
    args.dtype = getattr(torch, args.dtype)
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse(argv)
    device = args.device
    # The CPU runs the kernels only under Triton's interpreter (a smoke run of this script, TRITON_INTERPRET=1).
    interpreter = device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
    if (device.type == "cuda" and not torch.cuda.is_available()) or not triton_runs_on(device, interpreter):
        log.error("this benchmark needs a CUDA device and triton (or TRITON_INTERPRET=1 with --device cpu)")
        return 1
    if args.max_block_m is not None:
        segment_plan.MAX_BLOCK_M = args.max_block_m
    if args.block_n is not None:
        segment_launch.BLOCK_N = args.block_n
    segment_launch.NUM_STAGES = args.stages
    segment_launch.PARTIALS_MAXNREG = args.maxnreg or None
    segment_launch.PREROTATE = args.prerotate
    segment_launch.KV_DESCRIPTORS = args.kv_descriptors
    rotary = qwen2_rotary(device)
    # Triton's interpreter multiplies bf16 tiles wrongly: a CPU smoke run checks fp16 and fp32 only.
    dtypes = (torch.float16, torch.float32) if interpreter else (torch.bfloat16, torch.float16, torch.float32)
    errors = check_kernels(device, rotary, dtypes)
    print("kernels vs torch reference, max abs error: " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))
    rows = []
    for level in args.levels:
        for requests in args.batches:
            row = measure(level, requests, rotary, args)
            log.info("%s", json.dumps(row))
            rows.append(row)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (Triton interpreter)"
    report = {"device": name, "torch": torch.__version__, "errors": errors, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    if not args.segment_only:
        sys.stdout.write(table(rows) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
