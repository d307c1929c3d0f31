"""Python's cyclic garbage collector in a long-running server: frozen start-up heap, timed pauses.

A full collection walks every object the process holds, with the GIL held, so every thread stops: the engine
loop, the event loop, retrieval. Once torch, transformers, a tokenizer, the embedder and Qdrant's client are
loaded that is ~0.5M objects and hundreds of milliseconds per full collection, a stall every question in flight
waits out, so a few of them make the whole TTFT tail. `gc.freeze()` once start-up is over moves what start-up
made into the permanent generation that collections skip (what CPython provides it for), so later collections
walk only what requests made since. `GcPauses` times every collection through `gc.callbacks`, so the metrics show
whether pauses come back.

What serving allocates lives about as long as a request (its prompt, events, results: under a second). Python's
default threshold (700 net allocations) collects the youngest generation dozens of times a second under load, and
each collection promotes what it finds alive, so the older generations fill and are walked too. A higher threshold
(`KVSTITCH_GC_GEN0_THRESHOLD`) runs fewer, longer young collections that cost about the same in all, but far less
is promoted and walked again (at 32 clients 20,000 stopped every thread for 0.67 s of a 25-s phase, 700 for 1.1 s).
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Any

# Upper bounds (seconds) of the pause histogram's buckets; +Inf is implied.
PAUSE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


def freeze_startup_heap() -> int:
    """Collect what start-up left as garbage, then freeze the rest; returns how many objects are now frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def set_young_threshold(objects: int) -> None:
    """Collect the youngest generation after `objects` net allocations (the older generations' thresholds kept)."""
    if objects < 1:
        raise ValueError(f"the youngest generation's threshold must be positive, got {objects}")
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(objects, older, oldest)


@dataclass
class PauseHistogram:
    """Collections of one generation: a cumulative count per bucket bound, their total seconds and count."""

    bucket_counts: list[int] = field(default_factory=lambda: [0] * len(PAUSE_BUCKETS))
    seconds: float = 0.0
    count: int = 0

    def observe(self, seconds: float) -> None:
        self.seconds += seconds
        self.count += 1
        for i, bound in enumerate(PAUSE_BUCKETS):
            if seconds <= bound:
                self.bucket_counts[i] += 1


class GcPauses:
    """Times every collection, by generation. The callback only does arithmetic on its own fields: it runs inside
    whatever thread triggered the collection, possibly one holding a metrics lock, so it must take no lock."""

    def __init__(self) -> None:
        self.by_generation: dict[int, PauseHistogram] = {g: PauseHistogram() for g in range(3)}
        self._started: float | None = None

    def install(self) -> None:
        if self._on_collection not in gc.callbacks:
            gc.callbacks.append(self._on_collection)

    def uninstall(self) -> None:
        if self._on_collection in gc.callbacks:
            gc.callbacks.remove(self._on_collection)

    def _on_collection(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif phase == "stop" and self._started is not None:
            self.by_generation[int(info["generation"])].observe(time.perf_counter() - self._started)
            self._started = None
