"""The `kvstitch eval | finetune | make-qa` commands: argparse namespaces in, exit codes out.

Exit codes: 0 done, 2 unusable input (a bad data line, a malformed recompute spec, a model that does not load),
which is what argparse itself uses for bad usage.
"""

from __future__ import annotations

import json
import logging
import sys
from argparse import Namespace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # the commands import their modules late: the CLI starts fast
    from service.engine.engine import StitchEngine
    from service.quality.eval import EvalReport, Variant


def _error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def run_eval(args: Namespace, dtype: torch.dtype | None) -> int:
    """`kvstitch eval`: a QA file (`--data`), or a user's questions over an ingested corpus (`--data-dir`)."""
    from service.engine.recompute_spec import parse_recompute
    from service.quality.dataset import QADataError
    from service.quality.eval import table_variants

    corpus_form = args.data_dir is not None or args.questions is not None
    if corpus_form == (args.data is not None) or (corpus_form and not (args.data_dir and args.questions)):
        return _error("give either --data FILE.jsonl, or --data-dir DIR with --questions FILE.txt")
    if args.limit is not None and args.limit < 1:
        return _error("--limit must be at least 1")
    if args.max_new_tokens < 1:
        return _error("--max-new-tokens must be at least 1")
    try:
        recomputes = dict.fromkeys(parse_recompute(s) for s in args.recompute or ["none"])  # once each, in order
        variants = table_variants(list(recomputes))
    except (QADataError, ValueError) as err:
        return _error(str(err))
    logging.getLogger("service.quality").setLevel(logging.INFO)  # progress lines on stderr
    if corpus_form:
        return _eval_corpus(args, dtype, variants)
    return _eval_file(args, dtype, variants)


def _eval_file(args: Namespace, dtype: torch.dtype | None, variants: list[Variant]) -> int:
    from service.quality.dataset import QADataError, read_samples
    from service.quality.eval import evaluate

    try:
        samples = read_samples(args.data, args.limit)
    except (QADataError, OSError) as err:
        return _error(str(err))
    engine = _engine(args, dtype)
    if engine is None:
        return 2
    try:
        report = evaluate(engine, samples, variants, args.max_new_tokens, Path(args.data).name)
    except QADataError as err:
        return _error(str(err))
    return _report(args, report, {"model": args.model, "data": args.data})


def _eval_corpus(args: Namespace, dtype: torch.dtype | None, variants: list[Variant]) -> int:
    from service.quality.corpus_eval import CorpusError, corpus_cases, open_corpus, read_questions
    from service.quality.dataset import QADataError
    from service.quality.eval import evaluate_cases
    from service.settings import Settings

    try:
        settings = Settings(model=args.model, data_dir=args.data_dir)
        if not 1 <= args.top_k <= settings.max_top_k:
            return _error(f"--top-k must be within 1..{settings.max_top_k} (KVSTITCH_MAX_TOP_K)")
        questions = read_questions(args.questions, settings.max_question_chars, args.limit)
    except (QADataError, ValueError, OSError) as err:
        return _error(str(err))
    engine = _engine(args, dtype)
    if engine is None:
        return 2
    source = Path(args.questions).name
    try:
        with open_corpus(settings) as corpus:
            cases = corpus_cases(engine, corpus, questions, args.top_k, args.max_new_tokens, source)
            report = evaluate_cases(engine, cases, len(questions), variants, args.max_new_tokens)
    except (CorpusError, QADataError, OSError, RuntimeError) as err:  # Qdrant's lock on a served data dir
        return _error(str(err))
    record = {"model": args.model, "data_dir": args.data_dir, "questions": args.questions, "top_k": args.top_k}
    return _report(args, report, record)


def _engine(args: Namespace, dtype: torch.dtype | None) -> StitchEngine | None:
    """The engine as the server builds it, or None after printing why the model does not load."""
    from service.engine.engine import StitchEngine
    from service.engine.model import UnsupportedModelError, load_model

    try:
        return StitchEngine(load_model(args.model, device=args.device, dtype=dtype))
    except (UnsupportedModelError, OSError, ValueError) as err:
        _error(f"cannot load {args.model}: {err}")
        return None


def _report(args: Namespace, report: EvalReport, record: dict[str, Any]) -> int:
    from service.quality.eval import format_table

    print(format_table(report))
    if args.json:
        Path(args.json).write_text(json.dumps({**record, **report.as_json()}, indent=2) + "\n", encoding="utf-8")
    return 0


def run_make_qa(args: Namespace) -> int:
    from service.quality.generator import write_qa_file

    try:
        path = write_qa_file(args.out, args.questions, args.chunks, args.seed, args.two_fact_share)
    except (ValueError, OSError) as err:
        return _error(str(err))
    print(f"wrote {args.questions} questions of {args.chunks} chunks to {path}")
    return 0
