"""Picks queued on the device and not read yet, and the slabs that must outlive them.

Overlapped, a step is launched before the previous one's picks reach the host; its rows whose last token is such
an unread pick are fed from the device (`feed`). A slab whose request ended while a launched step could still
write it goes back to the pool only once that step has been read (`release`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from service.engine.batch_decode import StepFeed
from service.engine.batch_request import BatchRequest
from service.engine.engine import Stopwatch
from service.engine.kv_pool import KVPool, Slab


@dataclass
class PendingPicks:
    """Picks queued on the device but not read yet — a decode step's, the first tokens of requests admitted
    together, or both (questions riding in the step) — their host copy, and the slabs to return to the pool once
    this work has run."""

    batch: list[BatchRequest]
    picks: torch.Tensor  # [B] int64 on the device
    host: torch.Tensor  # their copy on the host (pinned on CUDA), valid once `copied` has passed
    copied: Any  # torch.cuda.Event on CUDA; None where the copy was synchronous
    first_from: int  # rows from here on are first tokens (0: an admission's; len(batch): none, a plain step)
    watch: Stopwatch | None = None  # what timed the first tokens' stages
    free_after: list[Slab] = field(default_factory=list)
    launched_at: float = 0.0  # perf_counter when this work was queued (the launch pacer's clock)
    side: bool = False  # queued on the side stream (`side_stream.py`): read as soon as it is there

    def ready(self) -> bool:
        """Whether the picks have reached the host (reading them would not wait)."""
        return self.copied is None or bool(self.copied.query())

    def tokens(self) -> list[int]:
        """The picks on the host, waiting for the step (and the copy) to finish."""
        if self.copied is not None:
            self.copied.synchronize()
        tokens: list[int] = self.host.tolist()  # int64: Python ints
        return tokens


def copy_to_host(
    batch: list[BatchRequest], picks: torch.Tensor, first_from: int, watch: Stopwatch | None = None
) -> PendingPicks:
    """The record of queued picks, their host copy queued behind them (pinned memory and an event on CUDA)."""
    if picks.device.type != "cuda":
        return PendingPicks(batch, picks, picks, None, first_from, watch, launched_at=time.perf_counter())
    host = torch.empty(picks.shape, dtype=picks.dtype, pin_memory=True)
    host.copy_(picks, non_blocking=True)
    copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
    copied.record()
    return PendingPicks(batch, picks, host, copied, first_from, watch, launched_at=time.perf_counter())


class InFlight:
    """Launched work not read yet, oldest first."""

    def __init__(self, pool: KVPool, free: Callable[[Slab], None] | None = None) -> None:
        """`free`: how a slab goes back to `pool` (default `pool.free`; with a side stream, the runner's, which
        queues the slab's poison where the next writer is ordered after it)."""
        self.pool = pool
        self.free = free or pool.free
        self._records: deque[PendingPicks] = deque()

    def __len__(self) -> int:
        return len(self._records)

    def push(self, record: PendingPicks) -> None:
        self._records.append(record)

    def oldest(self) -> PendingPicks:
        return self._records.popleft()

    def side_ready(self, behind: PendingPicks) -> list[PendingPicks]:
        """Side-stream records whose picks are on the host, taken out of the line to be read now, while `behind`
        (taken out to be read, older) still runs: their slabs to free go to the newest record left, else to
        `behind`, as the older work may still write them."""
        ready = [record for record in self._records if record.side and record.ready()]
        for record in ready:
            self._records.remove(record)
            later = self._records[-1] if self._records else behind
            later.free_after.extend(record.free_after)
            record.free_after = []
        return ready

    def first(self) -> PendingPicks:
        """The oldest record, left in line."""
        return self._records[0]

    def newest(self, count: int) -> list[PendingPicks]:
        """The `count` records pushed last, oldest first."""
        return list(self._records)[len(self._records) - count :] if count > 0 else []

    def records(self) -> list[PendingPicks]:
        """Every record in line, oldest first (a copy)."""
        return list(self._records)

    def has_side(self) -> bool:
        return any(record.side for record in self._records)

    def side_pending(self) -> set[int]:
        """The requests (by id) of side-stream records whose picks are not on the host yet."""
        return {id(r) for record in self._records if record.side and not record.ready() for r in record.batch}

    def unread(self) -> dict[int, int]:
        """Per request (by id) with a token still unread on the device, its index in the unread picks, record
        after record (a request is in one unread record at most: all but the newest step are read before the
        next launch, and first tokens are of requests admitted since)."""
        return _indices(self._records)

    def feed(self, batch: Sequence[BatchRequest]) -> StepFeed | None:
        """Where each row of a step over `batch` finds an unread last token: its index in the unread picks of the
        records that hold one of the batch's (a record of requests the step leaves out is not read, nor waited
        for: the side stream may still be writing it)."""
        rows = {id(r) for r in batch}
        records = [record for record in self._records if any(id(r) in rows for r in record.batch)]
        unread = _indices(records)
        src = tuple(unread.get(id(r), -1) for r in batch)
        if max(src, default=-1) < 0:
            return None
        picks = records[0].picks if len(records) == 1 else torch.cat([record.picks for record in records])
        return StepFeed(picks, src)

    def release(self, slab: Slab) -> None:
        """Return a slab to the pool once the launched steps that may still write it have run: a step launched
        before its request ended computes one more row into it."""
        if self._records:
            self._records[-1].free_after.append(slab)
        else:
            self.free(slab)

    def forget(self) -> None:
        """Drop every record unread (the device's state is unknown after a failed step); their slabs go back."""
        stale, self._records = list(self._records), deque()
        for record in stale:
            for slab in record.free_after:
                self.free(slab)


def _indices(records: Iterable[PendingPicks]) -> dict[int, int]:
    """Per request (by id) in `records`, its index in their picks laid end to end, record after record."""
    indices: dict[int, int] = {}
    offset = 0
    for record in records:
        indices.update((id(r), offset + row) for row, r in enumerate(record.batch))
        offset += len(record.batch)
    return indices
