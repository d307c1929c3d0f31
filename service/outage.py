"""Failures of a dependency logged once per outage, not once per call.

While Redis is away, every background index update fails; logging each one buried the log in identical
tracebacks, a hundred or so per outage. `OutageLog` logs the first failure of an outage as a warning
with its error, counts the rest silently, and logs one line when a call succeeds again.
"""

from __future__ import annotations

import logging
import threading


class OutageLog:
    """One dependency's outages, as seen by one caller; safe across threads."""

    def __init__(self, log: logging.Logger, what: str) -> None:
        self._log = log
        self.what = what
        self.failures = 0  # in the current outage; 0 while the dependency works
        self.outages = 0
        self._lock = threading.Lock()

    def failed(self, error: BaseException) -> None:
        with self._lock:
            self.failures += 1
            first = self.failures == 1
            self.outages += first
        if first:
            self._log.warning(
                "%s failed: %s: %s (further failures are counted, not logged, until it recovers)",
                self.what,
                type(error).__name__,
                error,
            )

    def succeeded(self) -> None:
        with self._lock:
            failures, self.failures = self.failures, 0
        if failures:
            self._log.warning("%s recovered after %d failures", self.what, failures)
