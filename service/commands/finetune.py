"""`kvstitch finetune`: block fine-tuning is offline training (`workers/training/`), so only this entry point
imports it; the served package never does."""

from __future__ import annotations

import logging
from argparse import Namespace

import torch

from service.quality.commands import _error


def run_finetune(args: Namespace, dtype: torch.dtype | None, compute_dtype: torch.dtype | None) -> int:
    from service.engine.model import UnsupportedModelError
    from service.engine.stitch import PositionMode
    from service.quality.dataset import QADataError
    from workers.training.finetune import FinetuneConfig, FinetuneError, finetune

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
    logging.getLogger("workers.training").setLevel(logging.INFO)
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
