"""How much of a stitched context to recompute: `none`, `prefix:N` or `selective:R` (issue 13, item 2).

Plain values only, so settings, the HTTP service and the eval parse a spec without importing torch; the
recompute itself is `recompute.py`. One parser for every entry (setting, request field, `kvstitch eval`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class RecomputeKind(StrEnum):
    NONE = "none"
    PREFIX = "prefix"  # EPIC: the first N tokens of every chunk block, against everything before them
    SELECTIVE = "selective"  # CacheBlend: the share R of chunk tokens whose cached KV deviates most


@dataclass(frozen=True)
class RecomputeSpec:
    """What to recompute after the stitch: `amount` is tokens per chunk for `prefix`, a share for `selective`."""

    kind: RecomputeKind = RecomputeKind.NONE
    amount: float = 0.0

    @property
    def active(self) -> bool:
        """False where nothing would be recomputed (`none`, `prefix:0`, `selective:0`): the plain turbo path."""
        return self.kind is not RecomputeKind.NONE and self.amount > 0

    def __str__(self) -> str:
        if self.kind is RecomputeKind.NONE:
            return "none"
        if self.kind is RecomputeKind.PREFIX:
            return f"prefix:{int(self.amount)}"
        return f"selective:{self.amount:g}"


NO_RECOMPUTE = RecomputeSpec()


def parse_recompute(spec: str) -> RecomputeSpec:
    """`none`, `prefix:N` (N ≥ 0 tokens) or `selective:R` (0 ≤ R ≤ 1); ValueError naming what is wrong."""
    kind_text, _, value = spec.strip().partition(":")
    try:
        kind = RecomputeKind(kind_text)
    except ValueError:
        raise ValueError(f"recompute {spec!r}: the kind must be none, prefix:N or selective:R") from None
    if kind is RecomputeKind.NONE:
        if value:
            raise ValueError(f"recompute {spec!r}: none takes no value")
        return NO_RECOMPUTE
    if kind is RecomputeKind.PREFIX:
        if not (value.isascii() and value.isdigit()):
            raise ValueError(f"recompute {spec!r}: prefix:N needs N, a whole number of tokens ≥ 0")
        return RecomputeSpec(kind, float(int(value)))
    try:
        share = float(value)
    except ValueError:
        share = float("nan")
    if not 0.0 <= share <= 1.0:  # nan fails this too
        raise ValueError(f"recompute {spec!r}: selective:R needs R, a share of tokens within 0..1")
    return RecomputeSpec(kind, share)
