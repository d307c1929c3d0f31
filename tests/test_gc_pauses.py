"""The garbage collector's pause histogram and the start-up freeze (service/serving/gc_pauses.py)."""

from __future__ import annotations

import gc

import pytest

from service.serving.gc_pauses import PAUSE_BUCKETS, GcPauses, PauseHistogram, freeze_startup_heap, set_young_threshold


def test_a_pause_counts_in_every_bucket_at_or_above_it() -> None:
    histogram = PauseHistogram()
    histogram.observe(0.003)
    histogram.observe(0.3)

    assert histogram.count == 2 and abs(histogram.seconds - 0.303) < 1e-12
    expected = [int(bound >= 0.003) + int(bound >= 0.3) for bound in PAUSE_BUCKETS]
    assert histogram.bucket_counts == expected
    assert expected[:2] == [0, 1] and expected[-1] == 2


def test_installed_pauses_time_each_collection_by_generation_until_uninstalled() -> None:
    pauses = GcPauses()
    pauses.install()
    pauses.install()  # once only
    try:
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
    finally:
        pauses.uninstall()
    full = pauses.by_generation[2]
    assert full.count >= 2 and full.seconds > 0 and full.bucket_counts[-1] <= full.count
    assert pauses.by_generation[0].count >= 1
    gc.collect(2)
    assert pauses.by_generation[2].count == full.count


def test_freezing_moves_live_objects_out_of_the_collectors_walk() -> None:
    before = gc.get_freeze_count()
    try:
        frozen = freeze_startup_heap()
        # A frozen object freed by its reference count (another thread's, pytest's) leaves the count at once, so
        # the count read afterwards may be a little lower than the one freeze returned, never higher.
        assert frozen > before and frozen - 100 < gc.get_freeze_count() <= frozen
        assert gc.get_count()[2] == 0  # nothing left waiting in the oldest generation
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0


def test_the_young_threshold_changes_the_youngest_generation_only_and_must_be_positive() -> None:
    before = gc.get_threshold()
    try:
        set_young_threshold(4_321)
        assert gc.get_threshold() == (4_321, *before[1:])
        with pytest.raises(ValueError, match="positive"):
            set_young_threshold(0)
        assert gc.get_threshold()[0] == 4_321
    finally:
        gc.set_threshold(*before)
