"""Batched question prefill and decode over shared chunks: no request's context is ever copied.

A request's pool slab holds only its own tail: the template prefix at positions 0 .. P-1, then its question at
the plan's `question_start` and its answer after (keys rotated at absolute positions, as the stitched path holds
them). Its chunks stay in the `ChunkArena`, each held once at local positions, and are read through segment
attention, which rotates the query by each chunk's offset in this request (`StitchPlan.starts`: reordered and
composite alike). The per-layer code is `LeanForward.layers_static`, the batched decode's own, with a `LayerAttend`
in place of the pool attention; the fed tokens' K/V land in each slab as in `BatchDecoder`.

Attention: `SegmentAttention` (Triton) where `triton_runs_on`, else the torch reference (fp32, per row; the CPU's).
Both take the plan of one step, built once and reused by every layer. A decode step's plan groups the rows by chunk
(each chunk read once for every answer reading it); a question prefill's, by request (`PREFILL_BY_REQUEST`: each
program streams all of one request's chunks for a block of its rows; see `segment_launch`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from service.engine.batch_decode import BatchDecoder, DecodeRows, ExtendRows, extend_lists
from service.engine.chunk_arena import ChunkArena
from service.engine.forward import LayerAttend
from service.engine.fused_stitch import triton_runs_on
from service.engine.kv_buffer import KVBuffer
from service.engine.kv_layout import KVBlock
from service.engine.kv_pool import KVPool, Slab
from service.engine.rotary import Rotary
from service.engine.segment_attention import (
    ChunkRange,
    ContextScaling,
    SegmentArrays,
    SegmentBatch,
    reference_attention,
)
from service.engine.segment_launch import SegmentAttention, SegmentPlan
from service.engine.stitch import PositionMode, StitchPlan, plan_positions, stitch_into

# Question prefills plan their attention by request (one program streams a request's chunks for a block of its
# rows) rather than by chunk: module-level so a benchmark can compare the two.
PREFILL_BY_REQUEST = True
# Whether a captured mixed step runs its two attentions side by side, the riders' (compute-bound: many query rows
# over their chunks) on a second stream beside the running answers' (bound by reading the chunks), instead of one
# after the other. Module-level so a benchmark can compare; on: measured faster through the gateway (§13.14).
CONCURRENT_SPLIT = True


@functools.cache
def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The second stream of `device` that mixed steps fork their riders' attention onto (one a device, made once,
    outside any graph capture)."""
    return torch.cuda.Stream(device)  # type: ignore[no-untyped-call]


@dataclass(frozen=True)
class Placement:
    """A chunk a request reads: its arena range and the position of its first token in the request's prompt."""

    chunk: ChunkRange
    offset: int


@dataclass(frozen=True)
class Reads:
    """The chunks a request reads, in prompt order: its placements and the same as arrays, built once when it is
    placed (every decode step joins the running requests' arrays instead of walking their placements)."""

    placed: tuple[Placement, ...] = ()
    ranges: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), dtype=np.int64), compare=False)
    offsets: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64), compare=False)

    @classmethod
    def of(cls, placed: Sequence[Placement]) -> Reads:
        ranges = np.array([(p.chunk.start, p.chunk.length, p.chunk.base) for p in placed], dtype=np.int64)
        offsets = np.array([p.offset for p in placed], dtype=np.int64)
        return cls(tuple(placed), ranges.reshape(-1, 3), offsets)

    def __len__(self) -> int:
        return len(self.placed)

    def __iter__(self) -> Iterator[Placement]:
        return iter(self.placed)

    def __getitem__(self, index: int) -> Placement:
        return self.placed[index]


def placements(plan: StitchPlan, ranges: Sequence[ChunkRange]) -> Reads:
    """Each chunk's range at its planned start (`plan` covers the prefix, then the chunks `ranges` hold)."""
    if len(ranges) != len(plan.starts) - 1:
        raise ValueError(f"{len(ranges)} chunk ranges for a plan of {len(plan.starts) - 1} chunks")
    return Reads.of([Placement(chunk, start) for chunk, start in zip(ranges, plan.starts[1:], strict=True)])


def place_prefix(pool: KVPool, slab: Slab, prefix: KVBlock, rotary: Rotary) -> KVBuffer:
    """The slab's buffer holding the template prefix at positions 0 .. P-1, rotated exactly as a stitch places it;
    its live slots are the prefix's (the question then goes at the plan's `question_start`, after the chunks)."""
    buffer = pool.buffer(slab)
    stitch_into(buffer, rotary, [prefix], plan_positions(PositionMode.REORDERED, [prefix.num_tokens]))
    return buffer


class PrefixPlacer:
    """Puts the template prefix into shared requests' slabs. Every such slab starts with the same rotated prefix,
    so the first is placed as a stitch places it and kept, and the next ones get one copy of it instead of the
    rotation's dozen small kernels per admission (a new prefix block, another template, is placed anew)."""

    def __init__(self, pool: KVPool, rotary: Rotary) -> None:
        self._pool = pool
        self._rotary = rotary
        self._kept: tuple[KVBlock, torch.Tensor] | None = None

    def place(self, slab: Slab, prefix: KVBlock) -> KVBuffer:
        """`place_prefix`'s buffer: the prefix at slots 0 .. P-1, its live slots the prefix's."""
        kept = self._kept
        if kept is None or kept[0] is not prefix:
            buffer = place_prefix(self._pool, slab, prefix, self._rotary)
            self._kept = (prefix, buffer.data[:, :, :, : prefix.num_tokens].clone())
            return buffer
        buffer = self._pool.buffer(slab)
        tokens = prefix.num_tokens
        buffer.reserve(tokens)
        buffer.data[:, :, :, :tokens].copy_(kept[1])
        buffer.commit(tokens, tokens)
        return buffer


def segment_batch(
    reads: Sequence[Reads | Sequence[Placement]],
    tails: Sequence[tuple[int, int]],
    rows: Sequence[int] | np.ndarray,
    positions: Sequence[int],
) -> SegmentArrays:
    """One call's metadata: each distinct arena range listed once (so a chunk read by several requests is one
    chunk of the call, read once by the kernels), each request's segments pointing at it. `tails`: each
    request's (slab start, live slots)."""
    if len(reads) != len(tails):
        raise ValueError("one list of placements per request")
    tables = [r if isinstance(r, Reads) else Reads.of(r) for r in reads]
    ranges = np.concatenate([t.ranges for t in tables]) if tables else np.zeros((0, 3), dtype=np.int64)
    # A range's start names it: two live ranges of the arena never share a first slot.
    _, first, seg_chunk = np.unique(ranges[:, 0], return_index=True, return_inverse=True)
    tail = np.asarray(tails, dtype=np.int64).reshape(-1, 2)
    return SegmentArrays(
        chunks=ranges[first],
        seg_counts=np.array([len(t) for t in tables], dtype=np.int64),
        seg_chunk=seg_chunk.reshape(-1).astype(np.int64),
        seg_offset=np.concatenate([t.offsets for t in tables]) if tables else np.zeros(0, dtype=np.int64),
        tail_start=tail[:, 0].copy(),
        tail_used=tail[:, 1].copy(),
        rows=np.asarray(rows, dtype=np.int64),
        positions=np.asarray(positions, dtype=np.int64),
    )


def decode_batch(
    positions: Sequence[int], spans: Sequence[tuple[int, int]], reads: Sequence[Reads | Sequence[Placement]]
) -> SegmentArrays:
    """A decode step's metadata: row b feeds at positions[b], its tail the live slots spans[b] (fed token
    included), as `DecodeRows.build` takes them."""
    return segment_batch(reads, spans, np.arange(len(spans)), positions)


def extend_batch(
    requests: Sequence[tuple[Sequence[int], int, int, int]], reads: Sequence[Reads | Sequence[Placement]]
) -> SegmentArrays:
    """An extend's metadata from the (new ids, first position, slab start, live slots before) per request that
    `ExtendRows.build` takes: each request's new tokens are the last rows of its tail, causal."""
    _, positions, _, _, spans = extend_lists(requests)
    rows = [r for r, (_, _, new) in enumerate(spans) for _ in range(new)]
    return segment_batch(reads, [(start, used) for start, used, _ in spans], rows, positions)


class SegmentLayerAttend:
    """One call's segment attention, layer by layer (a `LayerAttend`): the arena's layer and the pool's."""

    def __init__(
        self,
        batch: SegmentArrays,
        arena: ChunkArena,
        rotary: Rotary,
        context: ContextScaling,
        kernels: bool,
        by_request: bool = False,
    ) -> None:
        self.batch = batch
        self._objects: SegmentBatch | None = None
        self._arena = arena.data
        self._rotary = rotary
        self._context = context
        self._kernel: SegmentAttention | None = None
        if kernels:
            spec = arena.spec
            group = spec.num_heads // spec.num_kv_heads
            plan = SegmentPlan.build(batch, group, spec.num_kv_heads, spec.device, by_request=by_request)
            self._kernel = SegmentAttention(plan, rotary, context)

    def attend_layer(self, layer: int, q: torch.Tensor, kv: torch.Tensor, scale: float) -> torch.Tensor:
        arena = self._arena[layer]
        if self._kernel is not None:
            return self._kernel(q, arena, kv, scale)
        if self._objects is None:
            self._objects = self.batch.batch()
        return reference_attention(q, self._objects, arena, kv, self._rotary, scale, self._context)


class SplitAttend:
    """A mixed forward's attention (a `LayerAttend`): its first `rows` queries through `head`, the rest through
    `tail`, over the same pool. With a `side` stream the tail runs there, beside the head: the side stream first
    waits for everything before (the layer's K/V written; the previous layer's use of the side's output, so its
    memory is free again), and the current stream waits for the side before the two outputs are joined."""

    def __init__(self, head: LayerAttend, tail: LayerAttend, rows: int, side: torch.cuda.Stream | None = None) -> None:
        self._head, self._tail, self._rows, self._side = head, tail, rows, side

    def attend_layer(self, layer: int, q: torch.Tensor, kv: torch.Tensor, scale: float) -> torch.Tensor:
        if self._side is None:
            first = self._head.attend_layer(layer, q[: self._rows], kv, scale)
            return torch.cat((first, self._tail.attend_layer(layer, q[self._rows :], kv, scale)))
        main = torch.cuda.current_stream(q.device)
        self._side.wait_stream(main)
        with torch.cuda.stream(self._side):
            rest = self._tail.attend_layer(layer, q[self._rows :], kv, scale)
        first = self._head.attend_layer(layer, q[: self._rows], kv, scale)
        main.wait_stream(self._side)
        return torch.cat((first, rest))


class SharedDecoder:
    """`BatchDecoder`'s step and extend with each request's chunks read from the arena instead of its slab.

    `context`: APE's temperature and scale (the stitched path's `context_temperature` is the temperature here);
    `kernels`: None picks the Triton kernels where `triton_runs_on`, else the torch reference."""

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
        self.kernels = triton_runs_on(arena.spec.device) if kernels is None else kernels

    def attention(self, batch: SegmentArrays, by_request: bool = False) -> SegmentLayerAttend:
        """The call's attention (its plan built once, here, for every layer); `by_request`: a prefill's plan."""
        rotary = self.decoder.forward.rotary
        return SegmentLayerAttend(batch, self.arena, rotary, self.context, self.kernels, by_request)

    @torch.inference_mode()
    def step(self, rows: DecodeRows, batch: SegmentArrays) -> torch.Tensor:
        """Feed each row's token, write its K/V into its slab; returns fp32 logits [B, vocab]. `batch`: the
        step's `decode_batch` (its rows and tails those of `rows`)."""
        attention = self.attention(batch)
        return self.decoder.forward.head_rows(self._layers(rows.ids, rows.positions, rows.slots, attention))

    @torch.inference_mode()
    def extend(self, rows: ExtendRows, batch: SegmentArrays) -> torch.Tensor:
        """Feed each request its new tokens (its question: causal among themselves, after its tail's live slots,
        every chunk fully visible), writing their K/V into its slab; fp32 logits [R, vocab] of each request's last
        token. `batch`: the extend's `extend_batch`."""
        attention = self.attention(batch, PREFILL_BY_REQUEST)
        hidden = self._layers(rows.ids, rows.positions, rows.slots, attention)
        return self.decoder.forward.head_rows(hidden.index_select(0, rows.last))

    @torch.inference_mode()
    def mixed(
        self, decode: DecodeRows, step_call: SegmentArrays, extend: ExtendRows, extend_call: SegmentArrays
    ) -> torch.Tensor:
        """A decode step and a question prefill in ONE forward (questions riding in the running answers' step, as
        `BatchDecoder.mixed` on the copy path): every matmul runs once over the decode rows' tokens then the
        questions', and the attention runs each part through its own plan (the step's by chunk, the questions'
        as `extend` plans them). fp32 logits [B + R, vocab]: the decode rows', then each question's last token's.
        `step_call` and `extend_call`: the parts' `decode_batch` and `extend_batch`."""
        batch = decode.ids.shape[0]
        if step_call.rows.size != batch or extend_call.rows.size != extend.ids.shape[0]:
            raise ValueError("each part's segment metadata must have its own rows")
        attention = SplitAttend(self.attention(step_call), self.attention(extend_call, PREFILL_BY_REQUEST), batch)
        return self.mixed_forward(decode, extend, attention, extend.last.shape[0])

    def mixed_forward(
        self, decode: DecodeRows, extend: ExtendRows, attention: LayerAttend, questions: int
    ) -> torch.Tensor:
        """`mixed`'s forward with its attention given (a captured graph's plans, or the call's): fp32 logits of the
        decode rows, then of the first `questions` requests' last tokens (a graph's padding request comes after)."""
        batch = decode.ids.shape[0]
        fwd = self.decoder.forward
        hidden = fwd.embed_static(torch.cat((decode.ids, extend.ids)).view(1, -1))
        positions = torch.cat((decode.positions, extend.positions))
        slots = torch.cat((decode.slots, extend.slots))
        hidden = fwd.layers_static(self.decoder.pool.data, hidden, positions, slots, attention, (0, len(fwd.layers)))
        last = torch.cat((torch.arange(batch, device=hidden.device), extend.last[:questions] + batch))
        return fwd.head_rows(hidden.index_select(0, last))

    def _layers(
        self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, attention: SegmentLayerAttend
    ) -> torch.Tensor:
        """Hidden states [T, hidden] of `ids` through every layer, K/V written at `slots` of the pool."""
        if attention.batch.rows.size != ids.shape[0]:
            raise ValueError(f"{ids.shape[0]} tokens with segment metadata of {len(attention.batch.rows)} rows")
        fwd = self.decoder.forward
        hidden = fwd.embed_static(ids.view(1, -1))
        pool = self.decoder.pool.data
        return fwd.layers_static(pool, hidden, positions, slots, attention, (0, len(fwd.layers)))
