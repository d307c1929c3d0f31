"""The `kvstitch eval | finetune | make-qa` commands: argparse namespaces in, exit codes out.

Exit codes: 0 done, 2 unusable input (a bad data line, a malformed recompute spec, a model that does not load),
which is what argparse itself uses for bad usage.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from argparse import Namespace
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from service.settings import CONTEXT_TEMPERATURE_RANGE, MAX_INSTRUCTION_CHARS

if TYPE_CHECKING:  # the commands import their modules late: the CLI starts fast
    from service.engine.engine import StitchEngine
    from service.quality.answers import AnswerSink, Resume
    from service.quality.dataset import QASample
    from service.quality.eval import EvalReport, Variant

# The eval's default system-message addition for QA files: the rows score short answers, and a model that explains
# its answer would be scored on its first sentence. The corpus form defaults to none (it measures what /ask serves).
DEFAULT_INSTRUCTION = "Answer with a short phrase copied from the documents, without explanation."


def _error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def _temperature(value: float, flag: str = "--context-temperature") -> float:
    low, high = CONTEXT_TEMPERATURE_RANGE
    if not low <= value <= high:
        raise ValueError(f"{flag} {value:g} is outside {low:g}..{high:g}")
    return value


def run_eval(args: Namespace, dtype: torch.dtype | None) -> int:
    """`kvstitch eval`: a QA file (`--data`), or a user's questions over an ingested corpus (`--data-dir`)."""
    from service.engine.kv_layout import SERVED_CHUNK_CONTEXT, ChunkContext
    from service.engine.recompute_spec import parse_recompute
    from service.quality.dataset import QADataError
    from service.quality.eval import MAX_BATCH, table_variants

    corpus_form = args.data_dir is not None or args.questions is not None
    if corpus_form == (args.data is not None) or (corpus_form and not (args.data_dir and args.questions)):
        return _error("give either --data FILE.jsonl, or --data-dir DIR with --questions FILE.txt")
    if args.limit is not None and args.limit < 1:
        return _error("--limit must be at least 1")
    if args.offset < 0:
        return _error("--offset must be at least 0")
    if args.instruction is not None and len(args.instruction) > MAX_INSTRUCTION_CHARS:
        return _error(f"--instruction has {len(args.instruction)} characters; at most {MAX_INSTRUCTION_CHARS}")
    if args.max_new_tokens < 1:
        return _error("--max-new-tokens must be at least 1")
    if args.resume and (args.answers is None or corpus_form):
        return _error("--resume takes --data FILE.jsonl and --answers FILE: it reads back the answers written")
    if not 1 <= args.batch <= MAX_BATCH:
        return _error(f"--batch must be within 1..{MAX_BATCH}")
    refused = _recommend_refused(args, corpus_form)
    if refused:
        return _error(refused)
    try:
        recomputes = dict.fromkeys(parse_recompute(s) for s in args.recompute or ["none"])  # once each, in order
        contexts = dict.fromkeys(ChunkContext(c) for c in args.chunk_context or [SERVED_CHUNK_CONTEXT])
        temperatures = dict.fromkeys(_temperature(t) for t in args.context_temperature or [1.0])
        scales = dict.fromkeys(_temperature(s, "--context-scale") for s in args.context_scale or [1.0])
        variants = table_variants(list(recomputes), list(contexts), list(temperatures), list(scales))
    except (QADataError, ValueError) as err:
        return _error(str(err))
    if any(s != 1.0 for s in scales) and args.kv_path != "shared":
        return _error("--context-scale needs --kv-path shared: the copy path attends over one stitched sequence")
    if corpus_form:
        return _eval_corpus(args, dtype, variants)
    return _eval_file(args, dtype, variants)


def _eval_file(args: Namespace, dtype: torch.dtype | None, variants: list[Variant]) -> int:
    from service.quality.answers import NOTHING_TO_RESUME, sample_key
    from service.quality.dataset import QADataError, read_samples
    from service.quality.eval import evaluate, restored_report
    from service.quality.progress import Progress

    instruction = DEFAULT_INSTRUCTION if args.instruction is None else args.instruction
    try:
        run = _run_fingerprint(args, dtype, instruction)
        samples = read_samples(args.data, args.limit, args.offset)
        resumed = _resume(args.answers, samples, variants, run) if args.resume else NOTHING_TO_RESUME
    except (QADataError, OSError, RuntimeError) as err:  # RuntimeError: torch's word on a malformed --device
        return _error(str(err))
    remaining = [s for s in samples if sample_key(s.id, s.line) not in resumed.done]
    record = {"model": args.model, "data": args.data, **_window_record(args, instruction)}
    if not remaining:  # every sample of the range was answered: no model to load
        report = restored_report(variants, resumed.kept, args.max_new_tokens)
        return _report(args, report, record) or _recommend(args, dtype, variants, report)
    engine = _engine(args, dtype, instruction)
    if engine is None:
        return 2
    try:
        with _answers_file(args.answers, append=args.resume, run=run) as answers:
            progress = Progress(len(remaining), sys.stderr)
            source = Path(args.data).name
            shared = args.kv_path == "shared"
            report = evaluate(
                engine,
                remaining,
                variants,
                args.max_new_tokens,
                source,
                answers,
                progress,
                shared,
                restored=resumed.kept,
                batch=args.batch,
            )
    except (QADataError, OSError) as err:
        return _error(str(err))
    return _report(args, report, record) or _recommend(args, dtype, variants, report)


def _recommend_refused(args: Namespace, corpus_form: bool) -> str | None:
    """Why `--recommend` cannot be done here (checked before any answer is computed), or None."""
    from service.quality.measured import MEASURED_FILE

    if args.recommend is None:
        return None
    if corpus_form:
        return "--recommend needs --data FILE.jsonl: it chooses by accuracy against reference answers"
    if not 0.0 < args.recommend <= 1.0:
        return f"--recommend takes the share of naive's accuracy to keep, within (0, 1], not {args.recommend:g}"
    folder = Path(args.model)
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        return f"--recommend writes {MEASURED_FILE} into the model folder: {args.model} is no writable folder"
    return None


def _recommend(args: Namespace, dtype: torch.dtype | None, variants: Sequence[Variant], report: EvalReport) -> int:
    """`--recommend KEEP`: choose the recompute to serve by default from the turbo reordered rows (the first, in the
    order given, that keeps KEEP of naive's accuracy) and write it beside the model, with its fingerprint."""
    from service.engine.model import default_dtype, load_model_shell
    from service.engine.stitch import PositionMode
    from service.kvcache.keys import dtype_name, model_fingerprint
    from service.quality.measured import Candidate, MeasuredRecompute, choose, write_measured

    if args.recommend is None:
        return 0
    naive = report.rows[0].accuracy
    if not naive:
        return _error("--recommend: naive answered no sample correctly, so there is no accuracy to keep")
    candidates = [
        Candidate(str(v.recompute), v.context.value, row.accuracy, row.accuracy / naive)
        for v, row in zip(variants, report.rows, strict=True)
        if v.positions is PositionMode.REORDERED and v.temperature == v.scale == 1.0 and row.accuracy is not None
    ]
    try:
        chosen, met = choose(candidates, args.recommend)
    except ValueError as err:
        return _error(f"--recommend: {err}")
    loaded = dtype or default_dtype(torch.device(args.device))
    shell = load_model_shell(args.model, loaded)
    measured = MeasuredRecompute(
        chosen.recompute,
        chosen.chunk_context,
        met,
        args.recommend,
        model_fingerprint(shell),
        dtype_name(loaded),
        report.samples,
        naive,
        Path(args.data).name,
        tuple(candidates),
    )
    path = write_measured(Path(args.model), measured)
    verdict = "" if met else f"; none kept {args.recommend:.0%}: the most accurate was chosen, consider mode naive"
    print(
        f"recommended recompute {chosen.recompute} (chunk context {chosen.chunk_context}): kept {chosen.kept:.0%} "
        f"of naive's accuracy on {report.samples} samples{verdict}; wrote {path}"
    )
    return 0


def _run_fingerprint(args: Namespace, dtype: torch.dtype | None, instruction: str) -> str:
    """This file-form run's `run_fingerprint`, its dtype resolved as `load_model` resolves it (the device only
    picks the default dtype; it is not in the fingerprint)."""
    from service.engine.model import default_dtype
    from service.quality.answers import run_fingerprint

    loaded = dtype or default_dtype(torch.device(args.device))
    dtype_name = str(loaded).removeprefix("torch.")
    return run_fingerprint(args.model, args.data, args.max_new_tokens, instruction, dtype_name)


def _resume(path: str, samples: Sequence[QASample], variants: Sequence[Variant], run: str) -> Resume:
    """`--resume`: the answers file's finished samples of this range, the partial one's records removed; says on
    stderr what it found."""
    from service.quality.answers import resume_answers, sample_key
    from service.quality.dataset import QADataError

    golds = {sample_key(s.id, s.line): s.answers for s in samples}
    if len(golds) < len(samples):
        raise QADataError(f"{path}: two samples of the range share an id: --resume cannot tell their answers apart")
    resumed = resume_answers(Path(path), golds, [v.label for v in variants], run)
    print(
        f"resuming {path}: {len(resumed.done)} of {len(samples)} samples answered by every row, "
        f"{resumed.dropped} records of partly answered samples removed, {len(samples) - len(resumed.done)} to answer",
        file=sys.stderr,
    )
    return resumed


def _eval_corpus(args: Namespace, dtype: torch.dtype | None, variants: list[Variant]) -> int:
    from service.quality.corpus_eval import CorpusError, corpus_cases, open_corpus, read_questions
    from service.quality.dataset import QADataError
    from service.quality.eval import evaluate_cases
    from service.quality.progress import Progress
    from service.settings import Settings

    try:
        settings = Settings(model=args.model, data_dir=args.data_dir)
        if not 1 <= args.top_k <= settings.max_top_k:
            return _error(f"--top-k must be within 1..{settings.max_top_k} (KVSTITCH_MAX_TOP_K)")
        questions = read_questions(args.questions, settings.max_question_chars, args.limit, args.offset)
    except (QADataError, ValueError, OSError) as err:
        return _error(str(err))
    instruction = args.instruction or ""  # as /ask prompts, unless asked otherwise
    engine = _engine(args, dtype, instruction)
    if engine is None:
        return 2
    source = Path(args.questions).name
    try:
        with open_corpus(settings) as corpus, _answers_file(args.answers) as answers:
            cases = corpus_cases(engine, corpus, questions, args.top_k, args.max_new_tokens, source)
            progress = Progress(len(questions), sys.stderr, "questions")
            shared = args.kv_path == "shared"
            report = evaluate_cases(
                engine, cases, variants, args.max_new_tokens, answers, progress, shared, batch=args.batch
            )
    except (CorpusError, QADataError, OSError, RuntimeError) as err:  # Qdrant's lock on a served data dir
        return _error(str(err))
    record = {"model": args.model, "data_dir": args.data_dir, "questions": args.questions, "top_k": args.top_k}
    return _report(args, report, {**record, **_window_record(args, instruction)})


def _window_record(args: Namespace, instruction: str) -> dict[str, Any]:
    window = {"offset": args.offset, "limit": args.limit, "instruction": instruction, "kv_path": args.kv_path}
    return {**window, "batch": args.batch}


@contextlib.contextmanager
def _answers_file(path: str | None, append: bool = False, run: str | None = None) -> Iterator[AnswerSink | None]:
    """`--answers OUT.jsonl`: one JSON line per sample per row, written as each is scored (a stopped run keeps
    what it finished); emptied first unless `append` (`--resume`). `run`: the fingerprint each record carries
    (the file form's, which `--resume` checks)."""
    from service.quality.answers import answers_sink

    if path is None:
        yield None
        return
    with answers_sink(Path(path), append, run) as write:
        yield write


def _engine(args: Namespace, dtype: torch.dtype | None, instruction: str = "") -> StitchEngine | None:
    """The engine as the server builds it (with `instruction` added to the system message), or None after printing
    why the model does not load."""
    from service.engine.engine import StitchEngine
    from service.engine.kv_path import choose_kv_path
    from service.engine.model import UnsupportedModelError, load_model
    from service.engine.prompt import build_template

    try:
        model = load_model(args.model, device=args.device, dtype=dtype)
        engine = StitchEngine(model, template=build_template(model.tokenizer, system_extra=instruction))
    except (UnsupportedModelError, OSError, ValueError) as err:
        _error(f"cannot load {args.model}: {err}")
        return None
    path = choose_kv_path("on" if args.kv_path == "shared" else "off", model.spec)
    if args.kv_path == "shared" and not path.shared:
        _error(f"--kv-path shared cannot run here: {path.detail}")
        return None
    return engine


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
