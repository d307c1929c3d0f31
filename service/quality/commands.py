"""The `kvstitch eval | finetune | make-qa` commands: argparse namespaces in, exit codes out.

Exit codes: 0 done, 2 unusable input (a bad data line, an unknown or not-yet-available recompute spec, a model
that does not load), which is what argparse itself uses for bad usage.
"""

from __future__ import annotations

import json
import logging
import sys
from argparse import Namespace
from pathlib import Path

import torch


def _error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def run_eval(args: Namespace, dtype: torch.dtype | None) -> int:
    from service.engine.engine import StitchEngine
    from service.engine.model import UnsupportedModelError, load_model
    from service.quality.dataset import QADataError, read_samples
    from service.quality.eval import (
        RecomputeUnavailableError,
        check_available,
        evaluate,
        format_table,
        parse_recompute,
        table_variants,
    )

    if args.limit is not None and args.limit < 1:
        return _error("--limit must be at least 1")
    if args.max_new_tokens < 1:
        return _error("--max-new-tokens must be at least 1")
    try:
        recomputes = dict.fromkeys(parse_recompute(s) for s in args.recompute or ["none"])  # once each, in order
        variants = table_variants(list(recomputes))
        for variant in variants:
            check_available(variant)
        samples = read_samples(args.data, args.limit)
    except (RecomputeUnavailableError, QADataError, ValueError, OSError) as err:
        return _error(str(err))
    logging.getLogger("service.quality").setLevel(logging.INFO)  # progress lines on stderr
    try:
        engine = StitchEngine(load_model(args.model, device=args.device, dtype=dtype))
    except (UnsupportedModelError, OSError, ValueError) as err:
        return _error(f"cannot load {args.model}: {err}")
    try:
        report = evaluate(engine, samples, variants, args.max_new_tokens, Path(args.data).name)
    except QADataError as err:
        return _error(str(err))
    print(format_table(report))
    if args.json:
        record = {"model": args.model, "data": args.data, **report.as_json()}
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return 0


def run_finetune(args: Namespace, dtype: torch.dtype | None, compute_dtype: torch.dtype | None) -> int:
    from service.engine.model import UnsupportedModelError
    from service.engine.stitch import PositionMode
    from service.quality.dataset import QADataError
    from service.quality.finetune import FinetuneConfig, FinetuneError, finetune

    config = FinetuneConfig(
        model=args.model,
        data=args.data,
        out=args.out,
        steps=args.steps,
        lr=args.lr,
        batch_size=args.batch_size,
        warmup_steps=args.warmup_steps,
        full_attention_share=args.full_attention_share,
        positions=PositionMode(args.positions),
        lora=args.lora,
        device=args.device,
        dtype=dtype,
        compute_dtype=compute_dtype,
        seed=args.seed,
    )
    logging.getLogger("service.quality").setLevel(logging.INFO)
    try:
        report = finetune(config)
    except (FinetuneError, QADataError, UnsupportedModelError, OSError) as err:
        return _error(str(err))
    last = report.losses[-1]
    print(
        f"fine-tuned {len(report.losses)} steps ({report.block_samples} block, {report.full_attention_samples} "
        f"full-attention samples); last loss {last:.4f}; saved to {report.out}"
    )
    return 0


def run_make_qa(args: Namespace) -> int:
    from service.quality.generator import write_qa_file

    try:
        path = write_qa_file(args.out, args.questions, args.chunks, args.seed, args.two_fact_share)
    except (ValueError, OSError) as err:
        return _error(str(err))
    print(f"wrote {args.questions} questions of {args.chunks} chunks to {path}")
    return 0
