"""Where the time of a stitched TTFT goes, eager and with the CUDA-graph question prefill (torch profiler, GPU).

python -m loadtest.profile_engine --context 8192

Profiles, five iterations each after warm-up: the eager question prefill, the graph question prefill (replay
only), the stitch (rotate + place, GPU tier) into the graph's buffer, the whole graph TTFT (lease, stitch, prefill
graph, first token id on the host), and one eager decode step. After each table a line gives, per iteration, the
wall time without the profiler, the GPU kernel time and the CPU time under the profiler: wall close to GPU time
means device-bound, wall close to CPU time means launch-bound.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from loadtest.bench_prefill import context_chunks, random_qwen2_7b
from service.engine.engine import StitchEngine
from service.engine.gate import synthetic_ids

ITERATIONS = 5


def wall_ms(fn: Callable[[], object]) -> float:
    """Median wall milliseconds of one synchronised call, without the profiler."""
    times = []
    for _ in range(ITERATIONS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--question-tokens", type=int, default=128)
    parser.add_argument("--answer-tokens", type=int, default=256)
    parser.add_argument("--rows", type=int, default=14)
    args = parser.parse_args()
    engine = StitchEngine(random_qwen2_7b(torch.device("cuda")))
    chunks = context_chunks(engine, args.context, 512, seed=1)
    fixed = len(engine.template.question_head) + len(engine.template.question_tail)
    prompt = engine.template.prompt(chunks, synthetic_ids(engine, [args.question_tokens - fixed], 2)[0])
    question, extra = prompt.question, args.answer_tokens
    kv = [b for i in range(0, len(prompt.blocks), 16) for b in engine.precompute(prompt.blocks[i : i + 16])]
    buffer, plan = engine.stitch(kv, "reordered", len(question) + 64)
    graph = engine.lease_graph(prompt.context_tokens, len(question), extra)
    if graph is None:
        sys.stderr.write("no CUDA graph leased\n")
        return 1
    engine.prefill_stitched(kv, question, extra_tokens=extra, graph=graph)  # captures the prefill graph
    engine.release_graph(graph)

    def eager_prefill() -> None:
        buffer.truncate(plan.context_tokens, plan.question_start)
        int(torch.argmax(engine.prefill_question(buffer, question)))

    def graph_prefill() -> None:
        graph.buffer.truncate(plan.context_tokens, plan.question_start)
        logits = graph.prefill(question)
        assert logits is not None
        int(torch.argmax(logits))

    def stitch() -> None:
        engine.stitch(kv, "reordered", len(question) + extra, into=graph.buffer)

    def graph_ttft() -> None:
        leased = engine.lease_graph(prompt.context_tokens, len(question), extra)
        assert leased is not None
        try:
            int(torch.argmax(engine.prefill_stitched(kv, question, extra_tokens=extra, graph=leased)[1]))
        finally:
            engine.release_graph(leased)

    def decode_step() -> None:
        buffer.truncate(plan.context_tokens, plan.question_start)
        position = torch.tensor([buffer.next_position])
        int(torch.argmax(engine.forward.extend(buffer, [5], position)))

    cases: list[tuple[str, Callable[[], None]]] = [
        ("eager question prefill", eager_prefill),
        ("graph question prefill (replay)", graph_prefill),
        ("stitch into the graph's buffer (GPU tier)", stitch),
        ("graph TTFT (lease + stitch + prefill graph + first token)", graph_ttft),
        ("eager decode step", decode_step),
    ]
    for name, fn in cases:
        for _ in range(3):
            fn()
        wall = wall_ms(fn)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(ITERATIONS):
                fn()
            torch.cuda.synchronize()
        events = prof.key_averages()
        gpu = sum(e.self_device_time_total for e in events) / 1e3 / ITERATIONS
        cpu = sum(e.self_cpu_time_total for e in events) / 1e3 / ITERATIONS
        sys.stdout.write(f"\n=== {name} x{ITERATIONS} at {plan.context_tokens} context tokens ===\n")
        sys.stdout.write(events.table(sort_by="self_cuda_time_total", row_limit=args.rows) + "\n")
        sys.stdout.write(
            f"per iteration: wall {wall:.2f} ms (no profiler), GPU kernels {gpu:.2f} ms, CPU {cpu:.2f} ms (profiled)\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
