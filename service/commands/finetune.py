"""`kvstitch finetune`: block fine-tuning is offline training (`workers/training/`), so only this entry point
imports it; the served package never does."""

from __future__ import annotations

import logging
from argparse import Namespace

import torch

from service.quality.commands import _error


def run_finetune(args: Namespace, dtype: torch.dtype | None, compute_dtype: torch.dtype | None) -> int:
    from service.engine.kv_layout import ChunkContext
    from service.engine.model import UnsupportedModelError
    from service.engine.stitch import PositionMode
    from service.quality.dataset import QADataError
    from workers.training.finetune import FinetuneConfig, FinetuneError, finetune

    config = FinetuneConfig(
        model=args.model,
        data=args.data,
        out=args.out,
        data_dir=args.data_dir,
        distill_data=args.distill_data,
        prompts=args.prompts,
        top_k=args.top_k,
        answer_tokens=args.answer_tokens,
        label_share=args.label_share,
        steps=args.steps,
        lr=args.lr,
        batch_size=args.batch_size,
        micro_batch_size=args.micro_batch_size,
        generate_batch_size=args.generate_batch_size,
        warmup_steps=args.warmup_steps,
        full_attention_share=args.full_attention_share,
        positions=PositionMode(args.positions),
        chunk_context=ChunkContext(args.chunk_context),
        lora=args.lora,
        device=args.device,
        dtype=dtype,
        compute_dtype=compute_dtype,
        seed=args.seed,
        instruction=args.instruction,
    )
    logging.getLogger("workers.training").setLevel(logging.INFO)
    corpus_errors: tuple[type[Exception], ...] = ()
    if args.data_dir is not None:  # the corpus's modules need Qdrant's client; labelled QA and prompt files do not
        from service.quality.corpus_eval import CorpusError

        corpus_errors = (CorpusError,)
    refusals: tuple[type[Exception], ...] = (FinetuneError, QADataError, UnsupportedModelError, OSError, *corpus_errors)
    try:
        report = finetune(config)
    except refusals as err:
        return _error(str(err))
    except torch.cuda.OutOfMemoryError as err:  # attention memory grows with the square of a sample's length
        hint = "smaller --micro-batch-size (samples per forward; a step still has --batch-size samples)"
        return _error(f"{str(err).splitlines()[0]} Long prompts need a {hint}")
    except RuntimeError as err:  # embedded Qdrant's lock: a server still owns the data dir
        return _error(f"{args.data_dir}: {err}" if args.data_dir else str(err))
    last = report.losses[-1]
    print(
        f"fine-tuned {len(report.losses)} steps ({report.block_samples} block, {report.full_attention_samples} "
        f"full-attention samples; {report.labelled_samples} labelled, {report.distill_samples} self-distilled over "
        f"{report.distill_prompts} distillation prompts); {report.samples_per_s:.3g} samples/s; last loss {last:.4f}; "
        f"saved to {report.out}"
    )
    return 0
