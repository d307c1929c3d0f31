"""Early prefills (`early_prefill_below`): questions admitted while a step runs are prefilled at once on a second
stream instead of riding in the step after the queued one.

On the CPU there is one stream, so these tests check the scheduling: the path is taken where it should be (shared
mode, overlapped, fewer answers running than the threshold), every token and text is the copy path's (fp32: exact;
NaN-poisoned pools and arenas), nothing stays pinned, and a side record read ahead of older work leaves its slabs to
that work. CUDA's concurrency is the GPU test's (`tests/test_gpu_early_prefill.py`)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from service.engine.engine import StitchEngine
from service.engine.inflight import InFlight, PendingPicks
from service.engine.kv_pool import KVPool
from service.engine.scheduler import Scheduler
from tests.test_engine_shared_scheduler import (
    ASKS,
    Run,
    assert_nothing_pinned,
    block_sizes,
    copy_path,
    drain,
    nan_arena,
    nan_pool,
)


def joined_one_by_one(engine: StitchEngine, early_below: int, overlap: bool = True) -> tuple[Run, Scheduler]:
    """ASKS through a shared-mode scheduler, the first two added together, the rest one a step."""
    arena = nan_arena(engine, sum(block_sizes(engine)))
    scheduler = Scheduler(
        engine,
        nan_pool(engine, 2000),
        max_batch=8,
        overlap=overlap,
        arena=arena,
        prefill_with_decode=True,
        early_prefill_below=early_below,
    )
    run = Run(engine, ASKS)
    for request in run.requests[:2]:
        scheduler.add(request)
    scheduler.step()
    for request in run.requests[2:]:
        scheduler.add(request)
        scheduler.step()
    drain(scheduler)
    return run, scheduler


@pytest.mark.parametrize("arch", ("llama", "qwen2"))
def test_questions_joining_running_answers_are_prefilled_early_with_the_copy_paths_tokens(
    get_engine: Callable[[str, str], StitchEngine], arch: str
) -> None:
    """Below the threshold the shared questions joining running answers (2, 4 and 5) are prefilled at once, not
    riding; the naive one is prefilled alone, the first two apart (nothing ran yet). Tokens and texts: the copy
    path's."""
    engine = get_engine(arch, "cpu")
    want = copy_path(engine, ASKS, overlap=True)
    run, scheduler = joined_one_by_one(engine, early_below=8)
    assert run.outcomes() == want
    assert scheduler.prefilled_early == 3 and scheduler.prefilled_with_decode == 0
    assert scheduler.prefilled_together == 5  # 2 apart + 3 early
    assert scheduler.rider_tokens()["question"] == 0
    assert_nothing_pinned(scheduler)


def test_at_or_above_the_threshold_questions_ride_as_before(get_engine: Callable[[str, str], StitchEngine]) -> None:
    """With the threshold at 2 the answers running when 2, 4 and 5 join are 2 or more: they ride."""
    engine = get_engine("qwen2", "cpu")
    want = copy_path(engine, ASKS, overlap=True)
    run, scheduler = joined_one_by_one(engine, early_below=2)
    assert run.outcomes() == want
    assert scheduler.prefilled_early == 0 and scheduler.prefilled_with_decode == 3


def test_without_overlap_nothing_is_prefilled_early(get_engine: Callable[[str, str], StitchEngine]) -> None:
    """Read-each-step: no step runs while the next is planned, so there is nothing to start beside."""
    engine = get_engine("qwen2", "cpu")
    run, scheduler = joined_one_by_one(engine, early_below=8, overlap=False)
    assert scheduler.prefilled_early == 0 and scheduler.prefilled_with_decode == 3
    assert run.outcomes() == copy_path(engine, ASKS, overlap=False)


class Copied:
    """A stand-in for a CUDA event: done once `done` is set."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def record(pool: KVPool, side: bool, slots: int = 0) -> tuple[PendingPicks, Copied]:
    copied = Copied()
    picks = torch.zeros(1, dtype=torch.long)
    pending = PendingPicks([], picks, picks, copied, 0, side=side)
    if slots:
        pending.free_after.append(pool.allocate(slots))
    return pending, copied


def test_a_side_record_read_ahead_of_older_work_leaves_its_slabs_to_that_work(
    get_engine: Callable[[str, str], StitchEngine],
) -> None:
    """Read out of order, a side record's slabs go to the newest record left (or the one being read), which the
    older work precedes: none is freed while older launched work may still write it."""
    engine = get_engine("qwen2", "cpu")
    pool = KVPool(engine.spec, 64 * engine.spec.kv_bytes_per_token())
    inflight = InFlight(pool)
    step, _ = record(pool, side=False)
    early, early_copied = record(pool, side=True, slots=8)
    later, _ = record(pool, side=False)
    for pending in (step, early, later):
        inflight.push(pending)
    behind = inflight.oldest()
    assert behind is step and inflight.side_ready(behind) == []  # not there yet
    early_copied.done = True
    assert inflight.side_ready(behind) == [early] and early.free_after == []
    assert len(later.free_after) == 1 and len(inflight) == 1 and not inflight.has_side()
    # With nothing newer left, the record being read (older) takes them.
    early2, copied2 = record(pool, side=True, slots=4)
    inflight.push(early2)
    assert inflight.oldest() is later
    copied2.done = True
    assert inflight.side_ready(later) == [early2] and [s.size for s in later.free_after] == [8, 4]
    assert pool.used_slots == 12  # nothing freed yet: the runner frees them when `later` is read


def test_the_setting_reaches_the_scheduler(monkeypatch: pytest.MonkeyPatch) -> None:
    from service.serving.runtime import batching_options
    from service.settings import Settings

    monkeypatch.setenv("KVSTITCH_EARLY_PREFILL_BELOW", "24")
    assert batching_options(Settings(_env_file=None)).early_prefill_below == 24  # type: ignore[call-arg]
    monkeypatch.setenv("KVSTITCH_EARLY_PREFILL_BELOW", "-1")
    with pytest.raises(ValueError, match="early_prefill_below"):
        Settings(_env_file=None)  # type: ignore[call-arg]
