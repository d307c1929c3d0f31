"""What the metrics and `/readyz` read of the shared chunk arena (torch-free: the metrics module imports it)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class ArenaStats:
    """The arena's memory and chunks now, and its counts since start."""

    used_bytes: int
    capacity_bytes: int
    chunks: int  # resident, pinned or not
    pinned_chunks: int  # read by at least one running answer: never evicted
    readers: int  # running answers reading their chunks from the arena
    answers: int  # answers admitted onto the shared path since start
    waited: int  # of those, answers that waited in line for arena room first
    evictions: int  # unpinned chunks evicted to make room
    resident_reads: int = 0  # chunks admitted answers found resident: read without a fetch or a copy

    def as_json(self) -> dict[str, Any]:
        return asdict(self)
