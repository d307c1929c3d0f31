"""The one owner of the device: a single engine thread through which every GPU user goes.

Each turn of the loop runs at most one queued work item (the in-process worker's precompute batches, the
start-up gate, the CUDA-graph warm-up, anything `submit`ted), hands newly arrived answers to the scheduler, and
then lets the scheduler take one step: admit waiting answers (fetch their chunk KV, stitch, prefill the question
into a slab of the KV pool) and run one batched decode step over every running answer (`engine/scheduler.py`).
So answers decode together, join and leave at any step, and an ingest's precompute batch only ever delays the
running answers by one batch, never by a whole answer. Nothing else touches the model, so no lock guards it.

Answers wait in a bounded line: at most `max_batch` run and `max_waiting` more wait; one more is refused at once
with `EngineBusyError` (the HTTP layer's 503 + Retry-After) instead of letting latency grow without bound.
"""

from __future__ import annotations

import concurrent.futures
import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from service.engine.batch_request import BatchRequest
from service.engine.scheduler import Scheduler
from service.serving.step_profile import StepProfile

T = TypeVar("T")
P = ParamSpec("P")

log = logging.getLogger(__name__)

# The engine thread waits for the GPU with the GIL released (the host copy of each step's picks); to launch the
# next step it needs the GIL back, and a busy thread (the event loop writing streams) keeps it up to the switch
# interval: 5 ms by default, half a batched decode step. A shorter interval hands it back sooner.
ENGINE_SWITCH_INTERVAL_S = 0.001


class EngineBusyError(RuntimeError):
    """The line in front of the engine is full."""


class _Task:
    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.future: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def run(self) -> None:
        if not self.future.set_running_or_notify_cancel():
            return
        try:
            self.future.set_result(self.fn())
        except BaseException as err:
            self.future.set_exception(err)


class EngineLoop:
    """One engine thread; `submit` queues work, `call` runs it there and waits, `admit` bounds the answers and
    `add_answer` hands one to the scheduler (once `serve_answers` installed it)."""

    def __init__(self, max_waiting: int) -> None:
        if max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
        self.max_waiting = max_waiting
        self.scheduler: Scheduler | None = None
        self.on_step: Callable[[int], None] | None = None  # called with each decode step's batch size (metrics)
        self.step_profile: StepProfile | None = None  # profiles a run of steps once, then is dropped
        self._wake = threading.Condition()
        self._tasks: deque[_Task] = deque()
        self._arrived: deque[BatchRequest] = deque()
        self._closing = False
        self._admitted = 0  # answers running + waiting
        self._idle_s = 0.0  # waiting for anything to do (the waits that ended)
        self._idle_since: float | None = None  # when the wait under way began, under `_wake`
        self._work_s = 0.0  # running queued work items (precompute batches, the gate, the warm-up)
        self._paced_s = 0.0  # waiting on purpose before a launch, taking in arrivals (`Scheduler.launch_delay_s`)
        sys.setswitchinterval(min(sys.getswitchinterval(), ENGINE_SWITCH_INTERVAL_S))
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    # ---- answers --------------------------------------------------------------------------------------------

    def serve_answers(self, scheduler: Scheduler) -> None:
        """From now on answers go to this scheduler (installed once the model passed the gate). It may take the
        answers handed over while one of its steps runs, to admit them early (`Scheduler.arrivals`)."""
        self.scheduler = scheduler
        scheduler.arrivals = self._take_arrived

    def _take_arrived(self) -> list[BatchRequest]:
        """The answers handed over since the loop last took them (on the engine thread)."""
        with self._wake:
            arrived = list(self._arrived)
            self._arrived.clear()
        return arrived

    @property
    def capacity(self) -> int:
        running = self.scheduler.max_batch if self.scheduler is not None else 1
        return running + self.max_waiting

    @property
    def admitted(self) -> int:
        with self._wake:
            return self._admitted

    @property
    def waiting(self) -> int:
        """Answers admitted but not decoding yet (shadow answers hold no place in line: not counted)."""
        running = list(self.scheduler.running) if self.scheduler is not None else []  # one copy: atomic
        return max(0, self.admitted - sum(1 for r in running if not r.shadow))

    @property
    def running(self) -> int:
        return len(self.scheduler.running) if self.scheduler is not None else 0

    def admit(self) -> Admission:
        """A place in line for an answer, or `EngineBusyError`; release it with `Admission.release`."""
        with self._wake:
            if self._admitted >= self.capacity:
                raise EngineBusyError(f"{self._admitted} requests are already running or waiting for the engine")
            self._admitted += 1
        return Admission(self)

    def _release(self) -> None:
        with self._wake:
            self._admitted -= 1

    def add_answer(self, request: BatchRequest) -> None:
        """Queue an answer for the scheduler (from any thread); it is added on the engine thread."""
        if self.scheduler is None:
            raise RuntimeError("the engine loop serves no answers yet")
        request.handed_at = time.perf_counter()
        with self._wake:
            self._arrived.append(request)
            self._wake.notify()

    def cancel_answer(self, request: BatchRequest) -> None:
        """Stop an answer at the next step (safe from any thread); the loop wakes to act on it."""
        request.cancelled = True
        with self._wake:
            self._wake.notify()

    # ---- work items -----------------------------------------------------------------------------------------

    def on_loop(self) -> bool:
        """Whether the calling thread is the engine thread."""
        return threading.current_thread() is self._thread

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Queue `fn` for the engine thread."""
        task = _Task(fn)
        with self._wake:
            if self._closing:
                raise RuntimeError("the engine loop is closed")
            self._tasks.append(task)
            self._wake.notify()
        return task.future

    def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the engine thread and return its result (at once when already there: a fetch's miss
        precompute runs inside an answer's admission, itself part of a step)."""
        if self.on_loop():
            return fn()
        return self.submit(fn).result()

    def bind(self, fn: Callable[P, T]) -> Callable[P, T]:
        """`fn` made to run on the engine thread whoever calls it (what the KV store and ingestion are given)."""

        def on_engine(*args: P.args, **kwargs: P.kwargs) -> T:
            return self.call(lambda: fn(*args, **kwargs))

        return on_engine

    def close(self) -> None:
        """Stop after the current turn; queued work items are cancelled, running answers end as errors."""
        with self._wake:
            self._closing = True
            self._wake.notify()
        self._thread.join(timeout=60)

    # ---- the loop -------------------------------------------------------------------------------------------

    def seconds(self) -> dict[str, float]:
        """Wall seconds of the engine thread since start, by what it did: idle, work (queued items), pace
        (waiting to launch late, `late_launch`) and the scheduler's step phases (admit, prefill, decode, emit).
        Their rates add up to ~1 (metrics, benchmarks)."""
        phases = dict(self.scheduler.busy_s) if self.scheduler is not None else {}
        with self._wake:  # the wait under way counts as it goes: a counter read mid-wait must not jump later
            idle = self._idle_s + (time.perf_counter() - self._idle_since if self._idle_since is not None else 0.0)
        return {"idle": idle, "work": self._work_s, "pace": self._paced_s, **phases}

    def question_prefills(self) -> dict[str, int]:
        """Turbo questions prefilled in batched forwards since start: `riding` in a decode step's forward, `apart`
        in a forward of their own, `early` at once on the side stream (read from the metrics' thread: counters, no
        walk)."""
        scheduler = self.scheduler
        if scheduler is None:
            return {"riding": 0, "apart": 0, "early": 0}
        riding, early = scheduler.prefilled_with_decode, scheduler.prefilled_early
        return {"riding": riding, "apart": scheduler.prefilled_together - riding - early, "early": early}

    def rider_tokens(self) -> dict[str, int]:
        """Token slots computed for questions riding in decode steps since start, their own and the graphs'
        padding (`Scheduler.rider_tokens`; counters, read from the metrics' thread)."""
        if self.scheduler is None:
            return {"question": 0, "padding": 0}
        return self.scheduler.rider_tokens()

    def _run(self) -> None:
        while True:
            with self._wake:
                began = self._idle_since = time.perf_counter()
                self._wake.wait_for(self._has_work)
                self._idle_since = None
                self._idle_s += time.perf_counter() - began
                self._pace()
                if self._closing:
                    break
                task = self._tasks.popleft() if self._tasks else None
                arrived = list(self._arrived)
                self._arrived.clear()
            if task is not None:
                began = time.perf_counter()
                if self.scheduler is not None:  # a work item (a capture, say) must not overlap a launched step
                    self.scheduler.drain()
                task.run()
                self._work_s += time.perf_counter() - began
            self._step(arrived)
        self._shut_down()

    def _pace(self) -> None:
        """Wait (lock released, so answers keep arriving) until the scheduler's next launch is due: with
        `late_launch` shortly before the running step ends, so what arrives meanwhile rides in the next step. A
        work item or closing ends the wait at once."""
        scheduler = self.scheduler
        if scheduler is None:
            return
        began = time.perf_counter()
        due = began + scheduler.launch_delay_s(began)
        now = began
        while now < due and not self._closing and not self._tasks:
            self._wake.wait(due - now)
            now = time.perf_counter()
        self._paced_s += now - began

    def _has_work(self) -> bool:
        busy = self.scheduler is not None and self.scheduler.has_work()
        return self._closing or bool(self._tasks) or bool(self._arrived) or busy

    def _step(self, arrived: list[BatchRequest]) -> None:
        scheduler = self.scheduler
        if scheduler is None:
            return
        scheduler.add_arrived(arrived)
        if not scheduler.has_work():
            return
        profile = self.step_profile
        if profile is not None:
            profile.before_step()
        try:
            scheduler.step()
        except Exception as err:  # the batch's device state is unknown: every request in it fails, the loop lives
            log.exception("engine step failed; failing %d requests", len(scheduler.running) + len(scheduler.waiting))
            scheduler.fail_all(err)
            return
        if profile is not None and profile.after_step(scheduler.last_batch):
            self.step_profile = None
        if self.on_step is not None and scheduler.last_batch:
            self.on_step(scheduler.last_batch)

    def _shut_down(self) -> None:
        with self._wake:
            tasks, self._tasks = list(self._tasks), deque()
            arrived, self._arrived = list(self._arrived), deque()
        for task in tasks:
            task.future.cancel()
        if self.scheduler is not None:
            closed = RuntimeError("the server is shutting down")
            for request in arrived:
                self.scheduler.finish_unstarted(request, closed)
            self.scheduler.fail_all(closed)


class Admission:
    def __init__(self, loop: EngineLoop) -> None:
        self._loop = loop
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._loop._release()

    def __enter__(self) -> Admission:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
