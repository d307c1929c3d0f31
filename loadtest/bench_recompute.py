"""Time to first token against the recompute share R (issue 13, item 2): what selective recompute costs.

    python -m loadtest.bench_recompute --contexts 8192 --runs 9 --json recompute.json
    python -m loadtest.bench_recompute --model DIR --device cpu --contexts 512 --chunk-tokens 64 --runs 1 --warmup 0

Without --model it builds a Qwen2-7B-shaped model with random bf16 weights on the GPU (see bench_prefill); the
second line is a CPU smoke run on a tiny model (`kvstitch tiny-model DIR`). For each context and each spec
(`selective:R` for every --shares R, `prefix:N` for every --prefix N, any spec of --specs) TTFT is wall clock from
"chunk KV on the device"
to "first token id on the host", synchronised, median of --runs after --warmup, as the scheduler serves a turbo
request with recompute (`prefill_turbo`): lease the bucket's CUDA graph (where graphs are on), stitch into its
buffer, recompute eagerly, prefill the question (through the graph where it holds it), argmax. (The scheduler's
batched answers add one device copy of the context into their slab, ~0.1 ms at 8K.) Beside it:

- recompute only: the recompute step alone on a freshly stitched buffer (re-stitched, untimed, before each run);
- naive: one causal prefill over prefix + chunks + question, the row every share is compared with;
- the largest |logit difference| of the first token against naive, and whether the first token agrees (random
  weights say little about quality; `kvstitch eval --recompute` measures it on a real model).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
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
    timed,
)
from service.engine import slot_attention
from service.engine.engine import GenerationResult, StitchEngine, Stopwatch, TurboPrefill
from service.engine.kv_layout import KVBlock
from service.engine.prompt import PromptIds
from service.engine.recompute_spec import RecomputeSpec, parse_recompute
from service.engine.stitch import PositionMode

log = logging.getLogger("bench_recompute")
DEFAULT_SHARES = [0.0, 0.05, 0.1, 0.2, 0.5, 1.0]


def turbo_logits(
    engine: StitchEngine, prompt: PromptIds, chunk_kv: list[KVBlock], spec: RecomputeSpec, extra: int
) -> Callable[[], torch.Tensor]:
    """One served turbo prefill with recompute (`prefill_turbo`, as the scheduler's slab prefill runs it): the
    first token's logits."""
    question = prompt.question
    request = TurboPrefill(chunk_kv, question, PositionMode.REORDERED, extra, None, spec)

    def run() -> torch.Tensor:
        graph = engine.lease_graph(prompt.context_tokens, len(question), extra)  # None on the CPU
        try:
            watch = Stopwatch(engine.spec.device)
            return engine.prefill_turbo(request, watch, GenerationResult(), graph)[1]
        finally:
            if graph is not None:
                engine.release_graph(graph)

    return run


def recompute_only(
    engine: StitchEngine, prompt: PromptIds, chunk_kv: list[KVBlock], spec: RecomputeSpec
) -> tuple[Callable[[], None], Callable[[], int]]:
    """(prepare, run): a fresh stitch (untimed), then the recompute alone, returning the tokens recomputed."""
    stitched = engine.stitch(chunk_kv, PositionMode.REORDERED, len(prompt.question))

    def prepare() -> None:
        nonlocal stitched
        stitched = engine.stitch(chunk_kv, PositionMode.REORDERED, len(prompt.question))

    def run() -> int:
        return engine.recompute(*stitched, chunk_kv, spec, prompt.question)

    return prepare, run


def first_token(logits: torch.Tensor) -> int:
    return int(torch.argmax(logits))


def spec_row(
    engine: StitchEngine,
    prompt: PromptIds,
    chunk_kv: list[KVBlock],
    spec: RecomputeSpec,
    naive: torch.Tensor,
    args: argparse.Namespace,
) -> dict[str, Any]:
    target, runs, warmup = engine.spec.device, args.runs, args.warmup
    served = turbo_logits(engine, prompt, chunk_kv, spec, args.answer_tokens)
    logits = served().float()
    prepare, run = recompute_only(engine, prompt, chunk_kv, spec)
    prepare()
    return {
        "recompute": str(spec),
        "recomputed_tokens": run(),
        "ttft_ms": timed(lambda: first_token(served()), runs, warmup, target),
        "recompute_only_ms": timed(run, runs, warmup, target, prepare),
        "max_logit_diff_vs_naive": float((logits - naive).abs().max()),
        "same_first_token": first_token(logits) == first_token(naive),
    }


def bench_context(engine: StitchEngine, context: int, args: argparse.Namespace) -> dict[str, Any]:
    chunks = context_chunks(engine, context, args.chunk_tokens, seed=context)
    prompt = engine.template.prompt(chunks, question_ids(engine, args.question_tokens))
    chunk_kv, _ = precompute_all(engine, list(prompt.blocks), args.precompute_batch)
    target = engine.spec.device
    naive = engine.prefill_naive(prompt)[1].float()
    specs = [parse_recompute(f"selective:{r:g}") for r in args.shares]
    specs += [parse_recompute(f"prefix:{n}") for n in args.prefix]
    specs += [parse_recompute(spec) for spec in args.specs]
    rows: list[dict[str, Any]] = []
    for attention in args.slot_attention:
        slot_attention.ENABLED = attention == "kernel"
        for spec in specs:
            rows.append({**spec_row(engine, prompt, chunk_kv, spec, naive, args), "slot_attention": attention})
    slot_attention.ENABLED = True
    for row in rows:
        row["median_ttft_ms"] = statistics.median(row["ttft_ms"])
        row["median_recompute_only_ms"] = statistics.median(row["recompute_only_ms"])
    naive_ms = timed(lambda: first_token(engine.prefill_naive(prompt)[1]), args.runs, args.warmup, target)
    return {
        "context_tokens": prompt.context_tokens,
        "chunk_tokens": sum(len(b) for b in prompt.blocks),
        "chunks": len(chunks),
        "question_tokens": len(prompt.question),
        "naive_ms": naive_ms,
        "median_naive_ms": statistics.median(naive_ms),
        "specs": rows,
    }


def table(contexts: list[dict[str, Any]]) -> str:
    lines = [
        "| context | recompute | slot attention | tokens recomputed | TTFT ms | recompute only ms | vs naive "
        "| max logit diff vs naive | same first token |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in contexts:
        for r in c["specs"]:
            lines.append(
                f"| {c['context_tokens']} | {r['recompute']} | {r['slot_attention']} | {r['recomputed_tokens']} "
                f"| {r['median_ttft_ms']:.2f} "
                f"| {r['median_recompute_only_ms']:.2f} | {c['median_naive_ms'] / r['median_ttft_ms']:.1f}x "
                f"| {r['max_logit_diff_vs_naive']:.3g} | {r['same_first_token']} |"
            )
        lines.append(f"| {c['context_tokens']} | naive | — | — | {c['median_naive_ms']:.2f} | — | 1.0x | 0 | True |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(parser)
    parser.set_defaults(contexts=[8192])
    parser.add_argument("--shares", type=float, nargs="+", default=DEFAULT_SHARES, help="selective:R shares")
    parser.add_argument("--prefix", type=int, nargs="*", default=[], help="prefix:N token counts, also timed")
    parser.add_argument(
        "--specs", nargs="*", default=[], help="other specs, also timed (query:0.2, auto, auto:1e-6 = always, auto:1)"
    )
    parser.add_argument(
        "--slot-attention",
        nargs="+",
        choices=["kernel", "sdpa"],
        default=["kernel"],
        help="scattered recompute queries through slot_attention's kernel (where it runs) or masked SDPA; each timed",
    )
    parser.add_argument("--answer-tokens", type=int, default=256, help="answer budget (sizes the graph's bucket)")
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run with --model")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.runs < 1 or any(not 0.0 <= r <= 1.0 for r in args.shares):
        parser.error("--runs must be at least 1 and every share within 0..1")
    opened = open_benchmark_engine(args.model, args.device)
    if opened is None:
        return 2
    engine, machine = opened
    report: dict[str, Any] = {**machine, "contexts": []}
    for context in args.contexts:
        row = bench_context(engine, context, args)
        report["contexts"].append(row)
        log.info("context %d: naive %.2f ms", row["context_tokens"], row["median_naive_ms"])
    sys.stdout.write(table(report["contexts"]) + "\n")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
