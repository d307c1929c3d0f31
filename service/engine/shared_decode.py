"""Batched question prefill and decode over shared chunks: no request's context is ever copied.

A request's pool slab holds only its own tail: the template prefix at positions 0 .. P-1, then its question at
the plan's `question_start` and its answer after (keys rotated at absolute positions, as the stitched path holds
them). Its chunks stay in the `ChunkArena`, each held once at local positions, and are read through segment
attention, which rotates the query by each chunk's offset in this request (`StitchPlan.starts`: reordered and
composite alike). The per-layer code is `LeanForward.layers_static`, the batched decode's own, with a `LayerAttend`
in place of the pool attention; the fed tokens' K/V land in each slab as in `BatchDecoder`.

Attention: `SegmentAttention` (Triton, shared reads of each chunk) where `segment_kernels_apply`, else the torch
reference (fp32, per row; the CPU's). Both take the plan of one step, built once and reused by every layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from service.engine.batch_decode import BatchDecoder, DecodeRows, ExtendRows, extend_lists
from service.engine.chunk_arena import ChunkArena
from service.engine.kv_buffer import KVBuffer
from service.engine.kv_layout import KVBlock
from service.engine.kv_pool import KVPool, Slab
from service.engine.rotary import Rotary
from service.engine.segment_attention import (
    ChunkRange,
    ContextScaling,
    RequestSegments,
    Segment,
    SegmentBatch,
    Tail,
    reference_attention,
)
from service.engine.segment_launch import SegmentAttention, SegmentPlan, segment_kernels_apply
from service.engine.stitch import PositionMode, StitchPlan, plan_positions, stitch_into


@dataclass(frozen=True)
class Placement:
    """A chunk a request reads: its arena range and the position of its first token in the request's prompt."""

    chunk: ChunkRange
    offset: int


def placements(plan: StitchPlan, ranges: Sequence[ChunkRange]) -> tuple[Placement, ...]:
    """Each chunk's range at its planned start (`plan` covers the prefix, then the chunks `ranges` hold)."""
    if len(ranges) != len(plan.starts) - 1:
        raise ValueError(f"{len(ranges)} chunk ranges for a plan of {len(plan.starts) - 1} chunks")
    return tuple(Placement(chunk, start) for chunk, start in zip(ranges, plan.starts[1:], strict=True))


def place_prefix(pool: KVPool, slab: Slab, prefix: KVBlock, rotary: Rotary) -> KVBuffer:
    """The slab's buffer holding the template prefix at positions 0 .. P-1, rotated exactly as a stitch places it;
    its live slots are the prefix's (the question then goes at the plan's `question_start`, after the chunks)."""
    buffer = pool.buffer(slab)
    stitch_into(buffer, rotary, [prefix], plan_positions(PositionMode.REORDERED, [prefix.num_tokens]))
    return buffer


def segment_batch(
    reads: Sequence[Sequence[Placement]], tails: Sequence[Tail], rows: Sequence[int], positions: Sequence[int]
) -> SegmentBatch:
    """One call's metadata: each distinct arena range listed once (so a chunk read by several requests is one
    chunk of the call, read once by the kernels), each request's segments pointing at it."""
    if len(reads) != len(tails):
        raise ValueError("one list of placements per request")
    index: dict[ChunkRange, int] = {}
    requests = []
    for placed, tail in zip(reads, tails, strict=True):
        segments = tuple(Segment(index.setdefault(p.chunk, len(index)), p.offset) for p in placed)
        requests.append(RequestSegments(segments, tail))
    return SegmentBatch(tuple(index), tuple(requests), tuple(rows), tuple(positions))


def decode_batch(
    positions: Sequence[int], spans: Sequence[tuple[int, int]], reads: Sequence[Sequence[Placement]]
) -> SegmentBatch:
    """A decode step's metadata: row b feeds at positions[b], its tail the live slots spans[b] (fed token
    included), as `DecodeRows.build` takes them."""
    tails = [Tail(start, used) for start, used in spans]
    return segment_batch(reads, tails, range(len(spans)), positions)


def extend_batch(
    requests: Sequence[tuple[Sequence[int], int, int, int]], reads: Sequence[Sequence[Placement]]
) -> SegmentBatch:
    """An extend's metadata from the (new ids, first position, slab start, live slots before) per request that
    `ExtendRows.build` takes: each request's new tokens are the last rows of its tail, causal."""
    _, positions, _, _, spans = extend_lists(requests)
    rows = [r for r, (_, _, new) in enumerate(spans) for _ in range(new)]
    return segment_batch(reads, [Tail(start, used) for start, used, _ in spans], rows, positions)


class SegmentLayerAttend:
    """One call's segment attention, layer by layer (a `LayerAttend`): the arena's layer and the pool's."""

    def __init__(
        self, batch: SegmentBatch, arena: ChunkArena, rotary: Rotary, context: ContextScaling, kernels: bool
    ) -> None:
        self.batch = batch
        self._arena = arena.data
        self._rotary = rotary
        self._context = context
        self._kernel: SegmentAttention | None = None
        if kernels:
            spec = arena.spec
            plan = SegmentPlan.build(batch, spec.num_heads // spec.num_kv_heads, spec.num_kv_heads, spec.device)
            self._kernel = SegmentAttention(plan, rotary, context)

    def attend_layer(self, layer: int, q: torch.Tensor, kv: torch.Tensor, scale: float) -> torch.Tensor:
        arena = self._arena[layer]
        if self._kernel is not None:
            return self._kernel(q, arena, kv, scale)
        return reference_attention(q, self.batch, arena, kv, self._rotary, scale, self._context)


class SharedDecoder:
    """`BatchDecoder`'s step and extend with each request's chunks read from the arena instead of its slab.

    `context`: APE's temperature and scale (the stitched path's `context_temperature` is the temperature here);
    `kernels`: None picks the Triton kernels where `segment_kernels_apply`, else the torch reference."""

    def __init__(
        self,
        decoder: BatchDecoder,
        arena: ChunkArena,
        context: ContextScaling | None = None,
        kernels: bool | None = None,
    ) -> None:
        if arena.spec != decoder.forward.spec:
            raise ValueError("the arena was sized for another model")
        self.decoder = decoder
        self.arena = arena
        self.context = context or ContextScaling()
        self.kernels = segment_kernels_apply(arena.spec.device) if kernels is None else kernels

    def attention(self, batch: SegmentBatch) -> SegmentLayerAttend:
        """The step's attention (its plan built once, here, for every layer)."""
        return SegmentLayerAttend(batch, self.arena, self.decoder.forward.rotary, self.context, self.kernels)

    @torch.inference_mode()
    def step(self, rows: DecodeRows, batch: SegmentBatch) -> torch.Tensor:
        """Feed each row's token, write its K/V into its slab; returns fp32 logits [B, vocab]. `batch`: the
        step's `decode_batch` (its rows and tails those of `rows`)."""
        return self.decoder.forward.head_rows(self._layers(rows.ids, rows.positions, rows.slots, batch))

    @torch.inference_mode()
    def extend(self, rows: ExtendRows, batch: SegmentBatch) -> torch.Tensor:
        """Feed each request its new tokens (its question: causal among themselves, after its tail's live slots,
        every chunk fully visible), writing their K/V into its slab; fp32 logits [R, vocab] of each request's last
        token. `batch`: the extend's `extend_batch`."""
        hidden = self._layers(rows.ids, rows.positions, rows.slots, batch)
        return self.decoder.forward.head_rows(hidden.index_select(0, rows.last))

    def _layers(
        self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, batch: SegmentBatch
    ) -> torch.Tensor:
        """Hidden states [T, hidden] of `ids` through every layer, K/V written at `slots` of the pool."""
        if len(batch.rows) != ids.shape[0]:
            raise ValueError(f"{ids.shape[0]} tokens with segment metadata of {len(batch.rows)} rows")
        fwd = self.decoder.forward
        hidden = fwd.embed_static(ids.view(1, -1))
        pool = self.decoder.pool.data
        return fwd.layers_static(pool, hidden, positions, slots, self.attention(batch), (0, len(fwd.layers)))
