"""Batched decode step time over a KV pool (issue 12), eager, at several batch sizes, in one process.

    python -m loadtest.bench_batch_decode --contexts 8192 --batches 1 8 32 --tokens 32 --json out.json

Without --model it builds a Qwen2-7B-shaped model with random bf16 weights on the GPU (see bench_prefill). For
each context, one request is stitched and its question prefilled into slab 0 of a pool sized for the largest
batch; its live KV is copied into the other slabs, so B requests of that context decode together (every row
still attends only to its own slab). One run feeds `--tokens` batched greedy steps, each step's B token ids read
back on the host as the scheduler does; the figure is the median over `--runs` runs after `--warmup` of ms per
step, with ms per token per request (step / B) and tokens per second (B / step). `same_tokens` checks that every
row decoded the tokens of row 0 (identical inputs: any cross-row leak or slot mix-up shows up there).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from loadtest.bench_prefill import (
    add_workload_arguments,
    context_chunks,
    open_benchmark_engine,
    precompute_all,
    question_ids,
)
from service.engine import attention, lse_merge
from service.engine.batch_decode import BatchDecoder, DecodeRows, ExtendRows
from service.engine.batch_graph import BatchGraphs
from service.engine.cuda_graph import bucket_capacity
from service.engine.engine import StitchEngine
from service.engine.kv_buffer import KVBuffer
from service.engine.kv_pool import KVPool, Slab
from service.engine.mixed_graph import MIXED_TOKENS, MixedGraphs
from service.engine.prompt import PromptIds
from service.engine.sampling import Sampler, SamplingParams, pick_rows
from service.kvcache import device

log = logging.getLogger("bench_batch_decode")


def request_prompt(engine: StitchEngine, context: int, args: argparse.Namespace) -> PromptIds:
    chunks = context_chunks(engine, context, args.chunk_tokens, seed=context)
    return engine.template.prompt(chunks, question_ids(engine, args.question_tokens))


def fill_slabs(
    engine: StitchEngine, pool: KVPool, prompt: PromptIds, batch: int, args: argparse.Namespace
) -> tuple[list[Slab], int, int, int]:
    """`batch` slabs holding the same stitched request; returns the slabs, their live length, next position and
    the first token."""
    kv, _ = precompute_all(engine, list(prompt.blocks), args.precompute_batch)
    slabs = [pool.allocate(len(prompt.joined()) + args.tokens) for _ in range(batch)]
    buffer: KVBuffer = pool.buffer(slabs[0])
    engine.stitch(kv, "reordered", len(prompt.question) + args.tokens, into=buffer)
    logits = engine.prefill_question(buffer, prompt.question)
    with torch.inference_mode():
        for slab in slabs[1:]:
            pool.view(slab)[:, :, :, : buffer.length].copy_(buffer.data[:, :, :, : buffer.length])
    return slabs, buffer.length, buffer.next_position, int(torch.argmax(logits))


def decode_run(
    decoder: BatchDecoder,
    slabs: list[Slab],
    length: int,
    position: int,
    first: int,
    tokens: int,
    graphs: BatchGraphs | None = None,
) -> tuple[float, list[list[int]]]:
    """Wall ms of `tokens` batched greedy steps from the same state (through `graphs` when given), and each
    row's tokens."""
    spec = decoder.forward.spec
    samplers = [Sampler(SamplingParams(), spec.device)] * len(slabs)
    ids = [first] * len(slabs)
    out: list[list[int]] = [[] for _ in slabs]
    device.synchronize(spec.device)
    start = time.perf_counter()
    for step in range(tokens):
        spans = [(slab.start, length + step + 1) for slab in slabs]
        positions = [position + step] * len(slabs)
        if graphs is not None:
            logits = graphs.step(ids, positions, spans)
        else:
            logits = decoder.step(DecodeRows.build(ids, positions, spans, spec.device))
        ids = pick_rows(logits, samplers)
        for row, token in enumerate(ids):
            out[row].append(token)
    return (time.perf_counter() - start) * 1e3, out


def mixed_run(
    graphs: MixedGraphs, slabs: list[Slab], length: int, position: int, first: int, question: list[int], steps: int
) -> float:
    """Wall ms of `steps` mixed steps: the batch's greedy step with one question (prefilled after the context of
    the last slab, the same slots each step) riding in it; the question's slab is the extra last one."""
    spec = graphs.decoder.forward.spec
    decode, asking = slabs[:-1], slabs[-1]
    samplers = [Sampler(SamplingParams(), spec.device)] * len(decode)
    ids = [first] * len(decode)
    context, at = length - len(question), position - len(question)
    device.synchronize(spec.device)
    start = time.perf_counter()
    for step in range(steps):
        spans = [(slab.start, length + step + 1) for slab in decode]
        logits = graphs.step(
            (ids, [position + step] * len(decode), spans, None), None, [(question, at, asking.start, context)]
        )
        ids = pick_rows(logits[: len(decode)], samplers)
    return (time.perf_counter() - start) * 1e3


def bench(engine: StitchEngine, context: int, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    prompt = request_prompt(engine, context, args)
    per_request = len(prompt.joined()) + args.tokens
    asking = 1 if args.mixed else 0  # a slab for the question riding in the mixed steps
    # One slot more: the graphs' scratch slot for padding rows (and the mixed graphs' scratch).
    slots = (batch + asking) * per_request + 1 + asking * (max(MIXED_TOKENS) + 1)
    pool = KVPool(engine.spec, slots * engine.spec.kv_bytes_per_token(), poison="zero")
    decoder = BatchDecoder(engine.forward, pool, args.attention)
    slabs, length, position, first = fill_slabs(engine, pool, prompt, batch + asking, args)
    mixed = MixedGraphs(decoder) if args.mixed else None
    ride = list(prompt.question)[-args.ride_tokens :] if args.ride_tokens else list(prompt.question)
    if mixed is not None:
        mixed_ms = [
            mixed_run(mixed, slabs, length, position, first, ride, args.tokens) / args.tokens
            for _ in range(args.warmup + args.runs)
        ][args.warmup :]
        mixed.close()
        if args.profile:
            kernels = profile_mixed(decoder, slabs, length, position, first, ride)
        slabs = slabs[:batch]
    graphs = BatchGraphs(decoder) if args.graphs else None
    step_ms: list[float] = []
    tokens: list[list[int]] = []
    for i in range(args.warmup + args.runs):
        ms, tokens = decode_run(decoder, slabs, length, position, first, args.tokens, graphs)
        if i >= args.warmup:
            step_ms.append(ms / args.tokens)
    median = statistics.median(step_ms)
    row = {
        "context_tokens": length,
        "batch": batch,
        "attention": decoder.attention,
        "graphs": graphs is not None,
        "fused_merge": lse_merge.ENABLED,
        "extend_splits": attention.EXTEND_KV_SPLITS,
        "ms_per_step": step_ms,
        "median_ms_per_step": median,
        "ms_per_token_per_request": median / batch,
        "tokens_per_s": batch * 1e3 / median,
        "pool_mib": pool.capacity_bytes / 2**20,
        "same_tokens": all(t == tokens[0] for t in tokens),
    }
    if mixed is not None:
        row["mixed_ms_per_step"] = statistics.median(mixed_ms)
        row["question_tokens"] = len(ride)
        if args.profile:
            row["mixed_kernels"] = kernels
    if args.profile:
        spans = [(slab.start, length + 1) for slab in slabs]
        rows = DecodeRows.build([first] * batch, [position] * batch, spans, engine.spec.device)
        row["kernels"] = profile_step(decoder, rows)
    if graphs is not None:
        graphs.close()
    del decoder, pool, graphs
    return row


def profile_step(decoder: BatchDecoder, rows: DecodeRows, top: int = 12) -> str:
    """The eager step's CUDA kernels (the ones its graph replays), the `top` by total time, as a table."""
    return _profile(lambda: decoder.step(rows), decoder.forward.spec.device, top)


def profile_mixed(
    decoder: BatchDecoder, slabs: list[Slab], length: int, position: int, first: int, question: list[int]
) -> str:
    """The eager mixed step's kernels, the question's attention split into key ranges as its graph splits it."""
    spec = decoder.forward.spec
    decode, asking = slabs[:-1], slabs[-1]
    spans = [(slab.start, length + 1) for slab in decode]
    rows = DecodeRows.build([first] * len(decode), [position] * len(decode), spans, spec.device)
    context, at = length - len(question), position - len(question)
    extend = ExtendRows.build([(question, at, asking.start, context)], spec.device)
    width = bucket_capacity(length + 1, spec.max_context)
    return _profile(lambda: decoder.mixed(rows, extend, width, (len(question), spec.max_context)), spec.device, 16)


def _profile(run: Callable[[], Any], spec_device: torch.device, top: int) -> str:
    run()
    device.synchronize(spec_device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        device.synchronize(spec_device)
    text: str = prof.key_averages().table(sort_by="cuda_time_total", row_limit=top)
    return text


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| context | batch | attention | ms/step | ms/token/request | tokens/s | pool MiB | same tokens | ms/step "
        "with a question |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mixed = f"{r['mixed_ms_per_step']:.2f} ({r['question_tokens']} tokens)" if "mixed_ms_per_step" in r else "-"
        lines.append(
            f"| {r['context_tokens']} | {r['batch']} | {r['attention']} | {r['median_ms_per_step']:.2f} "
            f"| {r['ms_per_token_per_request']:.3f} | {r['tokens_per_s']:.0f} | {r['pool_mib']:.0f} "
            f"| {r['same_tokens']} | {mixed} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(parser)
    parser.set_defaults(contexts=[8192])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--tokens", type=int, default=32, help="batched steps per run")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--attention", default="auto", help="auto, loop, flash_varlen or sdpa_gather")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run with --model")
    parser.add_argument("--graphs", action="store_true", help="decode through the batch-bucket CUDA graphs")
    parser.add_argument("--profile", action="store_true", help="print each batch's eager step's top CUDA kernels")
    parser.add_argument(
        "--mixed", action="store_true", help="also time the step with one question riding in it (MixedGraphs)"
    )
    parser.add_argument(
        "--torch-merge", action="store_true", help="merge split attention in torch, not the Triton kernel"
    )
    parser.add_argument(
        "--extend-splits", type=int, default=None, help="context key ranges of a short batched prefill (default 8)"
    )
    parser.add_argument(
        "--ride-tokens", type=int, default=None, help="the riding question's tokens (default: the whole suffix)"
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    lse_merge.ENABLED = not args.torch_merge
    if args.extend_splits is not None:
        attention.EXTEND_KV_SPLITS = args.extend_splits
    opened = open_benchmark_engine(args.model, args.device)
    if opened is None:
        return 2
    engine, machine = opened
    report: dict[str, Any] = {**machine, "rows": []}
    for context in args.contexts:
        for batch in args.batches:
            row = bench(engine, context, batch, args)
            report["rows"].append(row)
            kernels = row.pop("kernels", None)
            mixed_kernels = row.pop("mixed_kernels", None)
            log.info("%s", json.dumps(row))
            if kernels is not None:
                sys.stdout.write(f"batch {batch}, context {context}: the eager step's kernels\n{kernels}\n")
            if mixed_kernels is not None:
                sys.stdout.write(f"batch {batch}: the eager mixed step's kernels\n{mixed_kernels}\n")
            if engine.spec.device.type == "cuda":
                torch.cuda.empty_cache()
    sys.stdout.write(table(report["rows"]) + "\n")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
