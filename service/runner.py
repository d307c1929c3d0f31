"""One engine thread and a bounded line in front of it.

Torch work for a request (KV fetch, stitch, prefill, decode) runs on a single dedicated thread, one request at
a time: a second request would only slow the first one's tokens and double the GPU buffers. Requests wait in a
line of at most `max_waiting`; one more is refused at once with `EngineBusyError`, which the HTTP layer turns into
503 + Retry-After instead of letting latency grow without bound.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class EngineBusyError(RuntimeError):
    """The line in front of the engine is full."""


class EngineRunner:
    def __init__(self, max_waiting: int) -> None:
        if max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
        self.max_waiting = max_waiting
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._lock = threading.Lock()
        self._admitted = 0  # running + waiting

    @property
    def admitted(self) -> int:
        with self._lock:
            return self._admitted

    @property
    def waiting(self) -> int:
        with self._lock:
            return max(0, self._admitted - 1)

    def admit(self) -> Admission:
        """A place in line, or `EngineBusyError`; release it with `Admission.release` (or use it as a context)."""
        with self._lock:
            if self._admitted >= self.max_waiting + 1:
                raise EngineBusyError(f"{self._admitted} requests are already running or waiting for the engine")
            self._admitted += 1
        return Admission(self)

    def _release(self) -> None:
        with self._lock:
            self._admitted -= 1

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        return self._executor.submit(fn)

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


class Admission:
    def __init__(self, runner: EngineRunner) -> None:
        self._runner = runner
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._runner._release()

    def __enter__(self) -> Admission:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
