"""How much of a stitched context to recompute: `none`, `prefix:N`, `selective:R[:F]`, `query:R[:F]` or `auto[:T]`.

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
    QUERY = "query"  # ProphetKV: the share R of chunk tokens the question attends to most
    AUTO = "auto"  # per request: only where the estimated deviation exceeds the threshold T (`recompute_select`)


# `auto`'s default threshold on the attention-weighted relative deviation of the cached KV (recompute_select.py):
# on the real-model eval in docs/quality.md 0.05 left most answers alone and kept less than 0.02 did.
AUTO_THRESHOLD = 0.02

# Why `composite` positions refuse a recompute: every chunk starts at the same position, so a recomputed token
# would attend to earlier chunks' tokens sitting at positions at or after its own, which no prefill ever does.
COMPOSITE_RECOMPUTE = (
    "composite positions cannot be recomputed: chunks share positions, so a recomputed token would attend to "
    "earlier chunks at positions at or after its own; use positions reordered"
)


@dataclass(frozen=True)
class RecomputeSpec:
    """What to recompute after the stitch: `amount` is tokens per chunk for `prefix`, a share for `selective` and
    `query`, the threshold for `auto`. `floor` (`selective` and `query` only, at most `amount`): the share of every
    chunk's own tokens chosen within that chunk before the rest of the budget goes to the best tokens overall. A
    global choice gives the first chunk few tokens (it misses only the template prefix, so its tokens deviate
    least), yet answers whose gold passage comes first lose most (docs/quality.md)."""

    kind: RecomputeKind = RecomputeKind.NONE
    amount: float = 0.0
    floor: float = 0.0

    @property
    def active(self) -> bool:
        """False where nothing would be recomputed (`none`, `prefix:0`, `selective:0`): the plain turbo path."""
        return self.kind is not RecomputeKind.NONE and self.amount > 0

    def __str__(self) -> str:
        if self.kind is RecomputeKind.NONE:
            return "none"
        if self.kind is RecomputeKind.PREFIX:
            return f"prefix:{int(self.amount)}"
        if self.kind is RecomputeKind.AUTO:
            return "auto" if self.amount == AUTO_THRESHOLD else f"auto:{self.amount:g}"
        return f"{self.kind.value}:{self.amount:g}" + (f":{self.floor:g}" if self.floor else "")


NO_RECOMPUTE = RecomputeSpec()


def parse_recompute(spec: str) -> RecomputeSpec:
    """`none`, `prefix:N` (N ≥ 0 tokens), `selective:R[:F]` or `query:R[:F]` (0 ≤ F ≤ R ≤ 1: share R, per-chunk
    floor F), `auto` or `auto:T` (0 < T ≤ 1); ValueError naming what is wrong."""
    kind_text, _, value = spec.strip().partition(":")
    try:
        kind = RecomputeKind(kind_text)
    except ValueError:
        raise ValueError(
            f"recompute {spec!r}: the kind must be none, prefix:N, selective:R[:F], query:R[:F] or auto[:T]"
        ) from None
    if kind is RecomputeKind.NONE:
        if value:
            raise ValueError(f"recompute {spec!r}: none takes no value")
        return NO_RECOMPUTE
    if kind is RecomputeKind.PREFIX:
        if not (value.isascii() and value.isdigit()):
            raise ValueError(f"recompute {spec!r}: prefix:N needs N, a whole number of tokens ≥ 0")
        return RecomputeSpec(kind, float(int(value)))
    if kind is RecomputeKind.AUTO:
        threshold = _number(value) if value else AUTO_THRESHOLD
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"recompute {spec!r}: auto:T needs T, a deviation threshold within (0, 1]")
        return RecomputeSpec(kind, threshold)
    share_text, has_floor, floor_text = value.partition(":")
    share = _number(share_text)
    if not 0.0 <= share <= 1.0:  # nan fails this too
        raise ValueError(f"recompute {spec!r}: {kind.value}:R needs R, a share of tokens within 0..1")
    floor = _number(floor_text) if has_floor else 0.0
    if not 0.0 <= floor <= share:
        raise ValueError(f"recompute {spec!r}: {kind.value}:R:F needs F, each chunk's floor share, within 0..R")
    return RecomputeSpec(kind, share, floor)


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return float("nan")
