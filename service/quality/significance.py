"""Paired significance of one row's accuracy against naive's on the same samples.

Both tests pair the samples (the same questions answered two ways), which is what makes a difference of a few
points on ~100 questions readable: most samples are right or wrong in both rows and carry no information.

- McNemar's exact test: of the discordant samples (right in one row only), `b` are right only in the row and `c`
  only in naive; under "no difference" each is a fair coin, so the two-sided p is the binomial tail
  2 * P(X <= min(b, c)), X ~ Binomial(b + c, 1/2), capped at 1 (1 when there is no discordant sample).
- A percentile bootstrap of the accuracy difference (row - naive): samples are drawn with replacement as pairs,
  `BOOTSTRAP_RESAMPLES` times from a fixed seed, so the interval repeats exactly.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0
CONFIDENCE = 0.95


def mcnemar_exact_p(only_row: int, only_reference: int) -> float:
    """Two-sided exact McNemar p from the discordant counts (b: right only in the row, c: only in the reference)."""
    if only_row < 0 or only_reference < 0:
        raise ValueError("discordant counts cannot be negative")
    n = only_row + only_reference
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(only_row, only_reference) + 1))
    return min(1.0, float(Fraction(2 * tail, 1 << n)))  # exact: 2**n overflows a float past 1023 pairs


def bootstrap_ci(
    row: Sequence[bool],
    reference: Sequence[bool],
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
    confidence: float = CONFIDENCE,
) -> tuple[float, float]:
    """Percentile bootstrap interval of mean(row) - mean(reference), resampling paired samples."""
    if len(row) != len(reference) or not row:
        raise ValueError("the bootstrap needs two equally long, non-empty lists of paired outcomes")
    if resamples < 1 or not 0.0 < confidence < 1.0:
        raise ValueError("the bootstrap needs resamples >= 1 and a confidence within (0, 1)")
    differences = [int(a) - int(b) for a, b in zip(row, reference, strict=True)]
    n = len(differences)
    draw = random.Random(seed)
    means = sorted(sum(draw.choices(differences, k=n)) / n for _ in range(resamples))
    tail = (1.0 - confidence) / 2
    low = means[math.floor(tail * (resamples - 1))]
    high = means[math.ceil((1.0 - tail) * (resamples - 1))]
    return low, high


@dataclass(frozen=True)
class Paired:
    """A row against naive on the same samples."""

    difference: float  # accuracy(row) - accuracy(naive)
    only_row: int  # samples right in the row and wrong in naive
    only_reference: int  # wrong in the row and right in naive
    p_value: float  # McNemar exact, two-sided
    ci_low: float  # bootstrap CI of `difference`
    ci_high: float


def paired(row: Sequence[bool], reference: Sequence[bool]) -> Paired:
    """Both tests of `row` against `reference` (the naive run's correctness on the same samples, in order)."""
    if len(row) != len(reference) or not row:
        raise ValueError("paired tests need two equally long, non-empty lists of outcomes")
    only_row = sum(1 for a, b in zip(row, reference, strict=True) if a and not b)
    only_reference = sum(1 for a, b in zip(row, reference, strict=True) if b and not a)
    low, high = bootstrap_ci(row, reference)
    difference = (sum(map(int, row)) - sum(map(int, reference))) / len(row)
    return Paired(difference, only_row, only_reference, mcnemar_exact_p(only_row, only_reference), low, high)
