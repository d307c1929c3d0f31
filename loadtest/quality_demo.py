"""The quality demonstration of issue 13 on a model trained here: data → base model → block fine-tuning → eval.

    python -m loadtest.quality_demo --work-dir /tmp/demo --json quality.json   # the whole run, ~7.5 min of one H200
    python -m loadtest.quality_demo --work-dir /tmp/demo --json demo.json --device cpu --tiny \\
        --pretrain-steps 40 --train-questions 200 --test-questions 6 --finetune-steps 2     # a CPU smoke run

1. `make-qa` sets, each from its own seed: training sets for the base model (one per --train-chunks k), a
   fine-tuning set, a test set, a probe set scored during base training.
2. A byte-level BPE tokenizer fitted to the training text and a Qwen2-config causal LM (6 layers, hidden 512,
   8 heads, 4 KV heads, tied embeddings by default; `--tiny` for tests), saved as an HF folder
   (`workers/training/pretrain.py`).
3. The base model trained from scratch under full causal attention on the served prompts (loss on the answer
   plus the prompt's next-token loss, the one-chunk set first), for `--pretrain-seconds` (the step count follows
   from the measured step time) or `--pretrain-steps`.
4. Block fine-tuning of the base with `kvstitch finetune`'s code (`workers/training/finetune.py`), a share of
   full-attention samples mixed in (`--full-attention-share`).
5. `kvstitch verify`'s gate and `kvstitch eval`'s code (`service/quality/eval.py`) on both models: naive, turbo
   composite, turbo reordered, reordered with `prefix:N` and with `selective:R` at each ratio.

Imports only the engine and the quality code (torch, transformers, tokenizers), so it runs on a GPU image
without the service's web, Qdrant or Redis packages. Prints both tables; `--json` writes everything.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import random
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from service.engine.engine import GenerationMode, StitchEngine
from service.engine.gate import run_gate
from service.engine.model import load_model
from service.engine.prompt import build_template
from service.engine.recompute_spec import parse_recompute
from service.engine.stitch import PositionMode
from service.quality.dataset import QASample, read_samples
from service.quality.eval import NAIVE, EvalReport, Variant, evaluate, format_table
from service.quality.generator import write_qa_file
from workers.training.finetune import FinetuneConfig, eos_id, finetune
from workers.training.pretrain import (
    ModelShape,
    PretrainConfig,
    PretrainReport,
    encode_batch,
    parameter_count,
    pretrain,
    save_untrained,
)

log = logging.getLogger("quality_demo")
PROBE_QUESTIONS = 256  # held-out questions scored during base training (exact match, one batched forward)
TINY = ModelShape(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, max_positions=1024)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", required=True, help="folder for the data sets and both models")
    parser.add_argument("--json", default=None, help="write the whole record (config, losses, gate, rows) here")
    parser.add_argument("--device", default=default_device, help=f"torch device (default {default_device})")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer, hidden-64 model (tests and smoke runs)")
    data = parser.add_argument_group("data (kvstitch make-qa)")
    data.add_argument("--train-questions", type=int, default=160_000, help="base training set size (default 160000)")
    data.add_argument("--test-questions", type=int, default=300, help="test set size (default 300)")
    data.add_argument("--chunks", type=int, default=5, help="chunks per question of the test set (default 5)")
    data.add_argument(
        "--train-chunks",
        type=int,
        nargs="+",
        default=[1, 2, 3, 5],
        help="chunks per question of the base training set, an equal share each (default 1 2 3 5)",
    )
    data.add_argument("--two-fact-share", type=float, default=0.3, help="share of two-fact questions (default 0.3)")
    data.add_argument("--seed", type=int, default=1, help="train set seed; fine-tune +1, test +2 (default 1)")
    base = parser.add_argument_group("base model (trained from scratch, full causal attention)")
    base.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size (default 4096)")
    base.add_argument(
        "--tokenizer-questions",
        type=int,
        default=10_000,
        help="fit the tokenizer on the first N training questions (default 10000; more adds time, few merges)",
    )
    base.add_argument("--layers", type=int, default=None, help="decoder layers (default 6; --tiny: 2)")
    base.add_argument(
        "--hidden",
        type=int,
        default=None,
        help="hidden size; heads of 64, half as many KV heads, MLP 2.75x (default 512; --tiny: 64)",
    )
    budget = base.add_mutually_exclusive_group()
    budget.add_argument("--pretrain-seconds", type=float, default=None, help="time budget (default 260)")
    budget.add_argument("--pretrain-steps", type=int, default=None, help="a fixed step count instead of a budget")
    base.add_argument("--pretrain-batch-size", type=int, default=256, help="sequences per step (default 256)")
    base.add_argument("--pretrain-lr", type=float, default=1.5e-3, help="peak AdamW learning rate (default 1.5e-3)")
    base.add_argument("--pretrain-warmup", type=int, default=200, help="linear warm-up steps (default 200)")
    base.add_argument(
        "--curriculum-share",
        type=float,
        default=0.1,
        help="this share of the steps trains only on the set with the fewest --train-chunks (default 0.1)",
    )
    base.add_argument(
        "--probe-every", type=int, default=250, help="steps between held-out exact-match probes (default 250)"
    )
    base.add_argument(
        "--context-loss-weight",
        type=float,
        default=1.0,
        help="add this weight times a next-token loss on the prompt to the answer loss (default 1; 0: answer only)",
    )
    tune = parser.add_argument_group("block fine-tuning (kvstitch finetune)")
    tune.add_argument("--finetune-steps", type=int, default=120, help="optimiser steps (default 120)")
    tune.add_argument("--finetune-batch-size", type=int, default=16, help="samples per step (default 16)")
    tune.add_argument("--finetune-lr", type=float, default=2e-4, help="learning rate (default 2e-4)")
    tune.add_argument("--finetune-warmup", type=int, default=10, help="warm-up steps (default 10)")
    tune.add_argument(
        "--full-attention-share", type=float, default=0.5, help="share of full-attention samples (default 0.5)"
    )
    ev = parser.add_argument_group("eval (kvstitch eval)")
    ev.add_argument("--prefix", type=int, action="append", help="prefix:N rows, repeatable (default 8)")
    ev.add_argument(
        "--selective", type=float, action="append", help="selective:R rows, repeatable (default 0.1 0.25 0.5)"
    )
    ev.add_argument("--max-new-tokens", type=int, default=12, help="greedy answer length limit (default 12)")
    args = parser.parse_args(argv)
    if args.pretrain_steps is None and args.pretrain_seconds is None:
        args.pretrain_seconds = 260.0
    args.prefix = args.prefix or [8]
    args.selective = args.selective or [0.1, 0.25, 0.5]
    return args


def demo_variants(prefixes: Sequence[int], shares: Sequence[float]) -> list[Variant]:
    """Naive, turbo composite, turbo reordered, then reordered with each prefix:N and selective:R."""
    turbo = GenerationMode.TURBO
    recomputes = [*(f"prefix:{n}" for n in prefixes), *(f"selective:{r:g}" for r in shares)]
    return [
        NAIVE,
        Variant(turbo, PositionMode.COMPOSITE),
        Variant(turbo, PositionMode.REORDERED),
        *(Variant(turbo, PositionMode.REORDERED, parse_recompute(spec)) for spec in recomputes),
    ]


@dataclass(frozen=True)
class DataSet:
    file: Path
    questions: int
    chunks: int
    seed: int
    two_fact_share: float


def make_data(args: argparse.Namespace, work: Path) -> dict[str, DataSet]:
    """Training sets (one per --train-chunks k, seed `seed + 10k`), the fine-tuning set (seed + 1), the test
    set (seed + 2), the probe set (seed + 3, scored during base training); the last three at --chunks, the
    served case the table measures."""
    per_k = max(1, args.train_questions // len(args.train_chunks))
    share = args.two_fact_share
    # A one-chunk set holds one-fact questions only: a two-fact question needs two gold chunks.
    wanted = {f"train-k{k}": (per_k, k, args.seed + 10 * k, share if k > 1 else 0.0) for k in args.train_chunks}
    wanted["finetune"] = (args.finetune_steps * args.finetune_batch_size, args.chunks, args.seed + 1, share)
    wanted["test"] = (args.test_questions, args.chunks, args.seed + 2, share)
    wanted["probe"] = (PROBE_QUESTIONS, args.chunks, args.seed + 3, share)
    # One process per set: a generator is a single-threaded Python loop, ~7 s per 60,000 questions.
    with ProcessPoolExecutor(max_workers=min(len(wanted), os.cpu_count() or 1)) as pool:
        paths = {
            name: pool.submit(write_qa_file, work / "qa" / f"{name}.jsonl", *numbers)
            for name, numbers in wanted.items()
        }
        return {name: DataSet(paths[name].result(), *wanted[name]) for name in wanted}


def model_shape(args: argparse.Namespace) -> ModelShape:
    """The default or tiny shape with --layers and --hidden applied (heads of 64 dimensions, half as many KV heads)."""
    shape = TINY if args.tiny else ModelShape()
    if args.layers:
        shape = replace(shape, layers=args.layers)
    if args.hidden:
        heads = max(1, args.hidden // 64)
        kv_heads = heads // 2 if heads % 2 == 0 else heads
        shape = replace(shape, hidden=args.hidden, heads=heads, kv_heads=kv_heads, intermediate=args.hidden * 11 // 4)
    return shape


def train_base(args: argparse.Namespace, train: list[QASample], probe: list[QASample], folder: Path) -> dict[str, Any]:
    """Tokenizer + random model saved, loaded back through `load_model`, trained, saved over (fp32)."""
    shape = model_shape(args)
    save_untrained(folder, shape, train[: args.tokenizer_questions], args.vocab_size, args.seed)
    model = load_model(folder, device=args.device, dtype=torch.float32)
    hf = model.hf.requires_grad_(True)
    tokenizer = model.tokenizer
    template = build_template(tokenizer)
    encoded = encode_batch(tokenizer, template, train, model.spec.max_context)
    held_out = encode_batch(tokenizer, template, probe, model.spec.max_context)
    config = PretrainConfig(
        batch_size=args.pretrain_batch_size,
        lr=args.pretrain_lr,
        warmup_steps=args.pretrain_warmup,
        steps=args.pretrain_steps,
        seconds=args.pretrain_seconds if args.pretrain_steps is None else None,
        context_weight=args.context_loss_weight,
        curriculum_share=args.curriculum_share,
        probe_every=args.probe_every,
        seed=args.seed,
    )
    report = pretrain(hf, encoded, eos_id(model), int(tokenizer.pad_token_id), config, held_out)
    hf.save_pretrained(folder)
    record = _pretrain_record(report, shape, config)
    record.update(parameters=parameter_count(hf), vocab_size=len(tokenizer))
    record["prompt_tokens_mean"] = sum(len(e.prompt.joined()) for e in encoded) / len(encoded)
    del model, hf
    _free(args.device)
    return record


def _pretrain_record(report: PretrainReport, shape: ModelShape, config: PretrainConfig) -> dict[str, Any]:
    return {
        "shape": asdict(shape),
        "config": asdict(config),
        "steps": report.steps,
        "seconds": round(report.seconds, 1),
        "step_ms": round(report.step_ms, 2),
        "samples_seen": report.steps * config.batch_size,
        "loss_first": report.losses[0],
        "loss_last_50": sum(report.losses[-50:]) / len(report.losses[-50:]),
        "loss_curve": [[step, round(loss, 4)] for step, loss in report.loss_curve()],
        "held_out_exact_match": [[step, round(share, 4)] for step, share in report.probes],
    }


def block_finetune(args: argparse.Namespace, base: Path, data: Path, out: Path) -> dict[str, Any]:
    config = FinetuneConfig(
        model=str(base),
        data=str(data),
        out=str(out),
        steps=args.finetune_steps,
        lr=args.finetune_lr,
        batch_size=args.finetune_batch_size,
        warmup_steps=args.finetune_warmup,
        full_attention_share=args.full_attention_share,
        positions=PositionMode.REORDERED,
        device=args.device,
        seed=args.seed,
    )
    began = time.perf_counter()
    report = finetune(config)
    _free(args.device)
    losses = report.losses
    return {
        "steps": len(losses),
        "batch_size": config.batch_size,
        "lr": config.lr,
        "full_attention_share": config.full_attention_share,
        "block_samples": report.block_samples,
        "full_attention_samples": report.full_attention_samples,
        "seconds": round(time.perf_counter() - began, 1),
        "loss_first_10": sum(losses[:10]) / len(losses[:10]),
        "loss_last_10": sum(losses[-10:]) / len(losses[-10:]),
    }


def check_model(args: argparse.Namespace, folder: Path, test: list[QASample]) -> dict[str, Any]:
    """The gate (`kvstitch verify`) and the eval table of one saved model."""
    engine = StitchEngine(load_model(folder, device=args.device))
    gate = run_gate(engine)
    variants = demo_variants(args.prefix, args.selective)
    report: EvalReport = evaluate(engine, test, variants, args.max_new_tokens, "test.jsonl")
    print(f"\n{folder.name}: gate {'pass' if gate.passed else 'FAIL'} (max |logit diff| {gate.max_abs_logit_diff:.3e})")
    print(format_table(report))
    del engine
    _free(args.device)
    verify = {"passed": gate.passed, "max_abs_logit_diff": gate.max_abs_logit_diff, "tolerance": gate.tolerance}
    return {"verify": verify, "verify_fp32": gate_in_fp32(args.device, folder), **report.as_json()}


def gate_in_fp32(device: str, folder: Path) -> dict[str, Any]:
    """The gate with the model loaded in float32 (cheap at this size): where the serving dtype's gate fails, this
    tells a bf16 rounding excursion (fp32 passes at 1e-4) from a stitching fault (fp32 fails too)."""
    engine = StitchEngine(load_model(folder, device=device, dtype=torch.float32))
    gate = run_gate(engine)
    del engine
    _free(device)
    verdict = "pass" if gate.passed else "FAIL"
    print(f"{folder.name}: fp32 gate {verdict} (max |logit diff| {gate.max_abs_logit_diff:.3e})")
    return {"passed": gate.passed, "max_abs_logit_diff": gate.max_abs_logit_diff, "tolerance": gate.tolerance}


def machine(device: str) -> dict[str, Any]:
    name = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else platform.processor()
    return {"device": name or platform.machine(), "torch": torch.__version__, "python": platform.python_version()}


def _free(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def run(args: argparse.Namespace, command: str) -> dict[str, Any]:
    work = Path(args.work_dir)
    began = time.perf_counter()
    files = make_data(args, work)
    train = [s for name, d in files.items() if name.startswith("train") for s in read_samples(d.file)]
    random.Random(args.seed).shuffle(train)  # the tokenizer's share of the questions covers every k
    test = read_samples(files["test"].file)
    models = work / "models"
    record: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command,
        "machine": machine(args.device),
        "data": {name: {**asdict(d), "file": d.file.name} for name, d in files.items()},
        "two_fact_share": args.two_fact_share,
    }
    log.info("training the base model")
    probe = read_samples(files["probe"].file)
    record["pretrain"] = train_base(args, train, probe, models / "base")
    save(record, args.json)
    log.info("block fine-tuning")
    record["finetune"] = block_finetune(args, models / "base", files["finetune"].file, models / "block-finetuned")
    save(record, args.json)
    record["eval"] = {}
    for name in ("base", "block-finetuned"):
        record["eval"][name] = check_model(args, models / name, test)
        save(record, args.json)
    record["seconds"] = round(time.perf_counter() - began, 1)
    save(record, args.json)
    return record


def save(record: dict[str, Any], path: str | None) -> None:
    """After every stage, so a run cut short still leaves what it measured."""
    if path:
        Path(path).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    run(args, " ".join(["python -m loadtest.quality_demo", *argv]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
