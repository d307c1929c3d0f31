"""Batched question prefill at 8K context: the batched-prefill CUDA graphs against one question's prefill graph.

    python -m loadtest.bench_extend --contexts 8192 --groups 1 2 4 8 16 --question-tokens 51 [--profile]

Without --model it builds a Qwen2-7B-shaped model with random bf16 weights on the GPU (see bench_prefill). One
request is stitched and prefilled into slab 0 of a pool (`bench_batch_decode.fill_slabs`) and its live KV copied
into as many slabs as the largest group; each group of G questions (the request's own question, once per slab)
is then prefilled after those contexts by `ExtendGraphs.extend`, as the scheduler's admission does, and the
figure is the median wall time of `--runs` replays (each waits for the GPU). Beside it: the same group eagerly
(`BatchDecoder.extend` with tight bounds), and one question through the engine's own prefill graph in a leased
graph buffer (what a request admitted alone runs). `--kv-bound N` captures the graphs with N as flash's
max_seqlen_k instead of the model's context. `--profile` prints the eager extend's CUDA kernels for a group of 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from loadtest.bench_batch_decode import fill_slabs, request_prompt
from loadtest.bench_prefill import add_workload_arguments, open_benchmark_engine, precompute_all
from service.engine.batch_decode import BatchDecoder, ExtendRows
from service.engine.engine import StitchEngine
from service.engine.extend_graph import ExtendGraphs, ExtendRequest
from service.engine.kv_pool import KVPool
from service.kvcache import device

log = logging.getLogger("bench_extend")


def timed(fn: Callable[[], Any], spec_device: torch.device, runs: int, warmup: int) -> float:
    """Median wall ms of `fn` (each run waits for the device)."""
    times = []
    for i in range(warmup + runs):
        device.synchronize(spec_device)
        start = time.perf_counter()
        fn()
        device.synchronize(spec_device)
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def single_prefill_ms(engine: StitchEngine, context: int, args: argparse.Namespace) -> float | None:
    """One question through the engine's prefill graph over its stitched context (a leased graph buffer)."""
    prompt = request_prompt(engine, context, args)
    kv, _ = precompute_all(engine, list(prompt.blocks), args.precompute_batch)
    graph = engine.lease_graph(prompt.context_tokens, len(prompt.question), 0)
    if graph is None:
        return None
    try:
        engine.stitch(kv, "reordered", len(prompt.question), into=graph.buffer)
        length, position = graph.buffer.length, graph.buffer.next_position

        def once() -> None:
            graph.buffer.truncate(length, position)
            engine.prefill_question(graph.buffer, prompt.question, graph=graph)

        return timed(once, engine.spec.device, args.runs, args.warmup)
    finally:
        engine.release_graph(graph)


def bench(engine: StitchEngine, context: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    prompt = request_prompt(engine, context, args)
    largest = max(args.groups)
    per_request = len(prompt.joined()) + args.tokens
    scratch = 4096 + 1
    pool = KVPool(engine.spec, (largest * per_request + scratch) * engine.spec.kv_bytes_per_token(), poison="zero")
    decoder = BatchDecoder(engine.forward, pool, "auto")
    slabs, length, _, _ = fill_slabs(engine, pool, prompt, largest, args)
    question = list(prompt.question)
    live = length - len(question)  # each slab's context, before its question
    spec = engine.spec
    if args.kv_bound:  # the graphs read only `device` and `max_context` (from max_positions) from the spec
        decoder.forward.spec = dataclasses.replace(spec, max_positions=args.kv_bound, sliding_window=None)
    graphs = ExtendGraphs(decoder)
    decoder.forward.spec = spec
    rows = []
    for group in args.groups:
        requests: list[ExtendRequest] = [(question, live, slab.start, live) for slab in slabs[:group]]
        graph_ms = timed(functools.partial(graphs.extend, requests), spec.device, args.runs, args.warmup)
        eager = ExtendRows.build(requests, spec.device)
        eager_ms = timed(functools.partial(decoder.extend, eager), spec.device, args.runs, args.warmup)
        row = {"context_tokens": live, "group": group, "new_tokens": group * len(question)}
        row.update({"graph_ms": graph_ms, "eager_ms": eager_ms, "graph_ms_per_question": graph_ms / group})
        rows.append(row)
        log.info("%s", json.dumps(row))
    if args.profile:
        profile(decoder, [(question, live, slab.start, live) for slab in slabs[:2]], spec.device)
    graphs.close()
    return rows


def profile(decoder: BatchDecoder, requests: list[ExtendRequest], spec_device: torch.device) -> None:
    eager = ExtendRows.build(requests, spec_device)
    decoder.extend(eager)
    device.synchronize(spec_device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        decoder.extend(eager)
        device.synchronize(spec_device)
    sys.stdout.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(parser)
    parser.set_defaults(contexts=[8192], question_tokens=51)
    parser.add_argument("--groups", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--tokens", type=int, default=32, help="answer room per slab")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--kv-bound", type=int, default=0, help="flash max_seqlen_k of the graphs (0: the model's)")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    opened = open_benchmark_engine(args.model, "cuda")
    if opened is None:
        return 2
    engine, machine = opened
    report: dict[str, Any] = {**machine, "max_context": engine.spec.max_context, "rows": [], "single_ms": {}}
    for context in args.contexts:
        report["single_ms"][context] = single_prefill_ms(engine, context, args)
        log.info("one question through the prefill graph at %d: %s ms", context, report["single_ms"][context])
        report["rows"] += bench(engine, context, args)
    sys.stdout.write(json.dumps(report, indent=1) + "\n")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
