"""The quality eval: each variant (naive, turbo reordered, turbo composite, each turbo one with a recompute spec)
answers every sample greedily through the server's scheduler (`service.engine.offline`: the path `/ask` runs);
rows compare it with the answers and with a naive reference run.

Every sample is built from token ids as the service builds it: each chunk encoded on its own without special
tokens (the chunker's convention), wrapped by `template.chunk_block`, the question by `engine.encode_question`.
Chunk KV is precomputed once per sample, outside the timed path, so `ttft_ms` is the served time of a request
whose blocks are already on the device: stitch + recompute (if any) + question prefill + first token (naive: the
full prefill).

The reference is a separate naive run, so the naive row compares two independent runs: its agreement of 1.0 and
KL of 0 are a check of determinism that every table carries, not a definition. Each row's accuracy is compared
with the reference's on the same samples (McNemar's exact p and a paired bootstrap interval, `significance.py`);
accuracy is the short-answer rule of `metrics.py`.

`batch` > 1 answers the samples that many at a time: each row's answers to a batch go through one scheduler run, as
concurrent requests to a server do. Every sample's record is the one-at-a-time run's (greedy; equal on the CPU in
fp32), but a request's TTFT then includes its batch's other prefills, so the TTFT column is not measured (None),
and the KL column reads the first-token distribution each answer's first token was picked from (kept by the
scheduler) instead of a prefill of its own: the same distribution up to float rounding, on the row's own KV path.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from service.engine.batch_request import BatchRequest
from service.engine.engine import GenerationMode, StitchEngine
from service.engine.kv_layout import ChunkContext, KVBlock
from service.engine.offline import OfflineScheduler, answer_request
from service.engine.prompt import PromptIds, encode_text
from service.engine.recompute_spec import NO_RECOMPUTE, RecomputeSpec
from service.engine.sampling import SamplingParams
from service.engine.stitch import PositionMode
from service.quality.answers import AnswerRecord, AnswerSink, sample_key
from service.quality.dataset import QADataError, QASample
from service.quality.metrics import answer_span, best_f1, contains_answer, kl_divergence, short_answer_correct
from service.quality.progress import Progress
from service.quality.significance import paired

DEFAULT_MAX_NEW_TOKENS = 32
MAX_BATCH = 256  # samples answered together at most (`--batch`); the scheduler decodes its max batch of them at once


@dataclass(frozen=True)
class Variant:
    """One way of answering: a row of the table. `positions` is None for naive (plain positions 0..N-1)."""

    mode: GenerationMode
    positions: PositionMode | None = None
    recompute: RecomputeSpec = NO_RECOMPUTE
    context: ChunkContext = ChunkContext.ALONE  # what the chunks' KV was precomputed after (turbo)
    temperature: float = 1.0  # APE's attention temperature on chunk keys (turbo)
    scale: float = 1.0  # APE's scale on the context's log-sum-exp (turbo, shared chunks only)

    @property
    def mode_label(self) -> str:
        """`turbo`, `turbo@prefix` for chunks precomputed after the prefix, `...:T0.8` under a context temperature,
        `...:S0.9` under a context scale (naive has no chunk KV)."""
        if self.mode is GenerationMode.NAIVE:
            return self.mode.value
        label = self.mode.value if self.context is ChunkContext.ALONE else f"{self.mode.value}@{self.context.value}"
        label = label if self.temperature == 1.0 else f"{label}:T{self.temperature:g}"
        return label if self.scale == 1.0 else f"{label}:S{self.scale:g}"

    @property
    def label(self) -> str:
        return f"{self.mode_label}/{self.positions.value if self.positions else '-'}/{self.recompute}"


NAIVE = Variant(GenerationMode.NAIVE)


def table_variants(
    recomputes: Sequence[RecomputeSpec] = (NO_RECOMPUTE,),
    contexts: Sequence[ChunkContext] = (ChunkContext.ALONE,),
    temperatures: Sequence[float] = (1.0,),
    scales: Sequence[float] = (1.0,),
) -> list[Variant]:
    """Naive, then turbo reordered and composite for each chunk context, context temperature and scale and recompute
    setting (TurboRAG's Table 1 rows); composite only without recompute, which it refuses (`COMPOSITE_RECOMPUTE`)."""
    turbo = [
        Variant(GenerationMode.TURBO, positions, recompute, context, temperature, scale)
        for context in contexts
        for temperature in temperatures
        for scale in scales
        for recompute in recomputes
        for positions in (PositionMode.REORDERED, PositionMode.COMPOSITE)
        if positions is PositionMode.REORDERED or not recompute.active
    ]
    return [NAIVE, *turbo]


@contextmanager
def variant_engine(engine: StitchEngine, variant: Variant) -> Iterator[None]:
    """The engine precomputing chunks of the variant's context and stitching them at its temperature for the time
    of one variant: the eval owns its engine and runs one variant's requests at a time (alone or a batch of them),
    so switching it reaches nothing else."""
    before = engine.chunk_context, engine.context_temperature, engine.context_scale
    engine.chunk_context, engine.context_temperature = variant.context, variant.temperature
    engine.context_scale = variant.scale
    try:
        yield
    finally:
        engine.chunk_context, engine.context_temperature, engine.context_scale = before


@dataclass(frozen=True)
class Case:
    """One sample as the engine sees it: its prompt ids and its chunks' precomputed KV."""

    sample: QASample
    prompt: PromptIds
    chunk_kv: list[KVBlock]  # precomputed in `context`
    context: ChunkContext = ChunkContext.ALONE
    other_kv: dict[ChunkContext, list[KVBlock]] = field(default_factory=dict)  # other contexts, computed lazily

    def kv_for(self, engine: StitchEngine, context: ChunkContext) -> list[KVBlock]:
        """The chunks' KV precomputed after `context` (the engine already set to it: `chunk_context`)."""
        if context is self.context:
            return self.chunk_kv
        if context not in self.other_kv:
            self.other_kv[context] = engine.precompute(self.prompt.blocks)
        return self.other_kv[context]


@dataclass(frozen=True)
class Outcome:
    """One variant's greedy answer to one case."""

    token_ids: tuple[int, ...]  # as generated, a final EOS included
    text: str
    first_logits: torch.Tensor  # fp32 [vocab], the distribution of the first answer token
    ttft_ms: float | None  # None: not measured (answered in a batch)


def prepare(engine: StitchEngine, sample: QASample, max_new_tokens: int, source: str = "data") -> Case:
    """Token ids of a sample (chunks like the chunker encodes them) and its chunks' KV; QADataError when the
    prompt and the answer budget do not fit the model's context."""
    chunk_ids = [encode_text(engine.tokenizer, chunk) for chunk in sample.chunks]
    prompt = engine.template.prompt(chunk_ids, engine.encode_question(sample.question))
    needed = len(prompt.joined()) + max_new_tokens
    if needed > engine.spec.max_context:
        raise QADataError(
            f"{source} line {sample.line}: the prompt ({len(prompt.joined())} tokens) and {max_new_tokens} new "
            f"tokens exceed the model's context of {engine.spec.max_context}"
        )
    return Case(sample, prompt, engine.precompute(prompt.blocks), engine.chunk_context)


def first_token_logits(engine: StitchEngine, case: Case, variant: Variant) -> torch.Tensor:
    """The variant's logits for the first answer token (a prefill of its own, outside the timed path)."""
    if variant.mode is GenerationMode.NAIVE:
        return engine.prefill_naive(case.prompt)[1].float().cpu()
    positions = variant.positions or PositionMode.REORDERED
    question = case.prompt.question
    chunk_kv = case.kv_for(engine, variant.context)
    buffer, plan = engine.stitch(chunk_kv, positions, len(question))
    engine.recompute(buffer, plan, chunk_kv, variant.recompute, question)  # as the scheduler does, before the question
    return engine.prefill_question(buffer, question).float().cpu()


def variant_request(
    engine: StitchEngine, case: Case, variant: Variant, sampling: SamplingParams, keep_first_logits: bool = False
) -> BatchRequest:
    """The variant's request for the case, as `generate` builds it (the engine already set to the variant:
    `variant_engine`)."""
    chunk_kv = case.kv_for(engine, variant.context) if variant.mode is GenerationMode.TURBO else None
    positions = variant.positions or PositionMode.REORDERED
    return answer_request(
        case.prompt,
        sampling,
        variant.mode,
        positions,
        chunk_kv,
        recompute=variant.recompute,
        keep_first_logits=keep_first_logits,
    )


def run_variant(runner: OfflineScheduler, case: Case, variant: Variant, sampling: SamplingParams) -> Outcome:
    """Generate greedily through the server's scheduler (`runner`, the served path), alone and timed, then read the
    first-token distribution."""
    engine = runner.engine
    with variant_engine(engine, variant):
        result = runner.run([variant_request(engine, case, variant, sampling)])[0]
        logits = first_token_logits(engine, case, variant)
    return Outcome(tuple(result.token_ids), result.text, logits, result.timings.ttft_ms)


def run_variant_batch(
    runner: OfflineScheduler, cases: Sequence[Case], variant: Variant, sampling: SamplingParams
) -> list[Outcome]:
    """Generate greedily for every case in one scheduler run (the engine set to the variant for all of it); the
    outcomes in order, untimed, each with the first-token distribution its first token was picked from."""
    engine = runner.engine
    with variant_engine(engine, variant):
        requests = [variant_request(engine, case, variant, sampling, keep_first_logits=True) for case in cases]
        results = runner.run(requests)
    return [
        Outcome(tuple(result.token_ids), result.text, _kept_logits(request), None)
        for request, result in zip(requests, results, strict=True)
    ]


def _kept_logits(request: BatchRequest) -> torch.Tensor:
    if request.first_logits is None:  # every answer has a first token: the scheduler keeps its logits there
        raise RuntimeError("the scheduler kept no first-token logits for an answer")
    return request.first_logits


def answer_all(
    runner: OfflineScheduler, cases: Sequence[Case], variant: Variant, sampling: SamplingParams, timed: bool
) -> list[Outcome]:
    """The variant's outcomes for `cases`: one request at a time (`timed`: TTFT measured, KL from a prefill of its
    own, `run_variant`), else together (`run_variant_batch`)."""
    if timed:
        return [run_variant(runner, case, variant, sampling) for case in cases]
    return run_variant_batch(runner, cases, variant, sampling)


@dataclass
class Scores:
    """Per-sample scores of one variant; `row` reduces them. `reference_correct` is the naive reference run's
    correctness on the same samples, in order: the pair the significance tests compare."""

    variant: Variant
    correct: list[bool] = field(default_factory=list)
    contains: list[bool] = field(default_factory=list)
    reference_correct: list[bool] = field(default_factory=list)
    f1: list[float] = field(default_factory=list)
    first_token_same: list[bool] = field(default_factory=list)
    answer_same: list[bool] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    ttft_ms: list[float] = field(default_factory=list)  # the measured ones (none in a batched run)

    def add(self, sample: QASample, outcome: Outcome, reference: Outcome) -> AnswerRecord:
        """Score one answer; returns its record for the answers file, which holds all the row reads of it."""
        correct = contains = f1 = reference_correct = None
        if sample.answers:  # a question of a user's own corpus has none: agreement and KL only
            correct = short_answer_correct(outcome.text, sample.answers, sample.question)
            contains = contains_answer(outcome.text, sample.answers)
            f1 = best_f1(answer_span(outcome.text), sample.answers)
            reference_correct = short_answer_correct(reference.text, sample.answers, sample.question)
        record: AnswerRecord = {
            "id": sample.id,
            "line": sample.line,
            "variant": self.variant.label,
            "answer": outcome.text,
            "gold": list(sample.answers),
            "correct": correct,
            "contains": contains,
            "f1": f1,
            "reference_correct": reference_correct,
            "first_token_agreement": outcome.token_ids[:1] == reference.token_ids[:1],
            "answer_agreement": outcome.token_ids == reference.token_ids,
            "kl_first_token": kl_divergence(reference.first_logits, outcome.first_logits),
            "ttft_ms": outcome.ttft_ms,
        }
        self.take(record)
        return record

    def take(self, record: AnswerRecord) -> None:
        """Count one answer's record: one just scored, or one read back from the answers file of a resumed run
        (`answers.parse_record` has checked its fields), so a resumed table covers the samples of both."""
        if record["correct"] is not None:  # the four answer fields are set together (or none: no gold answers)
            self.correct.append(record["correct"])
            self.contains.append(record["contains"])
            self.f1.append(record["f1"])
            self.reference_correct.append(record["reference_correct"])
        self.first_token_same.append(record["first_token_agreement"])
        self.answer_same.append(record["answer_agreement"])
        self.kl.append(record["kl_first_token"])
        if record["ttft_ms"] is not None:  # a batched run times nothing
            self.ttft_ms.append(record["ttft_ms"])

    def row(self) -> Row:
        vs_naive = paired(self.correct, self.reference_correct) if self.correct else None
        return Row(
            mode=self.variant.mode_label,
            positions=self.variant.positions.value if self.variant.positions else None,
            recompute=str(self.variant.recompute),
            accuracy=_mean(self.correct) if self.correct else None,
            contains=_mean(self.contains) if self.contains else None,
            f1=_mean(self.f1) if self.f1 else None,
            accuracy_vs_naive=vs_naive.difference if vs_naive else None,
            p_mcnemar=vs_naive.p_value if vs_naive else None,
            ci95_low=vs_naive.ci_low if vs_naive else None,
            ci95_high=vs_naive.ci_high if vs_naive else None,
            first_token_agreement=_mean(self.first_token_same),
            answer_agreement=_mean(self.answer_same),
            kl_first_token=_mean(self.kl),
            ttft_ms=statistics.median(self.ttft_ms) if self.ttft_ms else None,
        )


def _mean(values: Sequence[float | bool]) -> float:
    return sum(float(v) for v in values) / len(values) if values else float("nan")


@dataclass(frozen=True)
class Row:
    """One line of the table (and of the JSON `rows`). The answer columns are None when the questions come
    without answers (the corpus form); `accuracy_vs_naive`, `p_mcnemar` and the CI compare `accuracy` with the
    naive reference run's on the same samples (`significance.py`)."""

    mode: str
    positions: str | None
    recompute: str
    accuracy: float | None  # short-answer rule (metrics.short_answer_correct)
    contains: float | None  # the answer anywhere in the text (the papers' lenient accuracy)
    f1: float | None
    accuracy_vs_naive: float | None
    p_mcnemar: float | None
    ci95_low: float | None
    ci95_high: float | None
    first_token_agreement: float
    answer_agreement: float
    kl_first_token: float
    ttft_ms: float | None  # None: not measured (a batched run, `evaluate`'s `batch`)

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class EvalReport:
    samples: int  # every sample the rows cover, those read back from a resumed run's answers file included
    max_new_tokens: int
    rows: list[Row]
    resumed: int = 0  # of `samples`, those answered by an earlier run and read back (`kvstitch eval --resume`)

    def as_json(self) -> dict[str, Any]:
        return {
            "samples": self.samples,
            "resumed_samples": self.resumed,
            "max_new_tokens": self.max_new_tokens,
            "rows": [r.as_json() for r in self.rows],
        }


def restored_scores(variants: Sequence[Variant], records: Sequence[AnswerRecord]) -> list[Scores]:
    """Each variant's scores holding the records read back from a resumed run's answers file (every record's row
    is one of `variants`: `answers.resume_answers` refuses others)."""
    scores = [Scores(v) for v in variants]
    by_label = {s.variant.label: s for s in scores}
    for record in records:
        by_label[record["variant"]].take(record)
    return scores


def samples_in(records: Sequence[AnswerRecord]) -> int:
    """How many samples `records` (one per sample per row) are of."""
    return len({sample_key(r["id"], r["line"]) for r in records})


def restored_report(variants: Sequence[Variant], records: Sequence[AnswerRecord], max_new_tokens: int) -> EvalReport:
    """The report of a resumed run that had nothing left to answer: the records read back alone."""
    samples = samples_in(records)
    return EvalReport(samples, max_new_tokens, [s.row() for s in restored_scores(variants, records)], samples)


def evaluate(
    engine: StitchEngine,
    samples: Sequence[QASample],
    variants: Sequence[Variant],
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    source: str = "data",
    answers: AnswerSink | None = None,
    progress: Progress | None = None,
    shared: bool = False,
    *,
    restored: Sequence[AnswerRecord] = (),
    batch: int = 1,
) -> EvalReport:
    """Score every variant on every sample against the answers and a naive reference run.

    Each variant runs once untimed on the first sample before the pass (lazy prefix KV, CUDA graph capture and
    allocator growth would otherwise land in the first TTFTs). `shared`: turbo answers read their chunks from a
    shared chunk arena, as a server with `KVSTITCH_SHARED_CHUNKS=on` serves them (`OfflineScheduler`).
    `restored`: records of other samples answered by an earlier run (`--resume`), counted in the rows too. `batch`:
    samples answered together (1..MAX_BATCH; above 1 nothing is timed and there is no warm-up: see the module).
    """
    cases = (prepare(engine, sample, max_new_tokens, source) for sample in samples)
    return evaluate_cases(
        engine, cases, variants, max_new_tokens, answers, progress, shared, restored=restored, batch=batch
    )


def evaluate_cases(
    engine: StitchEngine,
    cases: Iterable[Case],
    variants: Sequence[Variant],
    max_new_tokens: int,
    answers: AnswerSink | None = None,
    progress: Progress | None = None,
    shared: bool = False,
    *,
    restored: Sequence[AnswerRecord] = (),
    batch: int = 1,
) -> EvalReport:
    """`evaluate` over cases already built: a QA file's samples, or a user's questions with the chunks retrieved
    for them. `answers` receives each sample's records (one per row, in the rows' order) once all its rows are
    scored; `progress` advances per sample; `shared`, `restored` and `batch`: as `evaluate`'s (one at a time, the
    first-token distribution of the KL column stays the copy path's prefill)."""
    if not 1 <= batch <= MAX_BATCH:
        raise ValueError(f"batch must be within 1..{MAX_BATCH}, not {batch}")
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    scores = restored_scores(variants, restored)
    resumed = samples_in(restored)
    timed = batch == 1
    done = 0
    runner = OfflineScheduler(engine, shared=shared)
    try:
        for group in _batches(cases, batch):
            if done == 0 and timed:
                for variant in variants:
                    run_variant(runner, group[0], variant, sampling)
            for records in _score_group(runner, group, scores, sampling, timed):
                if answers is not None:
                    for record in records:
                        answers(record)
                done += 1
                if progress is not None:
                    progress.advance()
    finally:
        runner.close()
    return EvalReport(resumed + done, max_new_tokens, [s.row() for s in scores], resumed)


def _score_group(
    runner: OfflineScheduler, group: Sequence[Case], scores: Sequence[Scores], sampling: SamplingParams, timed: bool
) -> list[list[dict[str, Any]]]:
    """The naive reference's answers to the group, then each row's, scored: each sample's records, in order. One
    row's outcomes are held at a time (their first-token logits are a vocabulary each)."""
    references = answer_all(runner, group, NAIVE, sampling, timed)
    records: list[list[dict[str, Any]]] = [[] for _ in group]
    for score in scores:
        outcomes = answer_all(runner, group, score.variant, sampling, timed)
        for own, case, outcome, reference in zip(records, group, outcomes, references, strict=True):
            own.append(score.add(case.sample, outcome, reference))
    return records


def _batches(cases: Iterable[Case], size: int) -> Iterator[list[Case]]:
    """`cases`, `size` at a time (the last batch may be shorter). A case that cannot be built (its prompt too long
    for the model) ends the run as it does one at a time: the cases taken before it are answered first."""
    iterator = iter(cases)
    group: list[Case] = []
    while True:
        try:
            case = next(iterator, None)
        except Exception:
            if group:
                yield group
            raise
        if case is None:
            break
        group.append(case)
        if len(group) == size:
            yield group
            group = []
    if group:
        yield group


_COLUMNS = (
    ("mode", 13),
    ("positions", 10),
    ("recompute", 14),
    ("accuracy", 9),
    ("vs_naive", 8),
    ("ci95", 16),
    ("p", 7),
    ("contains", 8),
    ("f1", 6),
    ("ftok_agree", 10),
    ("ans_agree", 9),
    ("kl_ftok", 9),
    ("ttft_ms", 8),
)


def format_table(report: EvalReport) -> str:
    """A fixed-width table of the rows, for the terminal. `vs_naive`, `ci95` and `p`: the accuracy difference
    from the naive reference, its bootstrap 95 % interval and McNemar's exact p."""
    resumed = f" ({report.resumed} read back from the answers file)" if report.resumed else ""
    lines = [f"{report.samples} samples{resumed}, greedy, up to {report.max_new_tokens} new tokens"]
    lines.append(" ".join(name.ljust(width) for name, width in _COLUMNS).rstrip())
    for row in report.rows:
        ci = "-" if row.ci95_low is None or row.ci95_high is None else f"[{row.ci95_low:+.3f},{row.ci95_high:+.3f}]"
        cells = (
            row.mode,
            row.positions or "-",
            row.recompute,
            _cell(row.accuracy),
            "-" if row.accuracy_vs_naive is None else f"{row.accuracy_vs_naive:+.3f}",
            ci,
            "-" if row.p_mcnemar is None else f"{row.p_mcnemar:.4f}",
            _cell(row.contains),
            _cell(row.f1),
            f"{row.first_token_agreement:.3f}",
            f"{row.answer_agreement:.3f}",
            f"{row.kl_first_token:.2e}",
            "-" if row.ttft_ms is None else f"{row.ttft_ms:.2f}",
        )
        lines.append(" ".join(c.ljust(w) for c, (_, w) in zip(cells, _COLUMNS, strict=True)).rstrip())
    return "\n".join(lines)


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
