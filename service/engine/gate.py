"""The correctness gate: stitched KV + question must equal the reference forward, to float tolerance.

Run by the tests, by `kvstitch verify`, and by the server at startup. With `shared` it also holds the zero-copy
path (chunks read from a shared arena by segment attention, RoPE applied per chunk offset: `shared_gate.py`) to the
same reference and the same tolerance, case by case.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from service.engine.engine import StitchEngine
from service.engine.reference import prompt_reference_logits
from service.engine.shared_gate import zero_copy_logits
from service.engine.stitch import PositionMode

FP32_TOLERANCE = 1e-4
# In fp32 too the round-off grows with the logits: a trained model's reach ~40, and a base model whose stitching
# was exact still differed by 1.3e-4 (docs/quality.md). The bound is 1e-4 or 1e-5 of the largest reference logit,
# whichever is larger; a position off by one differs by whole logits.
FP32_RELATIVE_TOLERANCE = 1e-5
# In bf16 the bound is relative to the size of the logits. On a Qwen2-7B-shaped random model stitched-bf16 and
# HF's own reference-bf16 each sit ~0.35 from an fp32 reference (max |logit| ~6.8, so ~5%), and differ from each
# other by at most 0.38; positions off by one differ by 4.7 or more. 10% of the largest reference logit separates
# the two with margin on both sides.
BF16_RELATIVE_TOLERANCE = 0.10
BF16_TOLERANCE = 0.25  # absolute bound for the tiny test models (logits ~3.5; measured diffs ~0.04)
DEFAULT_CHUNK_LENGTHS = (23, 7, 41, 12)
DEFAULT_QUESTION_LENGTH = 9


@dataclass(frozen=True)
class GateCase:
    order: tuple[int, ...]
    positions: PositionMode
    max_abs_logit_diff: float


@dataclass
class GateResult:
    """The copy path's cases (`passed`: what serving needs) and, where checked, the zero-copy path's (`shared_cases`,
    `shared_passed`: what the shared chunk arena needs), against one tolerance."""

    tolerance: float
    cases: list[GateCase] = field(default_factory=list)
    logit_scale: float = 0.0  # largest |reference logit| seen, which a relative bf16 bound scales with
    shared_cases: list[GateCase] = field(default_factory=list)

    @property
    def max_abs_logit_diff(self) -> float:
        return _largest(self.cases)

    @property
    def passed(self) -> bool:
        return _within(self.cases, self.tolerance)

    @property
    def shared_max_abs_logit_diff(self) -> float | None:
        """The zero-copy path's largest difference; None where it was not checked."""
        return _largest(self.shared_cases) if self.shared_cases else None

    @property
    def shared_passed(self) -> bool | None:
        """Whether the zero-copy path is within the tolerance; None where it was not checked."""
        return _within(self.shared_cases, self.tolerance) if self.shared_cases else None


def _largest(cases: Sequence[GateCase]) -> float:
    """The largest difference; NaN when there is none or any is NaN (`max` alone passes over a NaN after the
    first case, since every comparison with it is false)."""
    diffs = [c.max_abs_logit_diff for c in cases]
    return float("nan") if not diffs or any(d != d for d in diffs) else max(diffs)


def _within(cases: Sequence[GateCase], tolerance: float) -> bool:
    diff = _largest(cases)
    return bool(cases) and diff == diff and diff <= tolerance  # NaN (a poisoned slot read) fails


def default_tolerance(dtype: torch.dtype) -> float:
    return FP32_TOLERANCE if dtype == torch.float32 else BF16_TOLERANCE


def synthetic_ids(engine: StitchEngine, lengths: Sequence[int], seed: int) -> list[list[int]]:
    """Random ordinary (non-special) token ids, one list per requested length."""
    special = set(engine.tokenizer.all_special_ids)
    limit = min(len(engine.tokenizer), engine.spec.vocab_size)
    rng = random.Random(seed)
    pool = [t for t in range(limit) if t not in special]
    return [[rng.choice(pool) for _ in range(n)] for n in lengths]


def stitched_vs_reference(
    engine: StitchEngine,
    chunk_ids: Sequence[Sequence[int]],
    question_ids: Sequence[int],
    positions: PositionMode,
) -> float:
    """Max |logit difference| over every question token, stitched path against the reference."""
    return compare_with_reference(engine, chunk_ids, question_ids, positions)[0]


def compare_with_reference(
    engine: StitchEngine,
    chunk_ids: Sequence[Sequence[int]],
    question_ids: Sequence[int],
    positions: PositionMode,
) -> tuple[float, float]:
    """(max |stitched - reference| logit, max |reference| logit) over every question token."""
    diff, _, scale = compare_paths(engine, chunk_ids, question_ids, positions, shared=False)
    return diff, scale


def compare_paths(
    engine: StitchEngine,
    chunk_ids: Sequence[Sequence[int]],
    question_ids: Sequence[int],
    positions: PositionMode,
    shared: bool,
) -> tuple[float, float | None, float]:
    """(max |stitched - reference|, max |zero-copy - reference| or None unless `shared`, max |reference|) logit
    over the question's tokens: every one for the stitched path; for the zero-copy path the last of its first half
    (the extend) and each later one (a decode step each)."""
    prompt = engine.template.prompt(chunk_ids, question_ids)
    chunk_kv = engine.precompute(prompt.blocks)
    _, stitched, _ = engine.prefill_stitched(chunk_kv, prompt.question, positions, all_logits=True)
    ref = prompt_reference_logits(engine.model, prompt, positions, context=engine.chunk_context)
    ref = ref[-len(prompt.question) :]
    zero_copy = None
    if shared:
        split = max(1, len(prompt.question) // 2)
        logits = zero_copy_logits(engine, chunk_kv, prompt.question, positions, split)
        zero_copy = _max_diff(logits, ref[split - 1 :])
    return _max_diff(stitched, ref), zero_copy, float(ref.abs().max())


def _max_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest |difference|; NaN when any logit is NaN (`max` alone may skip a NaN on some devices)."""
    diff = (got - want).abs()
    return float("nan") if bool(diff.isnan().any()) else float(diff.max())


def gate_cases(
    engine: StitchEngine,
    chunk_lengths: Sequence[int] = DEFAULT_CHUNK_LENGTHS,
    question_length: int = DEFAULT_QUESTION_LENGTH,
    seed: int = 0,
) -> Iterator[tuple[tuple[int, ...], PositionMode, list[list[int]], list[int]]]:
    """The gate's cases: (order, position mode, chunk ids in that order, question ids) for uneven synthetic chunks
    in two orders and both position modes (also used by the precision scripts in loadtest/)."""
    chunks = synthetic_ids(engine, chunk_lengths, seed)
    question = synthetic_ids(engine, [question_length], seed + 1)[0]
    for order in (tuple(range(len(chunks))), tuple(reversed(range(len(chunks))))):
        for mode in PositionMode:
            yield order, mode, [chunks[i] for i in order], question


def run_gate(
    engine: StitchEngine,
    chunk_lengths: Sequence[int] = DEFAULT_CHUNK_LENGTHS,
    question_length: int = DEFAULT_QUESTION_LENGTH,
    tolerance: float | None = None,
    seed: int = 0,
    shared: bool = False,
) -> GateResult:
    """Several uneven chunks, in two orders, in both position modes; with `shared` the zero-copy path on each case
    too (the server asks where it serves shared chunks).

    Run at context temperature 1: the gate proves the block attention itself; a temperature T only divides the
    stitched chunk keys by T (`plan_positions`), which the reference forward has no way to express."""
    result = GateResult(tolerance if tolerance is not None else FP32_TOLERANCE)
    temperature, engine.context_temperature = engine.context_temperature, 1.0
    try:
        for order, mode, chunks, question in gate_cases(engine, chunk_lengths, question_length, seed):
            diff, zero_copy, scale = compare_paths(engine, chunks, question, mode, shared)
            result.cases.append(GateCase(order, mode, diff))
            if zero_copy is not None:
                result.shared_cases.append(GateCase(order, mode, zero_copy))
            result.logit_scale = max(result.logit_scale, scale)
    finally:
        engine.context_temperature = temperature
    if tolerance is None:
        result.tolerance = scaled_tolerance(engine.spec.dtype, result.logit_scale)
    return result


def scaled_tolerance(dtype: torch.dtype, logit_scale: float) -> float:
    """The gate's bound for a model whose largest reference logit is `logit_scale`."""
    if dtype == torch.float32:
        return max(FP32_TOLERANCE, FP32_RELATIVE_TOLERANCE * logit_scale)
    return BF16_RELATIVE_TOLERANCE * logit_scale
