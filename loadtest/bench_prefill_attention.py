"""Question-prefill attention over shared chunks: the by-chunk plan against the by-request plan (issue 27).

    python -m loadtest.bench_prefill_attention --json prefill.json

Qwen2-7B's attention shape (bench_segment_attention's: 28 query heads, 4 KV heads, head_dim 128, bf16), B requests
each prefilling `--rows` question tokens over `--reads` chunks of ~`--chunk-tokens` tokens drawn from `--level`
(bench_segment_attention.draw_chunks) plus its causal tail. One layer is timed as 28 layers replayed from a CUDA
graph (each reading its own copy of the data, cycled past the L2 cache), median of `--runs`. Paths:

- `by-chunk`: the decode step's plan (each chunk's readers in one program, a partial per (row, chunk), merged);
- `by-request BMxWxS/P`: the prefill's plan (a program per block of BM of one request's query items streams all
  of its chunks; W warps, S pipeline stages, 0: Triton's default; each request's chunk list in P splits, `auto`:
  as the eager plan chooses);
- `sdpa`: no sharing, for scale: each request's context as its own rotated copy (padded to the longest), read
  by torch's flash SDPA without a mask (the work of attention without its bookkeeping; not a serving path).

Every kernel path is first checked against the torch reference on a small case at the same shape. Reported per
path: ms per 28 layers and the attention's useful TFLOP/s (4 x query heads x head_dim x keys seen, summed).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from loadtest.bench_segment_attention import (
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    LAYERS,
    Workload,
    build_workload,
    copies,
    plan_error,
    qwen2_rotary,
    time_layers,
    time_plan,
)
from service.engine import segment_launch, segment_plan
from service.engine.rotary import Rotary
from service.engine.segment_launch import SegmentPlan

log = logging.getLogger("bench_prefill_attention")

SCALE = HEAD_DIM**-0.5


def parse_config(text: str) -> tuple[int, int, int]:
    """'64x4x2' -> (block_m 64, warps 4, stages 2; 0: Triton's default)."""
    parts = text.split("x")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"a by-request config is BMxWARPSxSTAGES, e.g. 64x4x2, not {text!r}")
    block_m, warps, stages = map(int, parts)
    if block_m not in (16, 32, 64, 128) or warps not in (2, 4, 8):
        raise argparse.ArgumentTypeError(f"{text!r}: block_m 16..128 (a power of two), warps 2, 4 or 8")
    return block_m, warps, stages


@contextmanager
def request_config(config: tuple[int, int, int]) -> Iterator[None]:
    """The by-request tile settings (segment_plan's width, segment_launch's warps and stages) set to `config`
    for the block, restored after."""
    saved = segment_plan.REQUEST_BLOCK_M, segment_launch.REQUEST_WARPS, segment_launch.REQUEST_STAGES
    block_m, warps, stages = config
    segment_plan.REQUEST_BLOCK_M, segment_launch.REQUEST_WARPS = block_m, warps
    segment_launch.REQUEST_STAGES = stages or None
    try:
        yield
    finally:
        segment_plan.REQUEST_BLOCK_M, segment_launch.REQUEST_WARPS, segment_launch.REQUEST_STAGES = saved


def useful_tflop(work: Workload) -> float:
    """TFLOP of one layer's attention: 4 x heads x head_dim per (query row, key it sees)."""
    batch = work.batch
    visible = batch.tail_visible()
    keys = sum(
        sum(batch.chunks[s.chunk].length for s in batch.requests[r].segments) + visible[i]
        for i, r in enumerate(batch.rows)
    )
    return 4 * HEADS * HEAD_DIM * keys / 1e12


def check(device: torch.device, rotary: Rotary, dtype: torch.dtype, by_request: bool) -> float:
    """Largest |kernel - reference| on 3 requests x 12 rows over 4 of 6 chunks, NaN past every range."""
    work = build_workload("pool6", 3, 4, 96, 40, seed=5, rows_per_request=12)
    plan = SegmentPlan.build(work.batch, HEADS // KV_HEADS, KV_HEADS, device, by_request=by_request)
    return plan_error(work, work.batch, plan, rotary, dtype, seed=1)


def time_by(
    work: Workload, rotary: Rotary, args: argparse.Namespace, by_request: bool, splits: int | None = None
) -> float:
    """`bench_segment_attention.time_plan` of the call's plan by chunk, or by request in `splits` splits."""
    plan = SegmentPlan.build(work.batch, HEADS // KV_HEADS, KV_HEADS, args.device, splits, by_request=by_request)
    return time_plan(work, plan, rotary, args, args.device.type == "cuda")


def time_sdpa(work: Workload, args: argparse.Namespace) -> float:
    """Flash SDPA over each request's own copy of its context, padded to the longest (no mask: a bound on what
    the attention itself costs at this shape, not a path the engine runs)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    device, dtype = args.device, args.dtype
    requests, rows = len(work.context), args.rows
    longest = max(work.context)
    gen = torch.Generator(device=device).manual_seed(0)
    size = (requests, KV_HEADS, longest, HEAD_DIM)
    nbytes = 2 * requests * KV_HEADS * longest * HEAD_DIM * 2
    data = [
        tuple(torch.randn(size, generator=gen, device=device, dtype=dtype) for _ in range(2))
        for _ in range(copies(nbytes, cap=2))
    ]
    q = torch.randn((requests, HEADS, rows, HEAD_DIM), generator=gen, device=device, dtype=dtype)

    def layer(index: int) -> torch.Tensor:
        k, v = data[index % len(data)]
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    return time_layers(layer, args.runs, args.warmup, device.type == "cuda", device)


def measured(fn: Callable[[], float], what: str) -> float | None:
    try:
        return fn()
    except Exception as err:  # a path this build cannot run is reported as missing, not fatal
        log.warning("%s failed: %s", what, err)
        return None


def measure(requests: int, rotary: Rotary, args: argparse.Namespace) -> dict[str, Any]:
    work = build_workload(
        args.level, requests, args.reads, args.chunk_tokens, args.rows + 24, seed=requests, rows_per_request=args.rows
    )
    row: dict[str, Any] = {"batch": requests, "tflop_per_layer": useful_tflop(work), "ms": {}}
    row["ms"]["by-chunk"] = measured(lambda: time_by(work, rotary, args, False), "by-chunk")
    for config in args.configs:
        for splits in args.splits:
            name = "by-request " + "x".join(map(str, config)) + f"/{splits or 'auto'}"
            with request_config(config):
                timed = functools.partial(time_by, work, rotary, args, True, splits or None)
                row["ms"][name] = measured(timed, name)
    if args.device.type == "cuda":
        torch.cuda.empty_cache()
        row["ms"]["sdpa"] = measured(lambda: time_sdpa(work, args), "sdpa")
        torch.cuda.empty_cache()
    return row


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: per batch and path, ms per 28 layers and useful TFLOP/s."""
    lines = ["| B | path | ms x28 | TFLOP/s |", "|---|---|---|---|"]
    for r in rows:
        for path, ms in r["ms"].items():
            rate = "—" if ms is None else f"{r['tflop_per_layer'] * LAYERS / (ms / 1e3):.0f}"
            lines.append(f"| {r['batch']} | {path} | {'—' if ms is None else f'{ms:.2f}'} | {rate} |")
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--rows", type=int, default=64, help="question tokens each request prefills")
    parser.add_argument("--reads", type=int, default=16)
    parser.add_argument("--chunk-tokens", type=int, default=520)
    parser.add_argument("--level", default="pool192", help="sharing level (bench_segment_attention.draw_chunks)")
    parser.add_argument("--configs", type=parse_config, nargs="+", default=[(64, 4, 0), (64, 8, 0), (128, 8, 0)])
    parser.add_argument("--splits", type=int, nargs="+", default=[0], help="by-request splits to try (0: auto)")
    parser.add_argument(
        "--maxnreg",
        type=int,
        default=segment_launch.REQUEST_MAXNREG,
        help="registers a thread of the by-request partials (REQUEST_MAXNREG; 0: as many as ptxas takes)",
    )
    parser.add_argument(
        "--prerotate",
        action=argparse.BooleanOptionalAction,
        default=segment_launch.REQUEST_PREROTATE,
        help="rotate the query entries before the by-request partials (segment_launch.REQUEST_PREROTATE)",
    )
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--device", type=torch.device, default=torch.device("cuda"), help="cpu: a smoke run")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    args = parser.parse_args(argv)
    args.dtype = getattr(torch, args.dtype)
    if min(args.batches) < 1 or args.rows < 1 or args.reads < 1 or args.runs < 1:
        parser.error("batches, rows, reads and runs must be positive")
    if min(args.splits) < 0:
        parser.error("splits must be 0 (auto) or positive")
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse(argv)
    segment_launch.REQUEST_PREROTATE = args.prerotate
    segment_launch.REQUEST_MAXNREG = args.maxnreg or None
    rotary = qwen2_rotary(args.device)
    errors = {"by-chunk": check(args.device, rotary, args.dtype, False)}
    for config in args.configs:
        with request_config(config):
            errors["by-request " + "x".join(map(str, config))] = check(args.device, rotary, args.dtype, True)
    print("largest |kernel - reference|:", json.dumps(errors))
    rows = []
    for requests in args.batches:
        rows.append(measure(requests, rotary, args))
        print(json.dumps(rows[-1]), flush=True)
    print(table(rows))
    if args.json is not None:
        args.json.write_text(json.dumps({"errors": errors, "rows": rows}, indent=2))
    return 0 if max(errors.values()) < 0.1 else 1


if __name__ == "__main__":
    sys.exit(main())
