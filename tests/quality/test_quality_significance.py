"""Paired significance: McNemar's exact p on known tables, the bootstrap interval on constructed data."""

from __future__ import annotations

import math

import pytest

from service.quality.significance import bootstrap_ci, mcnemar_exact_p, paired


@pytest.mark.parametrize(
    ("only_row", "only_reference", "p"),
    [
        (1, 9, 22 / 1024),  # 2 * (C(10,0) + C(10,1)) / 2**10
        (9, 1, 22 / 1024),  # two-sided: symmetric
        (2, 8, 112 / 1024),  # 2 * (1 + 10 + 45) / 1024 = 0.109375, as scipy's binomtest gives
        (0, 5, 2 / 32),
        (0, 1, 1.0),  # one discordant pair proves nothing
        (5, 5, 1.0),  # capped at 1
        (0, 0, 1.0),
    ],
)
def test_mcnemar_exact_p_on_known_tables(only_row: int, only_reference: int, p: float) -> None:
    assert mcnemar_exact_p(only_row, only_reference) == pytest.approx(p, rel=1e-12)


def test_mcnemar_on_many_pairs_stays_finite_and_tiny() -> None:
    p = mcnemar_exact_p(0, 2000)  # 2 / 2**2000 underflows a float: 0.0, never an overflow error
    assert p == 0.0
    assert mcnemar_exact_p(1000, 1000) == 1.0
    with pytest.raises(ValueError, match="negative"):
        mcnemar_exact_p(-1, 3)


def test_the_bootstrap_interval_covers_zero_when_the_rows_barely_differ() -> None:
    reference = [True, False] * 20
    row = list(reference)
    row[0], row[1] = False, True  # one sample each way: a difference of 0
    low, high = bootstrap_ci(row, reference)
    assert low < 0.0 < high
    assert bootstrap_ci(row, reference) == (low, high)  # fixed seed: the same interval every time


def test_the_bootstrap_interval_excludes_zero_for_a_clear_difference() -> None:
    reference = [False] * 40
    row = [True] * 15 + [False] * 25  # 15 samples better, none worse: +0.375
    low, high = bootstrap_ci(row, reference)
    assert 0.0 < low < 0.375 < high <= 1.0
    worse_low, worse_high = bootstrap_ci(reference, row)
    assert (worse_low, worse_high) == pytest.approx((-high, -low))  # the same draws, mirrored


def test_identical_rows_give_a_point_interval() -> None:
    outcomes = [True, False, True, True]
    assert bootstrap_ci(outcomes, outcomes) == (0.0, 0.0)
    with pytest.raises(ValueError, match="equally long"):
        bootstrap_ci([True], [True, False])


def test_paired_counts_the_discordant_samples() -> None:
    row = [True, True, False, False, True, True]
    reference = [True, False, True, False, False, False]
    result = paired(row, reference)
    assert (result.only_row, result.only_reference) == (3, 1)
    assert result.difference == pytest.approx(2 / 6)
    assert result.p_value == pytest.approx(2 * (1 + 4) / 16)
    assert result.ci_low <= result.difference <= result.ci_high
    assert math.isclose(result.p_value, mcnemar_exact_p(3, 1))
