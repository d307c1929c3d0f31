"""Decode time per output token, eager vs CUDA graph, after a stitched prefill, on one GPU, in one process.

    python -m loadtest.bench_decode --contexts 4096 8192 16384 --runs 5 --tokens 32 --json out.json

Without --model it builds a Qwen2-7B-shaped model with random bf16 weights on the GPU (see bench_prefill).
One run decodes --tokens greedy tokens from the same stitched state (context + 128-token question); ms/token
is the run's wall time over its tokens, each token's id read back on the host as a server would; the figure is
the median of --runs runs after --warmup. Graph figures are given per attention backend, with the capture time
of the capacity bucket's graph (a fresh capture each, so it is the start-up cost a server pays once per bucket)
and the time to load the request's buffer into the graph's. `max_logit_diff` compares graph and eager logits
over the first teacher-forced steps.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from loadtest.bench_prefill import add_workload_arguments, build_engine, context_chunks, precompute_all, question_ids
from service.engine.attention import ATTENTION_BACKENDS, resolve_attention
from service.engine.cuda_graph import DecodeGraph, bucket_capacity
from service.engine.engine import StitchEngine
from service.engine.kv_buffer import KVBuffer
from service.kvcache import device

log = logging.getLogger("bench_decode")


def eager_run(engine: StitchEngine, buffer: KVBuffer, first: int, tokens: int) -> tuple[float, list[int]]:
    """Wall ms of `tokens` eager greedy steps, and the tokens."""
    device.synchronize(engine.spec.device)
    start, token, out = time.perf_counter(), first, []
    for _ in range(tokens):
        logits = engine.forward.extend(buffer, [token], torch.tensor([buffer.next_position]))
        token = int(torch.argmax(logits))
        out.append(token)
    return (time.perf_counter() - start) * 1e3, out


def graph_run(graph: DecodeGraph, first: int, tokens: int) -> tuple[float, list[int]]:
    """Wall ms of `tokens` graph replays with the argmax read back each step, and the tokens."""
    device.synchronize(graph.spec.device)
    start, token, out = time.perf_counter(), first, []
    for _ in range(tokens):
        graph.step(token)
        token = graph.greedy_token()
        out.append(token)
    return (time.perf_counter() - start) * 1e3, out


def teacher_forced_diff(engine: StitchEngine, buffer: KVBuffer, graph: DecodeGraph, first: int, steps: int) -> float:
    """Largest |eager - graph| logit over `steps` steps fed the eager path's tokens."""
    graph.load(buffer)
    token, worst = first, 0.0
    for _ in range(steps):
        eager = engine.forward.extend(buffer, [token], torch.tensor([buffer.next_position]))
        worst = max(worst, float((eager - graph.step(token)).abs().max()))
        token = int(torch.argmax(eager))
    return worst


def bench_context(engine: StitchEngine, context: int, backends: list[str], args: argparse.Namespace) -> dict[str, Any]:
    chunks = context_chunks(engine, context, args.chunk_tokens, seed=context)
    prompt = engine.template.prompt(chunks, question_ids(engine, args.question_tokens))
    kv, _ = precompute_all(engine, list(prompt.blocks), args.precompute_batch)
    buffer, logits, _ = engine.prefill_stitched(kv, prompt.question, extra_tokens=args.tokens)
    del kv
    first, length, position = int(torch.argmax(logits)), buffer.length, buffer.next_position

    def rewind() -> None:
        buffer.truncate(length, position)

    eager_ms: list[float] = []
    eager_tokens: list[int] = []
    for i in range(args.warmup + args.runs):
        rewind()
        ms, eager_tokens = eager_run(engine, buffer, first, args.tokens)
        if i >= args.warmup:
            eager_ms.append(ms / args.tokens)
    capacity = bucket_capacity(buffer.capacity, engine.spec.max_context)
    row: dict[str, Any] = {
        "context_tokens": prompt.context_tokens,
        "question_tokens": len(prompt.question),
        "graph_capacity": capacity,
        "eager_ms_per_token": eager_ms,
        "graphs": {},
    }
    for backend in backends:
        device.synchronize(engine.spec.device)
        graph = DecodeGraph(engine.forward, capacity, backend)
        entry: dict[str, Any] = {"capture_ms": graph.capture_ms, "load_ms": [], "ms_per_token": []}
        for i in range(args.warmup + args.runs):
            rewind()
            device.synchronize(engine.spec.device)
            start = time.perf_counter()
            graph.load(buffer)
            device.synchronize(engine.spec.device)
            load_ms = (time.perf_counter() - start) * 1e3
            ms, tokens = graph_run(graph, first, args.tokens)
            if i >= args.warmup:
                entry["load_ms"].append(load_ms)
                entry["ms_per_token"].append(ms / args.tokens)
        entry["same_tokens_as_eager"] = tokens == eager_tokens
        rewind()
        entry["max_logit_diff"] = teacher_forced_diff(engine, buffer, graph, first, min(8, args.tokens))
        for key in ("load_ms", "ms_per_token"):
            entry[f"median_{key}"] = statistics.median(entry[key])
        row["graphs"][backend] = entry
        del graph
        torch.cuda.empty_cache()
    row["median_eager_ms_per_token"] = statistics.median(eager_ms)
    return row


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| context | graph capacity | eager ms/token | graph backend | graph ms/token | speedup | capture ms "
        "| load ms | max logit diff | same tokens |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for backend, g in r["graphs"].items():
            lines.append(
                f"| {r['context_tokens']} | {r['graph_capacity']} | {r['median_eager_ms_per_token']:.2f} "
                f"| {backend} | {g['median_ms_per_token']:.2f} "
                f"| {r['median_eager_ms_per_token'] / g['median_ms_per_token']:.1f}x | {g['capture_ms']:.0f} "
                f"| {g['median_load_ms']:.2f} | {g['max_logit_diff']:.3f} | {g['same_tokens_as_eager']} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(parser)
    parser.add_argument("--tokens", type=int, default=32, help="tokens decoded per run")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--attention", nargs="+", default=list(ATTENTION_BACKENDS), help="graph attention backends")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not torch.cuda.is_available():
        log.error("CUDA graphs need a CUDA device")
        return 2
    target = torch.device("cuda")
    engine = build_engine(args.model, target)
    backends = []
    for backend in args.attention:
        # flash_varlen is only kept when it runs and agrees with masked SDPA on the device (the "auto" probe).
        if backend == "flash_varlen" and resolve_attention(engine.spec, "auto") != "flash_varlen":
            log.warning("flash_varlen failed its probe on this device; skipped")
            continue
        backends.append(backend)
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    for context in args.contexts:
        row = bench_context(engine, context, backends, args)
        report["rows"].append(row)
        log.info("%s", json.dumps(row))
        torch.cuda.empty_cache()
    sys.stdout.write(table(report["rows"]) + "\n")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
