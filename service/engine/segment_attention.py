"""Attention over shared chunk segments plus a request's own tail, with RoPE deferred to the query.

A chunk is held once, in an arena, its keys rotated at LOCAL positions base..base+L-1; every request that reads
it places it at its own offset o (its first token at absolute position o). RoPE scores depend only on position
differences, so a query at absolute position m scores against that chunk exactly as rope(q, m - o + base) against
the local keys: the query is rotated per (row, chunk) and the keys are shared by every request. The request's own
tail (template prefix, question, answer so far) sits in the pool with keys rotated at absolute positions, as the
stitched path holds them, and is attended causally.

Each segment and the tail give a partial (output, log-sum-exp); the segments' partials are merged into the
context's, whose log-sum-exp APE's scale S multiplies before it is merged with the tail's (APE's temperature T
divides the segment scores). S = T = 1 is exact attention over the stitched sequence.

This module holds the metadata of one call and the torch reference (fp32, any device); `segment_launch.py` runs
the same call with Triton kernels that read each chunk once for all the queries attending to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from service.engine.rotary import Rotary

KEYS, VALUES = 0, 1


@dataclass(frozen=True)
class ChunkRange:
    """Arena slots start .. start + length of one chunk, its keys rotated at positions base .. base + length - 1."""

    start: int
    length: int
    base: int = 0


@dataclass(frozen=True)
class Segment:
    """A chunk read by a request, its first token at absolute position `offset`."""

    chunk: int
    offset: int


@dataclass(frozen=True)
class Tail:
    """A request's own keys in the pool: slots start .. start + used, rotated at absolute positions; the call's
    query rows of this request are its last slots (several in a prefill, one in a decode step)."""

    start: int
    used: int


@dataclass(frozen=True)
class RequestSegments:
    """What one request attends to: its chunk segments (fully visible to its rows) and its tail (causal)."""

    segments: tuple[Segment, ...]
    tail: Tail


@dataclass(frozen=True)
class ContextScaling:
    """APE's context temperature (divides the chunk scores) and scale (multiplies the context's log-sum-exp)."""

    temperature: float = 1.0
    scale: float = 1.0

    def __post_init__(self) -> None:
        if not (self.temperature > 0 and self.scale > 0):
            raise ValueError("context temperature and scale must be positive")


@dataclass(frozen=True)
class SegmentBatch:
    """One attention call: query row i belongs to request rows[i] and sits at absolute position positions[i]; a
    request's rows appear in position order and are the last slots of its tail (so every row sees its own key)."""

    chunks: tuple[ChunkRange, ...]
    requests: tuple[RequestSegments, ...]
    rows: tuple[int, ...]
    positions: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.rows) != len(self.positions) or not self.rows:
            raise ValueError("a segment call needs one request index and one position per row, one row at least")
        for request in self.requests:
            for segment in request.segments:
                if not 0 <= segment.chunk < len(self.chunks):
                    raise ValueError(f"segment reads chunk {segment.chunk}; the arena lists {len(self.chunks)}")
        for index, request in enumerate(self.requests):
            if self.rows.count(index) > request.tail.used:
                raise ValueError(f"request {index} has more query rows than live tail slots")

    def tail_visible(self) -> tuple[int, ...]:
        """Tail keys each row sees: row j of a request's k rows sees its first used - k + j + 1 slots."""
        counts = [0] * len(self.requests)
        for request in self.rows:
            counts[request] += 1
        seen = [0] * len(self.requests)
        visible = []
        for request in self.rows:
            seen[request] += 1
            visible.append(self.requests[request].tail.used - counts[request] + seen[request])
        return tuple(visible)

    def reach(self) -> tuple[int, int]:
        """Slots the arena and the tail tensor must hold at least (the ends of the ranges the call reads)."""
        arena = max((c.start + c.length for c in self.chunks), default=0)
        return arena, max(r.tail.start + r.tail.used for r in self.requests)

    def arrays(self) -> SegmentArrays:
        """The same call as arrays (the kernels' plan's form)."""
        segments = [s for r in self.requests for s in r.segments]
        return SegmentArrays(
            chunks=_int64([(c.start, c.length, c.base) for c in self.chunks]).reshape(-1, 3),
            seg_counts=_int64([len(r.segments) for r in self.requests]),
            seg_chunk=_int64([s.chunk for s in segments]),
            seg_offset=_int64([s.offset for s in segments]),
            tail_start=_int64([r.tail.start for r in self.requests]),
            tail_used=_int64([r.tail.used for r in self.requests]),
            rows=_int64(self.rows),
            positions=_int64(self.positions),
        )

    def check_fits(self, arena: torch.Tensor, tail_kv: torch.Tensor) -> None:
        """ValueError when a range of the call lies past the end of its tensor ([2, Hkv, slots, D] each)."""
        arena_end, tail_end = self.reach()
        if arena_end > arena.shape[2] or tail_end > tail_kv.shape[2]:
            raise ValueError(
                f"the call reads arena slots up to {arena_end} and tail slots up to {tail_end}; "
                f"the tensors hold {arena.shape[2]} and {tail_kv.shape[2]}"
            )


def _int64(values: Sequence[int] | Sequence[tuple[int, ...]] | np.ndarray) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


@dataclass(frozen=True, eq=False)
class SegmentArrays:
    """A `SegmentBatch` as int64 arrays, the form the kernels' plan is built from. A decode step of a few hundred
    answers reading 16 chunks each is thousands of `Segment` objects and hashes; built from each request's arrays
    (`shared_decode.Reads`) the same metadata costs a few array operations, not milliseconds per step."""

    chunks: np.ndarray  # [C, 3]: start, length, base of each distinct arena range
    seg_counts: np.ndarray  # [R]: segments per request
    seg_chunk: np.ndarray  # [S]: each segment's chunk index, request after request
    seg_offset: np.ndarray  # [S]: each segment's absolute offset
    tail_start: np.ndarray  # [R]
    tail_used: np.ndarray  # [R]
    rows: np.ndarray  # [N]: each query row's request
    positions: np.ndarray  # [N]

    def __post_init__(self) -> None:
        requests = self.seg_counts.size
        if self.rows.size != self.positions.size or not self.rows.size:
            raise ValueError("a segment call needs one request index and one position per row, one row at least")
        if self.chunks.shape != (self.chunks.shape[0], 3) or int(self.seg_counts.sum()) != self.seg_chunk.size:
            raise ValueError("chunk ranges must be [C, 3] and the segment counts must add up to the segments")
        if self.seg_chunk.size and not (self.seg_chunk.min() >= 0 and self.seg_chunk.max() < self.chunks.shape[0]):
            raise ValueError(f"a segment reads a chunk outside the {self.chunks.shape[0]} the call lists")
        if not (self.rows.min() >= 0 and self.rows.max() < requests) or self.tail_used.size != requests:
            raise ValueError("every row must name one of the call's requests, each with a tail")
        if (np.bincount(self.rows, minlength=requests) > self.tail_used).any():
            raise ValueError("a request has more query rows than live tail slots")

    def tail_visible(self) -> np.ndarray:
        """Tail keys each row sees: row j of a request's k rows sees its first used - k + j + 1 slots."""
        counts = np.bincount(self.rows, minlength=self.seg_counts.size)
        order = np.argsort(self.rows, kind="stable")
        ordered = self.rows[order]
        rank = np.empty_like(order)
        rank[order] = np.arange(order.size) - np.searchsorted(ordered, ordered, side="left")
        visible: np.ndarray = self.tail_used[self.rows] - counts[self.rows] + rank + 1
        return visible

    def reach(self) -> tuple[int, int]:
        """Slots the arena and the tail tensor must hold at least (the ends of the ranges the call reads)."""
        arena = int((self.chunks[:, 0] + self.chunks[:, 1]).max()) if self.chunks.size else 0
        return arena, int((self.tail_start + self.tail_used).max())

    def batch(self) -> SegmentBatch:
        """The same call as objects (the torch reference's form)."""
        chunks = tuple(ChunkRange(int(s), int(n), int(b)) for s, n, b in self.chunks.tolist())
        bounds = np.concatenate(([0], np.cumsum(self.seg_counts))).tolist()
        chunk, offset = self.seg_chunk.tolist(), self.seg_offset.tolist()
        requests = tuple(
            RequestSegments(
                tuple(Segment(chunk[i], offset[i]) for i in range(bounds[r], bounds[r + 1])),
                Tail(int(self.tail_start[r]), int(self.tail_used[r])),
            )
            for r in range(self.seg_counts.size)
        )
        return SegmentBatch(chunks, requests, tuple(self.rows.tolist()), tuple(self.positions.tolist()))


def partial(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 attention of q [Hq, D] (rotated) over keys, values [Hkv, L, D]: output [Hq, D] and log-sum-exp [Hq]
    of the scaled scores (an empty range: zero output, -inf)."""
    kv_heads, length, dim = keys.shape
    heads = q.shape[0]
    if length == 0:
        return q.new_zeros((heads, dim), dtype=torch.float32), q.new_full((heads,), float("-inf"), dtype=torch.float32)
    grouped = q.float().view(kv_heads, heads // kv_heads, dim)
    scores = torch.einsum("hgd,hld->hgl", grouped, keys.float()) * scale
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("hgl,hld->hgd", torch.softmax(scores, dim=-1), values.float())
    return out.reshape(heads, dim), lse.reshape(heads)


def merge(
    outs: torch.Tensor, lse: torch.Tensor, tail: tuple[torch.Tensor, torch.Tensor], context_scale: float = 1.0
) -> torch.Tensor:
    """One row's output [Hq, D] (fp32): the segment partials outs [P, Hq, D] / lse [P, Hq] merged into the context's
    (-inf weighs nothing), its log-sum-exp multiplied by `context_scale`, then merged with the tail's partial."""
    tail_out, tail_lse = tail
    peak = lse.amax(dim=0) if lse.shape[0] else torch.full_like(tail_lse, float("-inf"))
    safe = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    weights = torch.exp(lse - safe)  # [P, Hq]
    total = weights.sum(dim=0)
    context_out = (outs * weights.unsqueeze(-1)).sum(dim=0) / torch.where(total > 0, total, 1.0).unsqueeze(-1)
    context_lse = torch.where(total > 0, safe + torch.log(total), float("-inf")) * context_scale
    top = torch.maximum(context_lse, tail_lse)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    w_context, w_tail = torch.exp(context_lse - top), torch.exp(tail_lse - top)
    merged = context_out * w_context.unsqueeze(-1) + tail_out * w_tail.unsqueeze(-1)
    return merged / (w_context + w_tail).unsqueeze(-1)


def rotate_rows(rotary: Rotary, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """q [P, Hq, D] with row p rotated to positions[p], in fp32 through the model's rotary, cast to q's dtype once."""
    cos, sin = rotary.cos_sin(positions)
    return Rotary.apply(q.transpose(0, 1), cos, sin).transpose(0, 1)


def reference_attention(
    q: torch.Tensor,
    batch: SegmentBatch,
    arena: torch.Tensor,
    tail_kv: torch.Tensor,
    rotary: Rotary,
    scale: float,
    context: ContextScaling | None = None,
) -> torch.Tensor:
    """Attention of the unrotated queries q [N, Hq, D] of `batch` over its chunks in `arena` [2, Hkv, A, D] and its
    tails in `tail_kv` [2, Hkv, S, D], in fp32 (cast to q's dtype). Reads only the slots `batch` names."""
    context = context or ContextScaling()
    batch.check_fits(arena, tail_kv)
    visible = batch.tail_visible()
    outs = []
    for row, request_index in enumerate(batch.rows):
        request = batch.requests[request_index]
        m = batch.positions[row]
        parts = [
            _segment_partial(q[row], batch.chunks[s.chunk], s.offset, m, arena, rotary, scale, context)
            for s in request.segments
        ]
        q_tail = rotate_rows(rotary, q[row : row + 1].float(), torch.tensor([m]))[0]
        tail = request.tail
        tail_part = partial(q_tail, *_range(tail_kv, tail.start, visible[row]), scale)
        seg_outs, seg_lse = _stack(parts, q)
        outs.append(merge(seg_outs, seg_lse, tail_part, context.scale))
    return torch.stack(outs).to(q.dtype)


def _segment_partial(
    q: torch.Tensor,
    chunk: ChunkRange,
    offset: int,
    position: int,
    arena: torch.Tensor,
    rotary: Rotary,
    scale: float,
    context: ContextScaling,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One (row, segment) partial: q rotated to position - offset + base, the chunk's scores divided by T."""
    q_rot = rotate_rows(rotary, q.unsqueeze(0).float(), torch.tensor([position - offset + chunk.base]))[0]
    return partial(q_rot, *_range(arena, chunk.start, chunk.length), scale / context.temperature)


def _range(kv: torch.Tensor, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    return kv[KEYS, :, start : start + length], kv[VALUES, :, start : start + length]


def _stack(parts: Sequence[tuple[torch.Tensor, torch.Tensor]], q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[P, Hq, D] outputs and [P, Hq] log-sum-exps (P = 0 for a request that reads no chunk)."""
    if not parts:
        heads, dim = q.shape[1:]
        return q.new_zeros((0, heads, dim), dtype=torch.float32), q.new_zeros((0, heads), dtype=torch.float32)
    return torch.stack([o for o, _ in parts]), torch.stack([lse for _, lse in parts])
