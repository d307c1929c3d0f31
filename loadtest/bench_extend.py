"""Batched question prefill at 8K context: the batched-prefill CUDA graphs against one question's prefill graph.

    python -m loadtest.bench_extend --contexts 8192 --groups 1 2 4 8 16 --question-tokens 51 [--profile]

Without --model it builds a Qwen2-7B-shaped model with random bf16 weights on the GPU (see bench_prefill). One
request is stitched and prefilled into slab 0 of a pool (`bench_batch_decode.fill_slabs`) and its live KV copied
into as many slabs as the largest group; each group of G questions (the request's own question, once per slab)
is then prefilled after those contexts by `ExtendGraphs.extend`, as the scheduler's admission does, and the
figure is the median wall time of `--runs` replays (each waits for the GPU). Beside it: the same group eagerly
(`BatchDecoder.extend` with tight bounds), and one question through the engine's own prefill graph in a leased
graph buffer (what a request admitted alone runs). `--profile` prints the eager extend's CUDA kernels for a
group of 2.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from loadtest.bench_batch_decode import fill_slabs, request_prompt
from loadtest.bench_prefill import add_workload_arguments, open_benchmark_engine, precompute_all, timed
from service.engine.batch_decode import BatchDecoder, ExtendRows
from service.engine.engine import StitchEngine
from service.engine.extend_graph import TOKEN_BUCKETS, ExtendGraphs, ExtendRequest
from service.engine.kv_pool import KVPool
from service.kvcache import device

log = logging.getLogger("bench_extend")


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
        prefill = functools.partial(engine.prefill_question, graph.buffer, prompt.question, graph=graph)
        back_to_context = functools.partial(graph.buffer.truncate, length, position)
        return median_ms(prefill, engine.spec.device, args, back_to_context)
    finally:
        engine.release_graph(graph)


def bench(engine: StitchEngine, context: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    prompt = request_prompt(engine, context, args)
    largest = max(args.groups)
    per_request = len(prompt.joined()) + args.tokens
    # + padding room as a scheduler's pool reserves it (one slot, and the batched prefill's largest bucket, which
    # `ExtendGraphs` pads into); `scheduler_config.GRAPH_SCRATCH_SLOTS` also holds the mixed step's, not used here
    slots = largest * per_request + 1 + max(TOKEN_BUCKETS)
    pool = KVPool(engine.spec, slots * engine.spec.kv_bytes_per_token(), poison="zero")
    decoder = BatchDecoder(engine.forward, pool, "auto")
    slabs, length, _, _ = fill_slabs(engine, pool, prompt, largest, args)
    question = list(prompt.question)
    live = length - len(question)  # each slab's context, before its question
    spec = engine.spec
    graphs = ExtendGraphs(decoder)
    rows = []
    for group in args.groups:
        requests: list[ExtendRequest] = [(question, live, slab.start, live) for slab in slabs[:group]]
        graph_ms = median_ms(functools.partial(graphs.extend, requests), spec.device, args)
        eager = ExtendRows.build(requests, spec.device)
        eager_ms = median_ms(functools.partial(decoder.extend, eager), spec.device, args)
        row = {"context_tokens": live, "group": group, "new_tokens": group * len(question)}
        row.update({"graph_ms": graph_ms, "eager_ms": eager_ms, "graph_ms_per_question": graph_ms / group})
        rows.append(row)
        log.info("%s", json.dumps(row))
    if args.profile:
        profile(decoder, [(question, live, slab.start, live) for slab in slabs[:2]], spec.device)
    graphs.close()
    return rows


def median_ms(
    fn: Callable[[], Any], target: torch.device, args: argparse.Namespace, prepare: Callable[[], Any] | None = None
) -> float:
    """Median ms of `--runs` runs of `fn` after `--warmup` (each synchronised; `prepare` untimed before each)."""
    return statistics.median(timed(fn, args.runs, args.warmup, target, prepare))


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
