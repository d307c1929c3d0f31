"""Segment attention with shared reads: each chunk's K/V tiles are read once for every query that attends to it.

The (row, chunk) pairs of a call are grouped by chunk; a Triton program per (chunk range, KV head, block of that
chunk's queries) loads each K/V tile once and scores it against all the queries of the group: the GQA heads of the
KV head times every request reading the chunk, each query rotated in the kernel to m - o + base by the model's
cos/sin rows (looked up once per step). Each pair's partial (output, log-sum-exp) goes to one buffer; the tails run
through the same kernel (a group per request, its rows causal), and a second kernel merges each row's partials by
log-sum-exp (APE's T and S as in the reference, `segment_attention.py`).

When few requests read few chunks, a grid of one program per (chunk, KV head) would leave most of the GPU idle, so
chunks are cut into pieces (more partials, same math: a piece at arena offset a is a chunk of base + a placed at
o + a, which rotates q by the same amount).

A question prefill is the other shape: many rows of each request, every one reading all the request's chunks, so a
chunk's readers are mostly one request's rows and grouping by chunk buys little sharing for a partial per (row,
chunk) and a query gather per chunk tile. A by-request plan (`by_request`) gives each program a block of one
request's rows instead, streaming all the chunks of a split of its chunk list through one online softmax
(`_request_kernel.py`), the query rotated again per chunk; a request's chunk list is split only as far as needed
to fill the GPU (a lone question), so a row has a partial per split, not per chunk. Tails and the merge are the
same kernels.

`SegmentPlan.build` runs on the host once per step (every layer reuses it); `SegmentAttention` holds the step's
rotation tables and runs one layer. For CUDA graphs a plan is padded to a `PlanCapacity` and each step's host
layout (`host_layout`) is copied straight into the captured plan's tensors (`SegmentPlan.load`: one copy from the
host, no device plan of its own), the rotation tables recomputed from it inside the graph.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from service.engine.device_copy import pinned_copy
from service.engine.fused_stitch import LOG2E, next_power_of_2
from service.engine.rotary import Rotary
from service.engine.segment_attention import ContextScaling, SegmentArrays, SegmentBatch
from service.engine.segment_plan import REQUEST_COLUMNS, TILE_COLUMNS, HostPlan, PlanCapacity, padded

# Warps and Triton's pipeline stages (None: its default) of a by-request program, keys per K/V tile and the
# by-chunk programs' stages: module-level so a benchmark can try others.
REQUEST_WARPS = 4
REQUEST_STAGES: int | None = None
BLOCK_N = 64
NUM_STAGES: int | None = None
_MERGE_HEADS = 8
# Programs per KV head a padded plan's launch runs at most (None: one per tile, as an unpadded plan's). A graph's
# plan is padded to its bucket's worst case, most of it dead tiles; each program loops over the live tiles the
# plan counts on the device instead of the grid holding one program per tile, live or not. Module-level so a
# benchmark can compare.
PADDED_PROGRAMS: int | None = 256
# Whether a by-chunk call rotates every query entry once, in a kernel of its own, before the partials: a tile then
# reads one row per query item instead of the query, its rotation partner and two fp32 table rows, and keeps no
# rotation in registers; at the price of writing the rotated entries ([entries, Hq, D]) and one launch more.
# Module-level so a benchmark can compare; on because the by-chunk graph measured faster so (benchmarks §13.13).
PREROTATE = True
# Whether the partials (by chunk and by request) read K/V tiles through a tensor descriptor of the whole K/V
# tensor (on Hopper TMA copies prefetched into shared memory) instead of per-element pointers, which hold ~250
# registers a thread and so one 8-warp program an SM (ptxas, sm_90). Needs kv contiguous and a power-of-two head
# size (else pointers); module-level so a benchmark can compare; off: slower than pointers on an H200 (§13.13).
KV_DESCRIPTORS = False
# Whether a by-request call (question prefill) rotates its query entries, one per (row, chunk), before the
# partials, as PREROTATE does for a by-chunk call: its tiles then hold no query, partner or fp32 table rows across
# the chunks (less spill: ptxas sm_90 still gives 255 registers a thread, the attention loop's own), at the price
# of writing rows x chunks rotated queries a layer. Module-level so a benchmark can compare; on because the
# question-prefill benchmark measured faster so (§13.13).
REQUEST_PREROTATE = True
# Registers a thread of a partials program may hold (ptxas's .maxnreg; None: as many as ptxas takes, up to 255),
# by chunk and by request. Compiled for sm_90 with the launch's alignment, the by-chunk kernel takes 182 registers at
# 64 query items and 8 warps, so one program fits an SM; capped at 128 it spills 4 bytes and two fit, whose loads
# then hide each other's latency: measured faster so on an H200 (§13.14). The by-request kernel capped at 168
# measured slower (its tiles hold more rows), so it stays uncapped. Module-level so a benchmark can compare.
PARTIALS_MAXNREG: int | None = 128
REQUEST_MAXNREG: int | None = None
_ROTATE_BLOCK = 16  # entries a rotation program takes


@functools.cache
def _kernels() -> tuple[Any, Any]:
    from service.engine import _segment_kernel

    return _segment_kernel.segment_partials_kernel, _segment_kernel.segment_merge_kernel


def _kv_descriptor(kv: torch.Tensor, dim: int) -> Any:
    """The descriptor `KV_DESCRIPTORS` asks for, or None (off, kv not contiguous, a head size not a power of two,
    or a triton without descriptors)."""
    if not KV_DESCRIPTORS or not kv.is_contiguous() or dim != next_power_of_2(dim):
        return None
    from service.engine import _segment_kernel

    return _segment_kernel.kv_descriptor(kv, BLOCK_N, dim)


@functools.cache
def _rotate_kernel() -> Any:
    from service.engine import _segment_kernel

    return _segment_kernel.rotate_entries_kernel


@functools.cache
def _request_kernel() -> Any:
    from service.engine import _request_kernel

    return _request_kernel.request_partials_kernel


@dataclass(frozen=True)
class Launch:
    """One partials launch: tiles [T, TILE_COLUMNS] int64 (the live ones first), the query items a tile holds,
    the live tiles' count ([1] int64, on the device: a replayed graph reads each step's) and the programs per KV
    head the grid holds."""

    tiles: torch.Tensor
    block_m: int
    count: torch.Tensor
    programs: int


@dataclass
class SegmentPlan:
    """Device metadata of one call. Query entry e is row q_rows[e] rotated to q_positions[e]; pair p reads entry
    pair_q[p] against the first pair_visible[p] keys of its tile's range; row r merges pairs row_parts[row_ptr[r]
    .. row_ptr[r + 1]] (its chunk pieces) with pair row_tail[r] (its tail; -1: a dead row of a padded plan)."""

    q_rows: torch.Tensor
    q_positions: torch.Tensor
    pair_q: torch.Tensor
    pair_visible: torch.Tensor
    chunks: tuple[Launch, ...]
    tails: tuple[Launch, ...]
    row_ptr: torch.Tensor
    row_parts: torch.Tensor
    row_tail: torch.Tensor
    pairs: int
    reach: tuple[int, int]  # arena and tail slots the plan's ranges end by (checked against the tensors)
    segments: torch.Tensor
    counts: torch.Tensor  # every launch's live tiles, chunk launches then tail launches (`Launch.count` views)
    flat: torch.Tensor  # every field above is a view of this one tensor (one copy to the device fills them all)
    shape: PlanShape  # the host layout's: a captured plan takes another plan's metadata only of the same shape
    by_request: bool = False

    @classmethod
    def build(
        cls,
        batch: SegmentBatch | SegmentArrays,
        group: int,
        kv_heads: int,
        device: torch.device,
        pieces: int | None = None,
        capacity: PlanCapacity | None = None,
        by_request: bool = False,
    ) -> SegmentPlan:
        """The plan of `batch` for `group` query heads per KV head; `pieces`: ranges each chunk is cut into, or by
        request the splits of each request's chunk list (None: `_auto_pieces`, `auto_splits`);
        `capacity`: padded to these sizes (ValueError when the batch does not fit)."""
        return cls.upload(host_layout(batch, group, kv_heads, pieces, capacity, by_request), device)

    @classmethod
    def upload(cls, layout: HostLayout, device: torch.device) -> SegmentPlan:
        """The plan whose metadata `layout` holds, on `device` (one copy)."""
        flat = _upload(layout.flat, device)
        views = list(torch.split(flat, list(layout.shape.sizes)))
        fixed, tiles = views[:9], views[9:]
        chunk_widths, tail_widths = layout.shape.chunk_widths, layout.shape.tail_widths
        chunk_columns = REQUEST_COLUMNS if layout.shape.by_request else TILE_COLUMNS
        columns = [chunk_columns] * len(chunk_widths) + [TILE_COLUMNS] * len(tail_widths)
        widths = chunk_widths + tail_widths
        launches = [
            Launch(t.view(-1, c), w, fixed[8][i : i + 1], _programs(t.numel() // c, layout.padded))
            for i, (t, c, w) in enumerate(zip(tiles, columns, widths, strict=True))
        ]
        return cls(
            q_rows=fixed[0],
            q_positions=fixed[1],
            pair_q=fixed[2],
            pair_visible=fixed[3],
            chunks=tuple(launches[: len(chunk_widths)]),
            tails=tuple(launches[len(chunk_widths) :]),
            row_ptr=fixed[4],
            row_parts=fixed[5],
            row_tail=fixed[6],
            pairs=layout.pairs,
            reach=layout.reach,
            segments=fixed[7].view(-1, 2),
            counts=fixed[8],
            flat=flat,
            shape=layout.shape,
            by_request=layout.shape.by_request,
        )

    def load(self, layout: HostLayout) -> None:
        """Take another call's metadata, laid out alike (padded to one capacity), into this plan's tensors in
        place, by one copy from the host queued on the current stream: a captured graph then replays that call.
        ValueError when the layouts differ (nothing copied)."""
        if layout.shape != self.shape:
            raise ValueError("plans of different capacities")
        self.flat.copy_(_staged(layout.flat, self.flat.device), non_blocking=True)
        self.reach = layout.reach


@dataclass(frozen=True)
class PlanShape:
    """How a plan's metadata is laid out: each field's elements in order, and its launches' tile widths."""

    sizes: tuple[int, ...]
    chunk_widths: tuple[int, ...]
    tail_widths: tuple[int, ...]
    by_request: bool


@dataclass(frozen=True)
class HostLayout:
    """One call's plan on the host, its int64 fields laid end to end as `SegmentPlan` holds them on the device."""

    flat: np.ndarray
    shape: PlanShape
    pairs: int  # the capacity's, when padded: the partial buffers are sized by it
    reach: tuple[int, int]
    padded: bool


def host_layout(
    batch: SegmentBatch | SegmentArrays,
    group: int,
    kv_heads: int,
    pieces: int | None = None,
    capacity: PlanCapacity | None = None,
    by_request: bool = False,
) -> HostLayout:
    """`SegmentPlan.build`'s host half: the plan's arrays (`HostPlan`), padded to `capacity` if given (ValueError
    when the batch does not fit), in one array."""
    arrays = batch if isinstance(batch, SegmentArrays) else batch.arrays()
    host = HostPlan(arrays, group)
    if by_request:
        host.add_requests(pieces, kv_heads)
    else:
        host.add_chunks(pieces, kv_heads)
    host.add_tails()
    row_parts, row_ptr = host.row_parts()
    if capacity is not None:
        host.pad(capacity)
        row_ptr = padded(row_ptr, capacity.rows + 1, int(row_ptr[-1]))
        row_parts = padded(row_parts, capacity.pairs)
    if row_parts.size == 0:
        row_parts = np.zeros(1, dtype=np.int64)
    chunk_widths, tail_widths = sorted(host.chunk_tiles), sorted(host.tail_tiles)
    segments = host.segments.reshape(-1) if host.segments.size else np.zeros(2, dtype=np.int64)
    live = [host.live_tiles(host.chunk_tiles, w) for w in chunk_widths]
    live += [host.live_tiles(host.tail_tiles, w) for w in tail_widths]
    counts = np.array(live or [0], dtype=np.int64)
    parts = [host.q_rows, host.q_positions, host.pair_q, host.pair_visible, row_ptr, row_parts, host.row_tail]
    parts += [segments, counts]
    parts += [host.chunk_tiles[w].reshape(-1) for w in chunk_widths]
    parts += [host.tail_tiles[w].reshape(-1) for w in tail_widths]
    shape = PlanShape(tuple(p.size for p in parts), tuple(chunk_widths), tuple(tail_widths), by_request)
    return HostLayout(np.concatenate(parts), shape, host.pair_q.size, arrays.reach(), capacity is not None)


def _programs(tiles: int, padded: bool) -> int:
    """Programs per KV head of a launch over `tiles` tile rows: one per tile, or for a padded plan at most
    PADDED_PROGRAMS (each loops over the live tiles)."""
    if padded and PADDED_PROGRAMS is not None:
        return min(tiles, PADDED_PROGRAMS)
    return tiles


def _upload(flat: np.ndarray, device: torch.device) -> torch.Tensor:
    """`flat` on `device`, copied asynchronously from `_staged`."""
    return _staged(flat, device).to(device, non_blocking=True)


def _staged(flat: np.ndarray, device: torch.device) -> torch.Tensor:
    """`flat` as the host tensor a copy to `device` reads: for CUDA in pinned memory, so the copy is asynchronous (a
    copy from pageable memory waits for every kernel already queued, so each step's host work, this plan included,
    would wait for the previous step's kernels instead of running beside them; the caching host allocator keeps the
    pinned block until the copy has read it); else `flat` itself."""
    return pinned_copy(flat) if device.type == "cuda" else torch.from_numpy(flat)


class SegmentAttention:
    """One step's segment attention: the plan and its rotation tables, reused by every layer."""

    def __init__(self, plan: SegmentPlan, rotary: Rotary, context: ContextScaling | None = None) -> None:
        self.plan = plan
        self.context = context or ContextScaling()
        self._rotary = rotary
        cos, sin = rotary.cos_sin(plan.q_positions)  # [entries, D] fp32
        self._cos, self._sin = cos.contiguous(), sin.contiguous()

    def refresh(self) -> None:
        """Recompute the rotation tables in place after `plan.load` (a captured graph reads these tensors)."""
        cos, sin = self._rotary.cos_sin(self.plan.q_positions)
        self._cos.copy_(cos)
        self._sin.copy_(sin)

    def __call__(self, q: torch.Tensor, arena: torch.Tensor, tail_kv: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention [N, Hq, D] of the unrotated queries q [N, Hq, D] over the arena's chunks and the pool's tails
        (both [2, Hkv, slots, D], q's dtype, unit stride on D), in q's dtype."""
        launches, merge = self.launches(q, arena, tail_kv, scale)
        for _, _, run in launches:
            run()
        return merge()

    def launches(
        self, q: torch.Tensor, arena: torch.Tensor, tail_kv: torch.Tensor, scale: float
    ) -> tuple[list[tuple[str, Launch | None, Callable[[], None]]], Callable[[], torch.Tensor]]:
        """The call's kernel launches, in order, each with its kind ("rotate" with `PREROTATE` or
        `REQUEST_PREROTATE`, "chunks" or "tails") and its `Launch` (None: the rotation), then the merge that gives
        the call's output: run in turn they are `__call__`; a benchmark times each alone."""
        plan = self.plan
        if not (q.dtype == arena.dtype == tail_kv.dtype):
            raise ValueError("queries, arena and tails must share one dtype")
        if plan.reach[0] > arena.shape[2] or plan.reach[1] > tail_kv.shape[2]:
            raise ValueError(f"the plan reads up to slots {plan.reach}; arena and tails hold fewer")
        heads, dim = q.shape[1], q.shape[2]
        if dim % 2 or q.stride(-1) != 1:
            raise ValueError("segment attention needs an even head size and unit stride on it")
        group = heads // arena.shape[1]
        # Partial outputs in the queries' dtype (fp32 merge weights, fp32 log-sum-exps): at high batch their traffic
        # rivals the shared chunks' own, and a bf16 attention's output is rounded to bf16 anyway.
        part_out = torch.empty((plan.pairs, heads, dim), dtype=q.dtype, device=q.device)
        part_lse = torch.empty((plan.pairs, heads), dtype=torch.float32, device=q.device)
        rotation = _Rotation(q, self._cos, self._sin)
        runs: list[tuple[str, Launch | None, Callable[[], None]]] = []
        if REQUEST_PREROTATE if plan.by_request else PREROTATE:
            rotated = torch.empty((plan.q_rows.shape[0], heads, dim), dtype=q.dtype, device=q.device)
            runs.append(("rotate", None, functools.partial(_run_rotation, plan, rotation, rotated)))
            rotation = _Rotation(rotated, self._cos, self._sin, prerotated=True)
        partials = _Partials(part_out, part_lse, group)
        by_chunk = (plan.q_rows, plan.pair_q, plan.pair_visible)
        chunk_metadata = (plan.segments,) if plan.by_request else by_chunk
        chunk_scale = scale / self.context.temperature
        chunk_kv = (arena, _kv_descriptor(arena, dim))  # once a call: every launch over it shares the descriptor
        tail = (tail_kv, _kv_descriptor(tail_kv, dim))
        runs += [
            (
                "chunks",
                launch,
                functools.partial(
                    _run_partials, launch, chunk_kv, rotation, chunk_metadata, partials, chunk_scale, plan.by_request
                ),
            )
            for launch in plan.chunks
        ]
        runs += [
            ("tails", launch, functools.partial(_run_partials, launch, tail, rotation, by_chunk, partials, scale))
            for launch in plan.tails
        ]
        return runs, functools.partial(_run_merge, plan, part_out, part_lse, q.dtype, self.context.scale)


@dataclass(frozen=True)
class _Rotation:
    """What the kernels rotate queries from: q [N, Hq, D] unrotated, cos/sin [entries, D]; or (`prerotated`) q
    [entries, Hq, D] each entry's query already rotated."""

    q: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    prerotated: bool = False


def _run_rotation(plan: SegmentPlan, rotation: _Rotation, out: torch.Tensor) -> None:
    """Every query entry of `plan` rotated into `out` [entries, Hq, D] (`PREROTATE`)."""
    entries = plan.q_rows.shape[0]
    if entries == 0:
        return
    q, heads, dim = rotation.q, out.shape[1], out.shape[2]
    _rotate_kernel()[(-(-entries // _ROTATE_BLOCK), heads)](
        q,
        rotation.cos,
        rotation.sin,
        plan.q_rows,
        out,
        entries,
        q.stride(0),
        q.stride(1),
        rotation.cos.stride(0),
        out.stride(0),
        out.stride(1),
        head_dim=dim,
        dim_p2=next_power_of_2(dim),
        block_e=_ROTATE_BLOCK,
        num_warps=4,
    )


@dataclass(frozen=True)
class _Partials:
    """Where a call's partials go: outputs [pairs, Hq, D], fp32 log-sum-exps [pairs, Hq]; Hq / Hkv query heads per
    KV head."""

    out: torch.Tensor
    lse: torch.Tensor
    group: int


def _run_partials(
    launch: Launch,
    kv_read: tuple[torch.Tensor, Any],
    rotation: _Rotation,
    metadata: tuple[torch.Tensor, ...],
    partials: _Partials,
    scale: float,
    by_request: bool = False,
) -> None:
    """One launch of a partials kernel over `kv_read`'s kv (with its descriptor, `KV_DESCRIPTORS`, or None): the
    by-chunk one (`metadata`: the entries' rows, each pair's entry and visible keys) or the by-request one
    (`metadata`: the segment table). Both take their arguments in one order around the metadata."""
    kv, kv_desc = kv_read
    if kv.stride(-1) != 1:
        raise ValueError("segment attention needs unit stride on the head dimension")
    if launch.programs == 0:
        return
    q, out, lse = rotation.q, partials.out, partials.lse
    dim = q.shape[-1]
    kernel = _request_kernel() if by_request else _kernels()[0]
    warps, stages = (REQUEST_WARPS, REQUEST_STAGES) if by_request else (_warps(launch.block_m), NUM_STAGES)
    maxnreg = REQUEST_MAXNREG if by_request else PARTIALS_MAXNREG
    kernel[(launch.programs, kv.shape[1])](
        q,
        rotation.cos,
        rotation.sin,
        kv,
        launch.tiles,
        launch.count,
        *metadata,
        out,
        lse,
        q.stride(0),
        q.stride(1),
        rotation.cos.stride(0),
        kv.stride(0),
        kv.stride(1),
        kv.stride(2),
        out.stride(0),
        out.stride(1),
        lse.stride(0),
        scale * LOG2E,
        group=partials.group,
        head_dim=dim,
        dim_p2=next_power_of_2(dim),
        block_m=launch.block_m,
        block_n=BLOCK_N,
        ieee=kv.dtype == torch.float32,
        num_warps=warps,
        **({} if stages is None else {"num_stages": stages}),
        **({} if maxnreg is None else {"maxnreg": maxnreg}),
        kv_desc=kv_desc,
        prerotated=rotation.prerotated,
    )


def _run_merge(
    plan: SegmentPlan, part_out: torch.Tensor, part_lse: torch.Tensor, dtype: torch.dtype, context_scale: float
) -> torch.Tensor:
    rows = plan.row_tail.shape[0]
    heads, dim = part_out.shape[1], part_out.shape[2]
    out = torch.empty((rows, heads, dim), dtype=dtype, device=part_out.device)
    block_h = min(_MERGE_HEADS, next_power_of_2(heads))
    _kernels()[1][(rows, -(-heads // block_h))](
        part_out,
        part_lse,
        plan.row_ptr,
        plan.row_parts,
        plan.row_tail,
        out,
        heads,
        part_out.stride(0),
        part_out.stride(1),
        part_lse.stride(0),
        out.stride(0),
        out.stride(1),
        context_scale,
        head_dim=dim,
        dim_p2=next_power_of_2(dim),
        block_h=block_h,
        num_warps=4,
    )
    return out


def _warps(block_m: int) -> int:
    """Warps a partials program runs with: below 8 the wider tiles spill registers (ptxas, sm_90, head_dim 128)."""
    return 4 if block_m <= 16 else 8
