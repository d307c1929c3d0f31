"""A progress line for long evals on stderr: a `\\r` bar with count, rate and ETA on a terminal, plain lines
otherwise (a log file or CI output would fill with carriage returns)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TextIO

BAR_WIDTH = 24
REDRAW_S = 0.2  # a terminal bar is redrawn at most this often
LINE_EVERY_S = 30.0  # without a terminal: a line at least this often while samples finish...
LINE_STEPS = 10  # ...and at each tenth of the total


def _duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    """Counts finished samples out of `total` and reports them on `stream`."""

    def __init__(
        self, total: int, stream: TextIO, label: str = "samples", clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.total = max(total, 0)
        self.stream = stream
        self.label = label
        self.clock = clock
        self.done = 0
        self.started = clock()
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self._last_report = self.started
        self._next_step = 1
        self._drawn = 0  # length of the bar last drawn: a shorter one must blank the rest

    def line(self) -> str:
        """The current state: count, rate and ETA (and a bar on a terminal)."""
        elapsed = self.clock() - self.started
        rate = self.done / elapsed if elapsed > 0 else 0.0
        left = self.total - self.done
        eta = _duration(left / rate) if rate > 0 else "?"
        text = f"{self.done}/{self.total} {self.label} {rate:.2f}/s ETA {eta} (elapsed {_duration(elapsed)})"
        if not self.tty:
            return text
        filled = BAR_WIDTH * self.done // self.total if self.total else BAR_WIDTH
        return f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {text}"

    def advance(self) -> None:
        """One more sample finished."""
        self.done += 1
        now = self.clock()
        last = self.done >= self.total
        if self.tty:
            if last or now - self._last_report >= REDRAW_S:
                bar = self.line()
                self.stream.write("\r" + bar.ljust(self._drawn) + ("\n" if last else ""))
                self._drawn = len(bar)
                self._report(now)
            return
        step = self.total * self._next_step / LINE_STEPS
        if last or self.done >= step or now - self._last_report >= LINE_EVERY_S:
            while self._next_step < LINE_STEPS and self.done >= self.total * self._next_step / LINE_STEPS:
                self._next_step += 1
            self.stream.write(self.line() + "\n")
            self._report(now)

    def _report(self, now: float) -> None:
        self.stream.flush()
        self._last_report = now
