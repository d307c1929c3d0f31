"""The recompute's attention alone: `slot_attention`'s kernel against masked SDPA (`attend_at_slots`), one layer.

    python -m loadtest.bench_slot_attention --context 8192 --shares 0.1 0.2 0.3 --runs 20

A Qwen2-7B head shape (28 query heads, 4 KV heads, 128 dims) in bf16 on the GPU: a KV buffer of --context slots,
the chosen slots a random share of them (sorted, as a recompute's are), q strided as the projection leaves it.
Per share: SDPA in the recompute's groups (`slot_groups`), then the kernel for every (items, keys per tile, warps)
of --configs; median ms of --runs after warm-up, the largest difference from SDPA, and TFLOP/s counted over the
keys each query sees (its slot + 1), so every row is measured against the same work.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys

import torch

from service.engine import slot_attention
from service.engine.attention import attend_at_slots, slot_groups


def _time(fn: object, runs: int) -> float:
    call = fn  # a zero-argument callable
    for _ in range(3):
        call()  # type: ignore[operator]
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()  # type: ignore[operator]
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def bench_share(args: argparse.Namespace, share: float) -> list[str]:
    generator = torch.Generator(device="cuda").manual_seed(0)
    heads, kv_heads, dim, context = args.heads, args.kv_heads, args.head_dim, args.context
    kv = torch.randn((2, kv_heads, context, dim), generator=generator, device="cuda").to(torch.bfloat16)
    count = int(share * context)
    slots = torch.sort(torch.randperm(context, generator=generator, device="cuda")[:count]).values
    wide = torch.randn((1, count, heads + 2 * kv_heads, dim), generator=generator, device="cuda")
    q = wide.to(torch.bfloat16)[:, :, :heads].transpose(1, 2)
    scale = dim**-0.5
    flops = 4 * heads * dim * float((slots + 1).sum())
    groups = slot_groups(slots.tolist())
    sdpa_ms = _time(lambda: attend_at_slots(q, kv[0], kv[1], slots, scale, groups), args.runs)
    want = attend_at_slots(q, kv[0], kv[1], slots, scale, groups).float()
    rows = [f"| {share:g} | {count} | SDPA, {len(groups)} groups | {sdpa_ms:.3f} | {flops / sdpa_ms / 1e9:.0f} | 0 |"]
    for config in args.configs:
        items, block_n, warps = (int(x) for x in config.split("/"))
        slot_attention.BLOCK_ITEMS, slot_attention.BLOCK_N, slot_attention.NUM_WARPS = items, block_n, warps
        ms = _time(lambda: slot_attention.attend_slots_kernel(q, kv[0], kv[1], slots, scale), args.runs)
        diff = float((slot_attention.attend_slots_kernel(q, kv[0], kv[1], slots, scale).float() - want).abs().max())
        rows.append(f"| {share:g} | {count} | kernel {config} | {ms:.3f} | {flops / ms / 1e9:.0f} | {diff:.3g} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--shares", type=float, nargs="+", default=[0.1, 0.2, 0.3])
    parser.add_argument("--heads", type=int, default=28)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument(
        "--configs", nargs="+", default=["128/64/8", "128/64/4", "64/64/4", "128/32/4"], help="items/keys/warps"
    )
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args(argv)
    if any(not 0.0 < share <= 1.0 for share in args.shares) or args.runs < 1 or args.context < 1:
        parser.error("--shares must lie in (0, 1], --runs and --context be at least 1")
    if any(not re.fullmatch(r"[1-9]\d*/[1-9]\d*/[1-9]\d*", config) for config in args.configs):
        parser.error("--configs entries are items/keys/warps, three positive integers (128/64/8)")
    if not torch.cuda.is_available():
        sys.stderr.write("needs a CUDA device\n")
        return 2
    lines = ["| share | queries | attention | ms | TFLOP/s | max diff vs SDPA |", "|---|---|---|---|---|---|"]
    for share in args.shares:
        lines += bench_share(args, share)
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
