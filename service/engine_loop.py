"""The one owner of the device: a single engine thread through which every GPU user goes.

Answers (KV fetch, online precompute of misses, stitch, prefill, decode), the in-process worker's precompute
batches, the start-up gate and the CUDA-graph warm-up all run as work items on this one thread, in the order
they were submitted; nothing else touches the model, so no lock guards it. Answers wait in a bounded line of at
most `max_waiting`: one more is refused at once with `EngineBusyError` (the HTTP layer's 503 + Retry-After)
instead of letting latency grow without bound. The batching scheduler (issue 12) replaces the one-item-at-a-time
body of this loop; its callers stay as they are.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import ParamSpec, TypeVar

T = TypeVar("T")
P = ParamSpec("P")


class EngineBusyError(RuntimeError):
    """The line in front of the engine is full."""


class EngineLoop:
    """One engine thread; `submit` queues work, `call` runs it there and waits, `admit` bounds the answers."""

    def __init__(self, max_waiting: int) -> None:
        if max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
        self.max_waiting = max_waiting
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="engine", initializer=self._remember_thread
        )
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._admitted = 0  # answers running + waiting

    def _remember_thread(self) -> None:
        self._thread = threading.current_thread()

    @property
    def admitted(self) -> int:
        with self._lock:
            return self._admitted

    @property
    def waiting(self) -> int:
        with self._lock:
            return max(0, self._admitted - 1)

    def on_loop(self) -> bool:
        """Whether the calling thread is the engine thread."""
        return threading.current_thread() is self._thread

    def admit(self) -> Admission:
        """A place in line for an answer, or `EngineBusyError`; release it with `Admission.release`."""
        with self._lock:
            if self._admitted >= self.max_waiting + 1:
                raise EngineBusyError(f"{self._admitted} requests are already running or waiting for the engine")
            self._admitted += 1
        return Admission(self)

    def _release(self) -> None:
        with self._lock:
            self._admitted -= 1

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Queue `fn` for the engine thread."""
        return self._executor.submit(fn)

    def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the engine thread and return its result (at once when already there: a fetch's miss
        precompute runs inside an answer, which is itself a work item)."""
        if self.on_loop():
            return fn()
        return self.submit(fn).result()

    def bind(self, fn: Callable[P, T]) -> Callable[P, T]:
        """`fn` made to run on the engine thread whoever calls it (what the KV store and ingestion are given)."""

        def on_engine(*args: P.args, **kwargs: P.kwargs) -> T:
            return self.call(lambda: fn(*args, **kwargs))

        return on_engine

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


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
