"""Late launches (`KVSTITCH_LATE_LAUNCH`): the pacer's deadline and margin from the reads' timings, and the engine
loop taking in what arrives while it waits."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import cast

import pytest

from service.engine.batch_request import BatchRequest
from service.engine.engine import StitchEngine
from service.engine.kv_pool import KVPool
from service.engine.launch_pacer import LaunchPacer, PacerConfig
from service.engine.scheduler import Scheduler
from service.engine.scheduler_config import BatchingOptions, build_scheduler
from service.serving.engine_loop import EngineLoop
from service.serving.runtime import batching_options
from service.settings import Settings
from tests.test_engine_offline import SAMPLING, _prompt

MS = 1e-3


def running_pacer(step_ms: float = 10.0) -> LaunchPacer:
    """A pacer that has seen overlapped steps: A launched at 0 ms, B at 1 ms, A read back at 5 ms (B began then),
    C launched at 6 ms, B read back `step_ms` later (C began then)."""
    pacer = LaunchPacer()
    pacer.launched(0.0)
    pacer.launched(1 * MS)
    pacer.read(began=2 * MS, returned=5 * MS, launched_at=0.0)  # waited for the device: A ended at 5 ms
    pacer.launched(6 * MS)
    pacer.read(began=7 * MS, returned=(5 + step_ms) * MS, launched_at=1 * MS)
    return pacer


def test_the_launch_waits_until_the_running_step_is_about_to_end() -> None:
    pacer = running_pacer(10.0)
    # C began at 15 ms; it should end at 25 ms; the margin is 3 ms.
    assert pacer.delay_s(16 * MS) == pytest.approx(6 * MS)
    assert pacer.delay_s(23 * MS) == 0.0  # already past the launch's time: launch now


def test_no_wait_before_the_device_has_been_waited_for() -> None:
    pacer = LaunchPacer()
    assert pacer.delay_s(0.0) == 0.0  # nothing seen
    pacer.launched(0.0)
    pacer.launched(1 * MS)
    pacer.read(began=2 * MS, returned=5 * MS, launched_at=0.0)
    assert pacer.delay_s(6 * MS) == 0.0  # one step's end, but no step's length yet
    pacer = running_pacer()
    pacer.launched(16 * MS)
    pacer.read(began=17 * MS, returned=17.05 * MS, launched_at=6 * MS)  # did not wait: when D began is unknown
    assert pacer.delay_s(18 * MS) == 0.0


def test_the_shortest_recent_step_sets_the_deadline() -> None:
    """A step with questions riding runs longer; the shortest of the last steps errs on the early side."""
    pacer = running_pacer(10.0)
    pacer.launched(16 * MS)
    pacer.read(began=17 * MS, returned=33 * MS, launched_at=6 * MS)  # C ran 18 ms
    assert pacer.delay_s(34 * MS) == pytest.approx((33 + 10 - 3 - 34) * MS)


def test_a_step_with_questions_riding_is_timed_apart_from_plain_ones() -> None:
    pacer = running_pacer(10.0)  # C, plain, began at 15 ms
    pacer.launched(16 * MS, riding=True)  # D, with questions
    pacer.read(began=17 * MS, returned=25 * MS, launched_at=6 * MS)  # C ran 10 ms; D began at 25 ms
    # No riding step seen yet: D borrows the plain length, launching early rather than late.
    assert pacer.delay_s(26 * MS) == pytest.approx((25 + 10 - 3 - 26) * MS)
    pacer.launched(27 * MS)  # E, plain
    pacer.read(began=27 * MS, returned=45 * MS, launched_at=16 * MS, riding=True)  # D ran 20 ms
    margin = pacer.margin_s  # E's read waited long after a paced launch: the margin shrank
    assert margin < 3 * MS
    assert pacer.delay_s(46 * MS) == pytest.approx((45 + 10 - 46) * MS - margin)  # E is plain: 10 ms
    pacer.launched(47 * MS, riding=True)  # F
    pacer.read(began=47 * MS, returned=55 * MS, launched_at=27 * MS)  # E ran 10 ms; F began at 55 ms
    assert pacer.delay_s(56 * MS) == pytest.approx((55 + 20 - 56) * MS - pacer.margin_s)  # F rides: 20 ms


def test_a_step_launched_after_the_last_read_counts_from_its_launch() -> None:
    pacer = running_pacer(10.0)
    pacer.read(began=16 * MS, returned=25 * MS, launched_at=6 * MS)  # C read with nothing launched behind it
    pacer.launched(30 * MS)  # D: the device idled from 25 to 30 ms
    assert pacer.delay_s(31 * MS) == pytest.approx((30 + 10 - 3 - 31) * MS)
    pacer.read(began=31 * MS, returned=38 * MS, launched_at=30 * MS)  # not queued: 8 ms is not a step's length
    assert pacer.delay_s(30 * MS) == pytest.approx((38 + 10 - 3 - 30) * MS)


def test_a_paced_launch_that_found_the_device_idle_doubles_the_margin() -> None:
    pacer = running_pacer(10.0)
    assert pacer.delay_s(16 * MS) > 0
    pacer.launched(26 * MS)
    pacer.read(began=26 * MS, returned=26.05 * MS, launched_at=6 * MS)  # C had ended: the device waited for us
    assert (pacer.margin_s, pacer.bubbles) == (pytest.approx(6 * MS), 1)
    assert pacer.delay_s(27 * MS) == 0.0


def test_an_unpaced_launch_that_found_the_device_idle_leaves_the_margin() -> None:
    pacer = running_pacer(10.0)
    pacer.launched(16 * MS)  # no delay was asked for
    pacer.read(began=30 * MS, returned=30.05 * MS, launched_at=6 * MS)
    assert (pacer.margin_s, pacer.bubbles) == (pytest.approx(3 * MS), 0)


def test_paced_launches_with_room_to_spare_shrink_the_margin_to_its_floor() -> None:
    config = PacerConfig()
    pacer = running_pacer(10.0)
    ended, launched, margins = 15 * MS, 6 * MS, []
    for _ in range(40):
        due = ended + 1 * MS + pacer.delay_s(ended + 1 * MS)
        pacer.launched(due)
        # The running step is read back 10 ms after it began: the paced launch came that much early.
        pacer.read(began=due, returned=ended + 10 * MS, launched_at=launched)
        early = ended + 10 * MS - due
        ended, launched = ended + 10 * MS, due
        margins.append(pacer.margin_s)
        assert early > 0
    assert margins[0] == pytest.approx(config.margin_s - config.shrink * (3 * MS - config.slack_s))
    assert margins == sorted(margins, reverse=True)
    # It settles where a read waits `slack_s`: launched as late as leaves the host that much room.
    assert margins[-1] == pytest.approx(config.slack_s, abs=1e-5)
    assert min(margins) >= config.min_margin_s
    assert pacer.bubbles == 0


class PacedScheduler:
    """What the engine loop asks of a scheduler, with a launch delay the test sets; records each step's arrivals."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.added: list[object] = []
        self.steps: list[list[object]] = []
        self.busy_s = {"admit": 0.0, "prefill": 0.0, "decode": 0.0, "emit": 0.0}
        self.last_batch = 0
        self.running: list[object] = []
        self.max_batch = 8
        self.unstarted: list[tuple[object, str]] = []

    def add(self, request: object) -> None:
        self.added.append(request)

    def add_arrived(self, requests: list[object]) -> None:
        for request in requests:
            self.add(request)

    def has_work(self) -> bool:
        return bool(self.added)

    def launch_delay_s(self, now: float) -> float:
        delay, self.delay_s = self.delay_s, 0.0
        return delay

    def step(self) -> list[object]:
        self.steps.append(self.added)
        self.added = []
        return []

    def drain(self) -> list[object]:
        return []

    def fail_all(self, error: BaseException) -> list[object]:
        return []

    def finish_unstarted(self, request: object, error: BaseException) -> None:
        self.unstarted.append((request, str(error)))


def request() -> BatchRequest:
    return cast(BatchRequest, SimpleNamespace(handed_at=0.0))


def paced_loop(delay_s: float) -> tuple[EngineLoop, PacedScheduler]:
    loop = EngineLoop(max_waiting=8)
    scheduler = PacedScheduler(delay_s)
    loop.serve_answers(cast(Scheduler, scheduler))
    return loop, scheduler


def test_what_arrives_while_the_loop_waits_to_launch_goes_in_the_same_step() -> None:
    loop, scheduler = paced_loop(0.3)
    first, second, third = request(), request(), request()
    loop.add_answer(first)  # wakes the loop, which then waits 0.3 s before taking arrivals in
    time.sleep(0.1)
    loop.add_answer(second)
    loop.add_answer(third)
    deadline = time.monotonic() + 5
    while not scheduler.steps and time.monotonic() < deadline:
        time.sleep(0.01)
    loop.close()
    assert scheduler.steps[0] == [first, second, third]
    assert 0.25 < loop.seconds()["pace"] < 2.0


def test_closing_or_a_work_item_ends_the_wait_at_once() -> None:
    loop, _ = paced_loop(30.0)
    loop.add_answer(request())
    time.sleep(0.1)  # the loop waits to launch
    done = threading.Event()
    loop.submit(done.set)
    assert done.wait(timeout=2.0)
    loop.close()
    loop, scheduler = paced_loop(30.0)
    waiting = request()
    loop.add_answer(waiting)
    time.sleep(0.1)
    began = time.monotonic()
    loop.close()
    assert time.monotonic() - began < 2.0
    assert scheduler.unstarted == [(waiting, "the server is shutting down")]


def test_the_setting_gives_the_scheduler_a_pacer_and_the_same_tokens(get_engine: Callable[..., StitchEngine]) -> None:
    """On the CPU every read is at once, so the pacer never delays: the answers are the unpaced ones."""
    engine = get_engine("qwen2", "cpu")
    options = batching_options(Settings(late_launch=True, overlap_decode=True, max_batch=4))
    assert options.late_launch and options.overlap
    pool = KVPool(engine.spec, 512 * engine.spec.kv_bytes_per_token())
    paced = build_scheduler(engine, pool, options)
    plain = build_scheduler(engine, KVPool(engine.spec, 512 * engine.spec.kv_bytes_per_token()), BatchingOptions())
    assert paced.runner.pacer is not None and plain.runner.pacer is None
    answers = []
    for scheduler in (paced, plain):
        requests = [BatchRequest(_prompt(engine, seed), SAMPLING) for seed in range(3)]
        for r in requests:
            scheduler.add(r)
        scheduler.run_until_idle()
        answers.append([r.result.token_ids for r in requests])
    assert answers[0] == answers[1] and all(answers[0])
    assert paced.launch_delay_s(time.perf_counter()) == 0.0


def test_the_idle_seconds_grow_while_the_loop_waits_not_only_when_the_wait_ends() -> None:
    """An idle loop's `idle` counter counts the wait under way: read twice during one wait it grows by the time
    between the reads, so a rate over a window never takes in idle time from before the window."""
    loop = EngineLoop(max_waiting=8)
    try:
        time.sleep(0.05)
        first = loop.seconds()["idle"]
        time.sleep(0.2)
        second = loop.seconds()["idle"]
    finally:
        loop.close()
    assert first >= 0.03 and 0.15 <= second - first <= 1.0
