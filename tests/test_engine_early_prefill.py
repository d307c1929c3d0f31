"""Early prefills (`early_prefill_below`): questions admitted while a step runs are prefilled at once on a second
stream instead of riding in the step after the queued one.

On the CPU there is one stream, so these tests check the scheduling: the path is taken where it should be (shared
mode, overlapped, fewer answers running than the threshold), every token and text is the copy path's (fp32: exact;
NaN-poisoned pools and arenas), nothing stays pinned, and a side record read ahead of older work leaves its slabs to
that work. CUDA's concurrency is the GPU test's (`tests/test_gpu_early_prefill.py`)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from service.engine.engine import StitchEngine
from service.engine.inflight import InFlight, PendingPicks
from service.engine.kv_pool import KVPool, Slab
from service.engine.runner import StepRunner
from service.engine.scheduler import Scheduler
from service.engine.side_stream import SideStream
from tests.test_engine_shared_scheduler import (
    ASKS,
    Run,
    assert_nothing_pinned,
    block_sizes,
    copy_path,
    drain,
    join_one_by_one,
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
    join_one_by_one(scheduler, run.requests)
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


def test_a_steps_feed_reads_only_the_records_that_hold_its_rows(get_engine: Callable[[str, str], StitchEngine]) -> None:
    """The unread picks a step is fed from are those of the records holding its rows, indexed in their order: a
    side record of answers the step leaves out is neither read nor waited for."""
    engine = get_engine("qwen2", "cpu")
    inflight = InFlight(KVPool(engine.spec, 64 * engine.spec.kv_bytes_per_token()))
    a, b, c, d = (object() for _ in range(4))
    for batch, picks, side in (([a, b], [10, 11], False), ([c], [20], True), ([d], [30], True)):
        values = torch.tensor(picks)
        inflight.push(PendingPicks(batch, values, values, None, 0, side=side))  # type: ignore[arg-type]
    fed = inflight.feed([b, d, a])  # type: ignore[list-item]
    assert fed is not None and fed.picks.tolist() == [10, 11, 30] and fed.src == (1, 2, 0)
    assert inflight.feed([object()]) is None  # type: ignore[list-item]


def test_the_setting_reaches_the_scheduler(monkeypatch: pytest.MonkeyPatch) -> None:
    from service.serving.runtime import batching_options
    from service.settings import Settings

    monkeypatch.setenv("KVSTITCH_EARLY_PREFILL_BELOW", "24")
    assert batching_options(Settings(_env_file=None)).early_prefill_below == 24  # type: ignore[call-arg]
    monkeypatch.setenv("KVSTITCH_EARLY_PREFILL_BELOW", "-1")
    with pytest.raises(ValueError, match="early_prefill_below"):
        Settings(_env_file=None)  # type: ignore[call-arg]


def test_an_answer_handed_over_while_a_step_runs_is_admitted_and_prefilled_early_at_once(
    get_engine: Callable[[str, str], StitchEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the runner waits for a step (here: each step "runs" for three looks), it takes what the engine loop
    was handed (`Scheduler.arrivals`) and admits it early, within the same `step` call, not at the next one. Tokens
    and texts: the copy path's."""
    engine = get_engine("qwen2", "cpu")
    want = copy_path(engine, ASKS, overlap=True)

    def ready(self: PendingPicks) -> bool:  # a step's picks arrive at the third look; side records at once
        # Counted on the record itself: a dict by id() would let a new record inherit a freed one's looks.
        self.looks = getattr(self, "looks", 0) + 1  # type: ignore[attr-defined]
        return self.side or self.looks >= 3  # type: ignore[attr-defined]

    monkeypatch.setattr(PendingPicks, "ready", ready)
    monkeypatch.setattr("service.engine.runner.SIDE_POLL_S", 0.0)
    arena = nan_arena(engine, sum(block_sizes(engine)))
    scheduler = Scheduler(
        engine, nan_pool(engine, 2000), 8, overlap=True, arena=arena, prefill_with_decode=True, early_prefill_below=8
    )
    run = Run(engine, ASKS)
    handed: list = []
    scheduler.arrivals = lambda: [handed.pop()] if handed else []
    for request in run.requests[:2]:
        scheduler.add(request)
    scheduler.step()  # prefilled apart: nothing ran
    scheduler.step()  # their first step launched, nothing older to wait for
    for index in (2, 4, 5):
        handed.append(run.requests[index])
        early = scheduler.prefilled_early
        scheduler.step()
        assert scheduler.prefilled_early == early + 1 and not handed  # taken and prefilled during this step
    scheduler.add(run.requests[3])  # the naive one: at a step's start, prefilled alone
    drain(scheduler)
    assert run.outcomes() == want
    assert scheduler.prefilled_early == 3 and scheduler.prefilled_with_decode == 0
    assert_nothing_pinned(scheduler)


def test_a_request_that_cannot_go_early_waits_for_the_next_steps_admission(
    get_engine: Callable[[str, str], StitchEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A naive request handed over while a step runs heads the line: nothing is admitted mid-step (not even the
    shared one behind it); both go in at the next step's start, the shared one then riding or early."""
    engine = get_engine("qwen2", "cpu")
    monkeypatch.setattr("service.engine.runner.SIDE_POLL_S", 0.0)
    arena = nan_arena(engine, sum(block_sizes(engine)))
    scheduler = Scheduler(
        engine, nan_pool(engine, 2000), 8, overlap=True, arena=arena, prefill_with_decode=True, early_prefill_below=8
    )
    run = Run(engine, ASKS)
    calls = 0

    def arrivals() -> list:
        nonlocal calls
        calls += 1
        if calls == 1:
            return [run.requests[3], run.requests[2]]  # naive first, then a shared one
        monkeypatch.setattr(PendingPicks, "ready", lambda self: True)  # ...until the line was looked at once more
        return []

    for request in run.requests[:2]:
        scheduler.add(request)
    scheduler.step()
    scheduler.step()
    scheduler.arrivals = arrivals
    monkeypatch.setattr(PendingPicks, "ready", lambda self: self.side)  # a step never ends while looked at...
    scheduler.step()
    assert (
        calls >= 2 and scheduler.prefilled_early == 0 and list(scheduler.waiting) == [run.requests[3], run.requests[2]]
    )


def test_the_engine_loop_hands_the_scheduler_what_arrives_during_a_step() -> None:
    """`EngineLoop.serve_answers` gives the scheduler `arrivals`: called inside a step, it returns the answers handed
    over since the loop took the last ones, and the loop does not add them a second time."""
    import threading
    from typing import cast

    from service.engine.batch_request import BatchRequest
    from service.serving.engine_loop import EngineLoop
    from tests.test_launch_pacer import PacedScheduler, request

    handed = threading.Event()

    class MidStep(PacedScheduler):
        arrivals: Any = None
        taken: list[object] | None = None

        def step(self) -> list[object]:
            if self.taken is None:
                assert handed.wait(5)
                self.taken = self.arrivals()
            return super().step()

    loop = EngineLoop(max_waiting=8)
    scheduler = MidStep(0.0)
    loop.serve_answers(cast(Scheduler, scheduler))
    first, second = request(), request()
    loop.add_answer(first)  # the loop adds it and steps, which waits for `handed`
    deadline = time.monotonic() + 5
    while not scheduler.added and time.monotonic() < deadline:
        time.sleep(0.01)
    loop.add_answer(cast(BatchRequest, second))
    handed.set()
    while not scheduler.steps and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)  # a second turn of the loop, had it kept `second`, would add it now
    loop.close()
    assert scheduler.taken == [second] and scheduler.steps == [[first]] and scheduler.added == []


def test_a_step_polled_past_the_stall_limit_is_logged_once_with_the_streams_state(
    get_engine: Callable[[str, str], StitchEngine], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A polled step that takes longer than `STALL_LOG_S` is logged once (not at every look), with the records in
    flight; the answers still end with the copy path's tokens."""
    engine = get_engine("qwen2", "cpu")
    want = copy_path(engine, ASKS, overlap=True)

    def ready(self: PendingPicks) -> bool:  # a step's picks arrive at the fifth look
        self.looks = getattr(self, "looks", 0) + 1  # type: ignore[attr-defined]
        return self.side or self.looks >= 5  # type: ignore[attr-defined]

    monkeypatch.setattr(PendingPicks, "ready", ready)
    monkeypatch.setattr("service.engine.runner.SIDE_POLL_S", 0.0)
    monkeypatch.setattr("service.engine.runner.STALL_LOG_S", 0.0)
    polls = 0
    wait_polling = StepRunner._wait_polling

    def counted(self: StepRunner, step: PendingPicks) -> Any:
        nonlocal polls
        polls += 1
        return wait_polling(self, step)

    monkeypatch.setattr(StepRunner, "_wait_polling", counted)
    run, _ = joined_one_by_one(engine, early_below=8)
    stalls = [r.getMessage() for r in caplog.records if "has run for over" in r.getMessage()]
    assert run.outcomes() == want
    assert polls > 0 and len(stalls) == polls  # every polled step stalled (the limit is 0), each logged once
    assert all("one stream" in message and "in flight (rows, side, ready)" in message for message in stalls)


class RecordingSide(SideStream):
    """A side stream that records, in order, its blocks and the main stream's joins (one stream: the CPU's)."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.inside = 0
        self.events: list[str] = []

    @contextlib.contextmanager
    def enter(self) -> Iterator[None]:
        self.inside += 1
        self.events.append("enter")
        try:
            yield
        finally:
            self.inside -= 1
            self.events.append("exit")

    def join(self) -> None:
        self.events.append("join")


def test_frees_go_to_the_side_stream_and_main_stream_admissions_and_outputs_come_after_it(
    get_engine: Callable[[str, str], StitchEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a side stream: every slab's poison is queued on it (on the main stream it would land behind the running
    step, after an early admission was handed the slab and wrote it); an admission on the main stream comes after a
    join (it may hand out what the side stream last wrote); outputs are applied outside its blocks (a finish's
    free or a callback must not be queued there); a drain ends with a join. Tokens: the copy path's."""
    engine = get_engine("qwen2", "cpu")
    want = copy_path(engine, ASKS, overlap=True)
    arena = nan_arena(engine, sum(block_sizes(engine)))
    pool = nan_pool(engine, 2000)
    scheduler = Scheduler(engine, pool, 8, overlap=True, arena=arena, prefill_with_decode=True, early_prefill_below=8)
    side = RecordingSide()
    scheduler.runner.side = side
    free, admit, apply = pool.free, scheduler.planner.admit, scheduler.output.apply

    def recorded_free(slab: Slab) -> None:
        side.events.append("free" if side.inside else "free outside")
        free(slab)

    def recorded_admit(only: Any = None) -> Any:
        side.events.append("admit on side" if side.inside else "admit on main")
        return admit(only)

    def recorded_apply(output: Any) -> Any:
        side.events.append("apply" if not side.inside else "apply inside")
        return apply(output)

    monkeypatch.setattr(pool, "free", recorded_free)
    monkeypatch.setattr(scheduler.planner, "admit", recorded_admit)
    monkeypatch.setattr(scheduler.output, "apply", recorded_apply)
    run = Run(engine, ASKS)
    join_one_by_one(scheduler, run.requests)
    scheduler.drain()
    assert run.outcomes() == want and scheduler.prefilled_early > 0
    events = side.events
    assert "free" in events and "free outside" not in events and "apply inside" not in events
    assert "admit on side" in events and "admit on main" in events
    for at, event in enumerate(events):
        if event == "admit on main":  # the side's last block, if any, was joined since
            last = max((i for i in range(at) if events[i] in ("exit", "join")), default=None)
            assert last is None or events[last] == "join", events[: at + 1]
    assert events[-1] == "join"


def test_only_what_can_go_early_is_admitted_on_the_side_stream_the_rest_after_a_join(
    get_engine: Callable[[str, str], StitchEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """At a step's start with early prefills applying, a shared question heading the line is admitted on the side
    stream; the naive one behind it is admitted on the main stream, after a join (its fetch and stitch are the
    main stream's work). Tokens: the copy path's."""
    engine = get_engine("qwen2", "cpu")
    want = copy_path(engine, ASKS, overlap=True)
    arena = nan_arena(engine, sum(block_sizes(engine)))
    scheduler = Scheduler(
        engine, nan_pool(engine, 2000), 8, overlap=True, arena=arena, prefill_with_decode=True, early_prefill_below=8
    )
    side = RecordingSide()
    scheduler.runner.side = side
    admit = scheduler.planner.admit
    admitted: list[tuple[str, list[int]]] = []

    def recorded_admit(only: Any = None) -> Any:
        plan = admit(only)
        requests = [*plan.alone, *plan.together, *plan.riding, *plan.shared, *plan.shared_riding]
        admitted.append(("side" if side.inside else "main", [run.requests.index(r) for r in requests]))
        side.events.append("admit on side" if side.inside else "admit on main")
        return plan

    monkeypatch.setattr(scheduler.planner, "admit", recorded_admit)
    run = Run(engine, ASKS)
    for request in run.requests[:2]:
        scheduler.add(request)
    scheduler.step()  # nothing runs yet: admitted and prefilled on the main stream
    scheduler.step()
    side.events.clear()
    admitted.clear()
    scheduler.add(run.requests[2])  # shared
    scheduler.add(run.requests[3])  # naive
    scheduler.step()
    assert admitted == [("side", [2]), ("main", [3])]
    assert side.events.index("admit on main") > side.events.index("join") > side.events.index("admit on side")
    for request in run.requests[4:]:
        scheduler.add(request)
    drain(scheduler)
    assert run.outcomes() == want and scheduler.prefilled_early >= 1


def test_a_step_launched_while_a_first_token_is_computed_on_the_side_leaves_that_answer_for_the_next(
    get_engine: Callable[[str, str], StitchEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step launched while an early first token is still being computed on the side stream does not wait for
    it (no join) and leaves its answer out; the answer runs from the step after its record is ready. Tokens:
    the copy path's."""
    engine = get_engine("qwen2", "cpu")
    want = copy_path(engine, ASKS, overlap=True)

    def ready(self: PendingPicks) -> bool:  # side records are ready at their fifth look, steps at once
        self.looks = getattr(self, "looks", 0) + 1  # type: ignore[attr-defined]
        return not self.side or self.looks >= 5  # type: ignore[attr-defined]

    monkeypatch.setattr(PendingPicks, "ready", ready)
    arena = nan_arena(engine, sum(block_sizes(engine)))
    scheduler = Scheduler(
        engine, nan_pool(engine, 2000), 8, overlap=True, arena=arena, prefill_with_decode=True, early_prefill_below=8
    )
    run = Run(engine, ASKS)
    launches: list[tuple[set[int], set[int]]] = []  # (rows, answers pending on the side)
    events: list[str] = []
    launch, first_tokens_pending, join_side = (
        StepRunner._launch,
        StepRunner._first_tokens_pending,
        StepRunner._join_side,
    )

    def recorded_pending(self: StepRunner) -> set[int]:
        pending = first_tokens_pending(self)
        events.append("pending" if pending else "none pending")
        launches.append((set(), {run.requests.index(r) for r in run.requests if id(r) in pending}))
        return pending

    def recorded_launch(self: StepRunner, batch: list, questions: list, watch: Any) -> Any:
        events.append("launch")
        launches[-1][0].update(run.requests.index(r) for r in batch)
        return launch(self, batch, questions, watch)

    def recorded_join(self: StepRunner) -> None:
        events.append("join")
        join_side(self)

    monkeypatch.setattr(StepRunner, "_first_tokens_pending", recorded_pending)
    monkeypatch.setattr(StepRunner, "_launch", recorded_launch)
    monkeypatch.setattr(StepRunner, "_join_side", recorded_join)
    join_one_by_one(scheduler, run.requests)
    assert run.outcomes() == want and scheduler.prefilled_early == 3
    held = [(rows, pending) for rows, pending in launches if pending]
    assert held and all(rows and not rows & pending for rows, pending in held)  # left out while pending
    for answer in set().union(*(pending for _, pending in held)):
        assert any(answer in rows for rows, pending in launches if answer not in pending)  # and ran later
    for at, event in enumerate(events):  # a step launched over pending first tokens did not join the side first
        if event == "pending":
            after = [*events[at + 1 :], "join"]
            assert after.index("launch") < after.index("join")
