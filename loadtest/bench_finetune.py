"""Samples per second of block fine-tuning: the one-sample-at-a-time loop it replaced against the batched one.

    python -m loadtest.bench_finetune --model DIR --device cuda
    python -m loadtest.bench_finetune --model DIR --device cpu --batch-sizes 4 --old-steps 1 --new-steps 2 --warmup 1

DIR is any HF folder `load_model` opens (the real model: `kvstitch import-gguf` of SmolLM2-135M-Instruct, see
docs/quality.md); the second line is a CPU smoke run on a tiny model (`kvstitch tiny-model DIR`). The samples are
`kvstitch make-qa` questions (--questions, --chunks; or --data FILE), half under full attention as
`kvstitch finetune` trains by default. Each path runs --warmup untimed steps, then its timed steps on the same
model (fp32 master weights, bf16 autocast on CUDA), synchronised; samples/s = samples / seconds.

- old: what `train` ran before batching: per sample one forward and backward (`finetune.sample_loss`), then
  clipping and an unfused AdamW step;
- new: `finetune.train` itself (padded micro-batches, fused AdamW on CUDA) on labelled samples, at each
  --batch-sizes value;
- distill: `finetune.train` on self-distillation samples (the teacher's forward added), the teacher's greedy
  answers generated first (their rate is `teacher_answers_per_s`).

It prints one JSON line (and writes it to --json): the rates, the speedups against old, tokens per sample, the
device and its name.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from service.engine.kv_layout import ChunkContext
from service.engine.model import LoadedModel, load_model
from service.engine.prompt import build_template
from service.quality.generator import write_qa_file
from workers.training.distill import FrozenTeacher, stop_ids
from workers.training.finetune import (
    Example,
    FinetuneConfig,
    FinetuneReport,
    Pools,
    Precision,
    choose_precision,
    draw_sample,
    labelled_examples,
    pad_id,
    sample_loss,
    train,
)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def old_loop_rate(
    model: LoadedModel, examples: list[Example], config: FinetuneConfig, precision: Precision, warmup: int, steps: int
) -> float:
    """Samples/s of the loop `train` ran before batching: one forward and backward per sample."""
    hf, device = model.hf, model.spec.device
    rng = random.Random(config.seed)
    params = [p for p in hf.parameters() if p.requires_grad]
    optimiser = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
    report = FinetuneReport("bench")
    began = 0.0
    for step in range(warmup + steps):
        if step == warmup:
            _synchronize(device)
            began = time.perf_counter()
        optimiser.zero_grad(set_to_none=True)
        total = 0.0
        for _ in range(config.batch_size):
            sample = draw_sample(rng.choice(examples), config, rng, report)
            loss = sample_loss(hf, sample, device, precision) / config.batch_size
            loss.backward()  # type: ignore[no-untyped-call]
            total += float(loss.detach())  # the old loop read each sample's loss back (a device sync)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimiser.step()
    _synchronize(device)
    return steps * config.batch_size / (time.perf_counter() - began)


def batched_rate(
    hf: Any,
    pools: Pools,
    config: FinetuneConfig,
    precision: Precision,
    warmup: int,
    steps: int,
    teacher: FrozenTeacher | None,
    pad: int,
) -> float:
    """Samples/s of `finetune.train` (its own timing: the last step's loss is read back, so it is synchronised)."""
    if warmup:
        train(hf, pools, replace(config, steps=warmup), precision, FinetuneReport("warm"), teacher, pad)
    report = train(hf, pools, replace(config, steps=steps), precision, FinetuneReport("bench"), teacher, pad)
    return report.samples_per_s


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="HF model folder")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    parser.add_argument("--data", default=None, help="QA JSONL (default: make-qa questions written to a temp dir)")
    parser.add_argument("--questions", type=int, default=256, help="make-qa questions (default 256)")
    parser.add_argument("--chunks", type=int, default=5, help="make-qa chunks per question (default 5)")
    parser.add_argument("--old-batch-size", type=int, default=16, help="samples per step of the old loop (16)")
    parser.add_argument("--batch-sizes", default="16,32,64", help="samples per step of the new one (16,32,64)")
    parser.add_argument("--old-steps", type=int, default=3, help="timed steps of the old loop (default 3)")
    parser.add_argument("--new-steps", type=int, default=20, help="timed steps of each batched run (default 20)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before each (default 2)")
    parser.add_argument("--answer-tokens", type=int, default=32, help="teacher answer limit (default 32)")
    parser.add_argument("--generate-batch-size", type=int, default=64, help="teacher answers per batch (64)")
    parser.add_argument(
        "--chunk-context", choices=("alone", "prefix"), default="alone", help="trained chunk context (alone)"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the JSON line here")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as scratch:
        data = args.data or str(write_qa_file(Path(scratch) / "qa.jsonl", args.questions, args.chunks, 11, 0.3))
        context = ChunkContext(args.chunk_context)
        config = FinetuneConfig(
            args.model, data, "unused", device=args.device, lr=1e-5, warmup_steps=0, chunk_context=context
        )
        precision = choose_precision(config)
        model = load_model(args.model, device=args.device, dtype=precision.weights)
        examples = labelled_examples(model, build_template(model.tokenizer), data)
    device, pad = model.spec.device, pad_id(model)
    teacher = FrozenTeacher.frozen_copy(model.hf, precision.compute)
    prompts = [e.prompt for e in examples]
    began = time.perf_counter()
    answers = teacher.answers(
        prompts, stop_ids(model.tokenizer, model.hf), args.answer_tokens, args.generate_batch_size, pad
    )
    teacher_rate = len(prompts) / (time.perf_counter() - began)
    distilled = [Example(p, a, distill=True) for p, a in zip(prompts, answers, strict=True) if a]
    model.hf.requires_grad_(True).train()

    old_config = replace(config, batch_size=args.old_batch_size)
    old = old_loop_rate(model, examples, old_config, precision, args.warmup, args.old_steps)
    result: dict[str, Any] = {
        "model": args.model,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "samples": len(examples),
        "tokens_per_sample": sum(e.tokens for e in examples) / len(examples),
        "teacher_answer_tokens": sum(len(a) for a in answers) / max(1, len(answers)),
        "teacher_answers_per_s": teacher_rate,
        "chunk_context": args.chunk_context,
        "old_batch_size": args.old_batch_size,
        "old_samples_per_s": old,
    }
    for size in [int(s) for s in args.batch_sizes.split(",")]:
        sized = replace(config, batch_size=size)
        new = batched_rate(model.hf, Pools(examples, []), sized, precision, args.warmup, args.new_steps, None, pad)
        distill_config = replace(sized, data=None, data_dir="bench")
        distill = batched_rate(
            model.hf, Pools([], distilled), distill_config, precision, args.warmup, args.new_steps, teacher, pad
        )
        result[f"new_samples_per_s@{size}"] = new
        result[f"distill_samples_per_s@{size}"] = distill
        result[f"speedup@{size}"] = new / old
        result[f"distill_speedup@{size}"] = distill / old
    line = json.dumps(result)
    print(line)
    if args.json:
        args.json.write_text(line + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
