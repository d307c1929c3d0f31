"""Where the time of a stitched question prefill and of one decode step goes (torch profiler, GPU).

python -m loadtest.profile_engine --context 8192
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from loadtest.bench_prefill import context_chunks, random_qwen2_7b
from service.engine.engine import StitchEngine
from service.engine.gate import synthetic_ids


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--rows", type=int, default=14)
    args = parser.parse_args()
    engine = StitchEngine(random_qwen2_7b(torch.device("cuda")))
    chunks = context_chunks(engine, args.context, 512, seed=1)
    prompt = engine.template.prompt(chunks, synthetic_ids(engine, [60], 2)[0])
    kv = [b for i in range(0, len(prompt.blocks), 16) for b in engine.precompute(prompt.blocks[i : i + 16])]
    buffer, plan = engine.stitch(kv, "reordered", len(prompt.question) + 64)

    def prefill() -> None:
        buffer.truncate(plan.context_tokens, plan.question_start)
        int(torch.argmax(engine.prefill_question(buffer, prompt.question)))

    def decode_step() -> None:
        position = torch.tensor([buffer.next_position])
        int(torch.argmax(engine.forward.extend(buffer, [5], position)))
        buffer.truncate(buffer.length - 1, buffer.next_position - 1)

    for name, fn in (("question prefill", prefill), ("decode step", decode_step)):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
        sys.stdout.write(f"\n=== {name} x5 at {plan.context_tokens} context tokens ===\n")
        sys.stdout.write(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.rows) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
