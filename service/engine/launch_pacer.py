"""When to launch an overlapped decode step: as late as the device allows, so that the questions arriving
meanwhile ride in it (`KVSTITCH_LATE_LAUNCH`).

Overlapped, the loop launches step k+1 as soon as it has read step k-1, and step k+1 then waits on the device
behind step k. A question that arrives while step k runs can only ride in step k+2: it waits about half a step
for the loop, a whole step (k+1) on the device, then its own step. Paced, the loop waits before it launches until
shortly before the running step ends, taking in the questions that arrive meanwhile, so a question waits about
half a step plus the margin before its step starts. The device stays as busy as before as long as the launch
comes before the running step ends.

When the running step ends is known from the reads: a read that waited for the device returned when its step
ended, and the step launched before it started then. Its length is taken as the shortest of the last few steps of
its kind: a step with questions riding runs longer (their prefill), so those are kept apart, and a kind not seen
yet borrows the plain steps' (the shortest errs on the early side). The margin, the host's time to
admit, plan and launch, adapts: a paced launch whose next read did not wait found the device already idle (a
bubble), so the margin doubles; reads that waited longer than needed shrink it a little at a time.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class PacerConfig:
    margin_s: float = 0.003  # the host's launch work before the running step ends, at first
    min_margin_s: float = 0.0005
    max_margin_s: float = 0.02
    steps: int = 8  # recent step lengths the shortest is taken from
    waited_s: float = 0.0002  # a read that took at least this long waited for the device
    slack_s: float = 0.001  # a paced launch's read that waits longer than this leaves room to launch later
    shrink: float = 0.25  # of the extra slack taken off the margin at each such read


class LaunchPacer:
    """Owned by the engine thread: `read` after each read of a step's picks, `launched` after each launch,
    `delay_s` before taking in arrivals for the next step."""

    def __init__(self, config: PacerConfig | None = None) -> None:
        self.config = config or PacerConfig()
        self.margin_s = self.config.margin_s
        # Recent step lengths, plain (False) and with questions riding (True).
        self._lengths: dict[bool, deque[float]] = {kind: deque(maxlen=self.config.steps) for kind in (False, True)}
        self._ended_at: float | None = None  # when the last read returned after waiting: the running step began
        self._launched_at = 0.0  # the newest launch's time
        self._riding = False  # whether questions ride in the newest launch
        self._delayed = False  # the last `delay_s` asked the loop to wait
        self._paced = False  # the step launched last was launched late on purpose, its read not seen yet
        self.bubbles = 0  # paced launches that came after the device had gone idle

    def read(self, began: float, returned: float, launched_at: float, riding: bool = False) -> None:
        """The picks of a step launched at `launched_at` (`riding`: with questions in it) were read: waiting from
        `began`, back at `returned` (perf_counter seconds)."""
        config = self.config
        waited = returned - began
        if waited < config.waited_s:  # the step had ended before the read: its end, and the next start, unknown
            if self._paced:
                self.bubbles += 1
                self.margin_s = min(config.max_margin_s, 2 * self.margin_s)
            self._paced = False
            self._ended_at = None
            return
        if self._ended_at is not None and launched_at <= self._ended_at:
            self._lengths[riding].append(returned - self._ended_at)  # queued behind the last: ran from then to now
        if self._paced and waited > config.slack_s:
            self.margin_s = max(config.min_margin_s, self.margin_s - config.shrink * (waited - config.slack_s))
        self._paced = False
        self._ended_at = returned

    def launched(self, at: float, riding: bool = False) -> None:
        """A step was launched at `at` (`riding`: with questions in it)."""
        self._launched_at = at
        self._riding = riding
        self._paced = self._delayed
        self._delayed = False

    def delay_s(self, now: float) -> float:
        """How long to wait before taking in arrivals and launching the next step; 0 when the running step's
        start or length is not known (a read that did not wait, too few steps seen)."""
        lengths = self._lengths[self._riding] or self._lengths[False]
        if self._ended_at is None or not lengths:
            self._delayed = False
            return 0.0
        began = max(self._ended_at, self._launched_at)  # launched after the last read: it started when launched
        delay = began + min(lengths) - self.margin_s - now
        self._delayed = delay > 0
        return max(0.0, delay)
