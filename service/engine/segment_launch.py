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
rotation tables and runs one layer. For CUDA graphs a plan is padded to a `PlanCapacity` and each step's plan is
copied into the captured one (`copy_from`, then `SegmentAttention.refresh`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from service.engine.device_copy import pinned_copy
from service.engine.fused_stitch import LOG2E, next_power_of_2
from service.engine.rotary import Rotary
from service.engine.segment_attention import ContextScaling, SegmentArrays, SegmentBatch

# A tile row: arena start and length of its key range, its group's first pair and pair count, its query block.
TILE_COLUMNS = 5
# A by-request tile row: first row and rows, first entry and segments, first segment, split lo .. hi, block, pair.
REQUEST_COLUMNS = 9
# Query items a by-request tile holds (one width: a prefill's requests have many rows each); module-level so a
# benchmark can try others, with its warps and stages.
REQUEST_BLOCK_M = 64
REQUEST_WARPS = 4
REQUEST_STAGES: int | None = None
# Keys per K/V tile and Triton's pipeline stages (None: its default): module-level so a benchmark can try others.
BLOCK_N = 64
NUM_STAGES: int | None = None
_MIN_BLOCK_M = 16
# Query items a tile holds at most: a chunk read by more queries is read once per block of them (from L2 after
# the first). 128 would halve those reads but spills registers at 8 warps (ptxas, sm_90, head_dim 128); module-level
# so a benchmark can try it.
MAX_BLOCK_M = 64
# Programs worth having in flight before chunks are cut: about two per SM of an H100.
_TARGET_PROGRAMS = 264
# Programs a by-request plan splits its requests' chunk lists for: a prefill program is long (a request's whole
# chunk list), so a last wave that fills a few SMs leaves the rest idle for a whole program; about four waves of
# resident programs keep that tail short (more partials to merge, a few rows each).
REQUEST_TARGET_PROGRAMS = 1024
_MIN_PIECE = 128
_MERGE_HEADS = 8


@functools.cache
def _kernels() -> tuple[Any, Any]:
    from service.engine import _segment_kernel

    return _segment_kernel.segment_partials_kernel, _segment_kernel.segment_merge_kernel


@functools.cache
def _request_kernel() -> Any:
    from service.engine import _request_kernel

    return _request_kernel.request_partials_kernel


@dataclass(frozen=True)
class Launch:
    """One partials launch: tiles [T, TILE_COLUMNS] int64 and the query items a tile holds."""

    tiles: torch.Tensor
    block_m: int


@dataclass(frozen=True)
class PlanCapacity:
    """Fixed sizes of the plans one CUDA graph replays: each step's plan is padded to them (dead rows, entries,
    pairs and tiles do nothing; a dead row's output is zero) and copied into the captured plan's tensors."""

    rows: int
    entries: int
    pairs: int
    chunk_tiles: int  # per tile width (16, 32, ... MAX_BLOCK_M query items); by request: of REQUEST_BLOCK_M
    tail_tiles: int  # per tile width
    segments: int = 0  # by request: the segment table's rows


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
        request the splits of each request's chunk list (None: enough for about _TARGET_PROGRAMS programs);
        `capacity`: padded to these sizes (ValueError when the batch does not fit)."""
        arrays = batch if isinstance(batch, SegmentArrays) else batch.arrays()
        host = _HostPlan(arrays, group)
        if by_request:
            host.add_requests(pieces, kv_heads)
        else:
            host.add_chunks(pieces, kv_heads)
        host.add_tails()
        row_parts, row_ptr = host.row_parts()
        if capacity is not None:
            host.pad(capacity, by_request)
            row_ptr = _padded(row_ptr, capacity.rows + 1, int(row_ptr[-1]))
            row_parts = _padded(row_parts, capacity.pairs)
        if row_parts.size == 0:
            row_parts = np.zeros(1, dtype=np.int64)
        chunk_widths, tail_widths = sorted(host.chunk_tiles), sorted(host.tail_tiles)
        segments = host.segments.reshape(-1) if host.segments.size else np.zeros(2, dtype=np.int64)
        parts = [host.q_rows, host.q_positions, host.pair_q, host.pair_visible, row_ptr, row_parts, host.row_tail]
        parts += [segments]
        parts += [host.chunk_tiles[w].reshape(-1) for w in chunk_widths]
        parts += [host.tail_tiles[w].reshape(-1) for w in tail_widths]
        # One copy to the device for the whole plan; every field is a view of it.
        flat = _upload(np.concatenate(parts), device)
        views = list(torch.split(flat, [p.size for p in parts]))
        fixed, tiles = views[:8], views[8:]
        chunk_columns = REQUEST_COLUMNS if by_request else TILE_COLUMNS
        columns = [chunk_columns] * len(chunk_widths) + [TILE_COLUMNS] * len(tail_widths)
        widths = chunk_widths + tail_widths
        launches = [Launch(t.view(-1, c), w) for t, c, w in zip(tiles, columns, widths, strict=True)]
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
            pairs=host.pair_q.size,  # the capacity's, when padded: the partial buffers are sized by it
            reach=arrays.reach(),
            segments=fixed[7].view(-1, 2),
            by_request=by_request,
        )

    def copy_from(self, other: SegmentPlan) -> None:
        """Take `other`'s metadata into this plan's tensors in place (both padded to one capacity): a captured
        graph then replays `other`'s call."""
        mine, theirs = self._tensors(), other._tensors()
        if [t.shape for t in mine] != [t.shape for t in theirs] or self.by_request != other.by_request:
            raise ValueError("plans of different capacities")
        for dst, src in zip(mine, theirs, strict=True):
            dst.copy_(src, non_blocking=True)
        self.reach = other.reach

    def _tensors(self) -> list[torch.Tensor]:
        fixed = [self.q_rows, self.q_positions, self.pair_q, self.pair_visible, self.row_ptr, self.row_parts]
        fixed += [self.row_tail, self.segments]
        return [*fixed, *(launch.tiles for launch in (*self.chunks, *self.tails))]


class _HostPlan:
    """The plan's arrays, built on the host with array operations (a Python loop over every (row, segment) pair
    took milliseconds at a few hundred answers, on the critical path of every step): query entries, pairs, tiles
    and each row's partials. Order is part of the contract: entries by row then segment, chunks in the order
    they are first read, readers of a chunk in entry order, then one tail group per request in request order."""

    def __init__(self, batch: SegmentArrays, group: int) -> None:
        self.batch = batch
        self.group = group
        self.rows = batch.rows.size
        self.positions = batch.positions
        self.q_rows = np.zeros(0, dtype=np.int64)
        self.q_positions = np.zeros(0, dtype=np.int64)
        self.pair_q = np.zeros(0, dtype=np.int64)
        self.pair_visible = np.zeros(0, dtype=np.int64)
        self.pair_row = np.zeros(0, dtype=np.int64)  # the row each chunk pair is merged into
        self.row_tail = np.zeros(self.rows, dtype=np.int64)
        # Tiles by the query items they hold: a group of few readers is not padded to the widest group's block.
        self.chunk_tiles: dict[int, np.ndarray] = {}
        self.tail_tiles: dict[int, np.ndarray] = {}
        self.segments = np.zeros((0, 2), dtype=np.int64)  # by request: each segment's arena start and length

    def add_chunks(self, pieces: int | None, kv_heads: int) -> None:
        """A query entry per (row, segment), rotated to m - o + base; a group of pairs per chunk piece (`pieces`
        per chunk; None: `_auto_pieces`)."""
        batch = self.batch
        counts, seg_chunk, seg_offset = batch.seg_counts, batch.seg_chunk, batch.seg_offset
        ranges, rows = batch.chunks, batch.rows
        first_segment = np.concatenate(([0], np.cumsum(counts)[:-1]))[rows]  # each row's first segment
        entry_row = _expand(counts[rows])
        segment = first_segment[entry_row] + _within(counts[rows])
        chunk = seg_chunk[segment]
        self.q_rows = entry_row
        self.q_positions = self.positions[entry_row] - seg_offset[segment] + ranges[chunk, 2]
        if chunk.size == 0:
            return
        # Chunks in the order they are first read; each chunk's readers (entries) in entry order.
        ids, first_read = np.unique(chunk, return_index=True)
        ordered = ids[np.argsort(first_read)]
        rank = np.zeros(ranges.shape[0], dtype=np.int64)
        rank[ordered] = np.arange(ordered.size)
        readers_by_chunk = np.argsort(rank[chunk], kind="stable")
        readers = np.bincount(rank[chunk], minlength=ordered.size)
        if pieces is None:
            pieces = _auto_pieces(readers, ranges[ordered, 1], self.group, kv_heads)
        lengths = ranges[ordered, 1]
        cuts = np.maximum(1, np.minimum(pieces, lengths))  # pieces per chunk, none empty (`_cut`)
        group_chunk = _expand(cuts)
        piece = _within(cuts)
        whole = lengths[group_chunk]
        first = whole * piece // cuts[group_chunk]
        size = whole * (piece + 1) // cuts[group_chunk] - first
        group_readers = readers[group_chunk]
        pair_group = _expand(group_readers)
        reader_start = np.concatenate(([0], np.cumsum(readers)[:-1]))
        self.pair_q = readers_by_chunk[reader_start[group_chunk][pair_group] + _within(group_readers)]
        self.pair_visible = size[pair_group]
        self.pair_row = entry_row[self.pair_q]
        first_pair = np.concatenate(([0], np.cumsum(group_readers)[:-1]))
        starts = ranges[ordered, 0][group_chunk] + first
        self.chunk_tiles = self._tiles(starts, size, first_pair, group_readers)

    def add_requests(self, splits: int | None, kv_heads: int) -> None:
        """By request: the same query entries as `add_chunks` (by row then segment), and a group of pairs per
        (request, split of its segments), one pair per row; its tiles take REQUEST_BLOCK_M of the request's
        query items each (`splits` None: enough for about _TARGET_PROGRAMS programs)."""
        batch = self.batch
        counts, rows = batch.seg_counts, batch.rows
        if (np.diff(rows) < 0).any():
            raise ValueError("a by-request plan needs each request's rows together, in request order")
        first_segment = np.concatenate(([0], np.cumsum(counts)[:-1]))
        row_entries = counts[rows]
        entry_row = _expand(row_entries)
        segment = first_segment[rows][entry_row] + _within(row_entries)
        chunk = batch.seg_chunk[segment]
        self.q_rows = entry_row
        self.q_positions = self.positions[entry_row] - batch.seg_offset[segment] + batch.chunks[chunk, 2]
        self.segments = batch.chunks[batch.seg_chunk, :2]
        requests, row0, n_rows = np.unique(rows, return_index=True, return_counts=True)
        reading = counts[requests] > 0
        requests, row0, n_rows = requests[reading], row0[reading], n_rows[reading]
        if requests.size == 0:
            return
        segments = counts[requests]
        blocks = -(-n_rows * self.group // REQUEST_BLOCK_M)
        if splits is None:
            splits = auto_splits(int(blocks.sum()) * kv_heads, int(segments.max()))
        parts = np.minimum(max(1, splits), segments)
        group_request = _expand(parts)  # a group per (request, split), requests in order
        split = _within(parts)
        size = segments[group_request]
        lo, hi = size * split // parts[group_request], size * (split + 1) // parts[group_request]
        group_rows = n_rows[group_request]
        group_pair0 = np.concatenate(([0], np.cumsum(group_rows)[:-1]))
        entry_first = np.concatenate(([0], np.cumsum(row_entries)[:-1]))  # each row's first entry
        self.pair_row = row0[group_request][_expand(group_rows)] + _within(group_rows)
        self.pair_q = entry_first[self.pair_row]  # unread by the kernel; a valid entry all the same
        self.pair_visible = np.zeros(self.pair_row.size, dtype=np.int64)
        first_entry, first_seg = entry_first[row0][group_request], first_segment[requests][group_request]
        group_blocks = blocks[group_request]
        tile_group = _expand(group_blocks)
        by_group = [row0[group_request], group_rows, first_entry, size, first_seg, lo, hi]
        columns = [*(c[tile_group] for c in by_group), _within(group_blocks), group_pair0[tile_group]]
        self.chunk_tiles = {REQUEST_BLOCK_M: np.stack(columns, axis=1)}

    def add_tails(self) -> None:
        """A group per request: its rows, rotated to their own positions, each seeing its causal prefix."""
        batch = self.batch
        if self.rows == 0:
            return
        visible = batch.tail_visible()
        owner = batch.rows
        by_request = np.argsort(owner, kind="stable")  # rows grouped by request, in request then row order
        entries, pairs = self.q_rows.size, self.pair_q.size
        self.q_rows = np.concatenate((self.q_rows, by_request))
        self.q_positions = np.concatenate((self.q_positions, self.positions[by_request]))
        self.pair_q = np.concatenate((self.pair_q, entries + np.arange(self.rows)))
        self.pair_visible = np.concatenate((self.pair_visible, visible[by_request]))
        self.row_tail[by_request] = pairs + np.arange(self.rows)
        requests, first_row, rows_of = np.unique(owner[by_request], return_index=True, return_counts=True)
        seen = np.maximum.reduceat(visible[by_request], first_row)
        starts = batch.tail_start[requests]
        self.tail_tiles = self._tiles(starts, seen, pairs + first_row, rows_of)

    def _tiles(
        self, starts: np.ndarray, lengths: np.ndarray, first_pairs: np.ndarray, readers: np.ndarray
    ) -> dict[int, np.ndarray]:
        """Tile rows [start, length, first pair, pairs, block] per group of pairs, by the width (query items) of
        the blocks that cover each group's items; groups in order within a width."""
        items = readers * self.group
        width = _block_m(items)
        blocks = -(-items // width)
        tile_group = _expand(blocks)
        rows = np.stack(
            (starts[tile_group], lengths[tile_group], first_pairs[tile_group], readers[tile_group], _within(blocks)),
            axis=1,
        )
        tile_width = width[tile_group]
        return {int(w): rows[tile_width == w] for w in np.unique(tile_width)}

    def row_parts(self) -> tuple[np.ndarray, np.ndarray]:
        """Each row's chunk pairs, in pair order, flat, and the row pointer into them ([rows + 1])."""
        flat = np.argsort(self.pair_row, kind="stable")
        counts = np.bincount(self.pair_row, minlength=self.rows)
        return flat, np.concatenate(([0], np.cumsum(counts)))

    def pad(self, capacity: PlanCapacity, by_request: bool = False) -> None:
        """Pad every array to `capacity`, with a tile list of each width (dead tiles hold no pair or no row)."""
        sizes = {"rows": self.rows, "entries": self.q_rows.size, "pairs": self.pair_q.size}
        if by_request:
            sizes["segments"] = len(self.segments)
        for tiles, name in ((self.chunk_tiles, "chunk_tiles"), (self.tail_tiles, "tail_tiles")):
            sizes[name] = max((len(rows) for rows in tiles.values()), default=0)
        over = [f"{name} {n} > {getattr(capacity, name)}" for name, n in sizes.items() if n > getattr(capacity, name)]
        if over:
            raise ValueError(f"the batch exceeds the plan's capacity: {', '.join(over)}")
        self.row_tail = _padded(self.row_tail, capacity.rows, -1)
        self.q_rows = _padded(self.q_rows, capacity.entries)
        self.q_positions = _padded(self.q_positions, capacity.entries)
        self.pair_q = _padded(self.pair_q, capacity.pairs)
        self.pair_visible = _padded(self.pair_visible, capacity.pairs)
        self.rows = capacity.rows
        if by_request:
            self.segments = np.concatenate(
                (self.segments, np.zeros((capacity.segments - len(self.segments), 2), np.int64))
            )
        chunk_widths, chunk_columns = ([REQUEST_BLOCK_M], REQUEST_COLUMNS) if by_request else (_widths(), TILE_COLUMNS)
        _pad_tiles(self.chunk_tiles, capacity.chunk_tiles, chunk_widths, chunk_columns)
        _pad_tiles(self.tail_tiles, capacity.tail_tiles, _widths(), TILE_COLUMNS)


def _pad_tiles(tiles: dict[int, np.ndarray], count: int, widths: list[int], columns: int) -> None:
    """A list of `count` tile rows of each width in `widths`, `tiles`' own first (a dead tile is all zeros)."""
    for width in widths:
        rows = tiles.get(width, np.zeros((0, columns), dtype=np.int64))
        tiles[width] = np.concatenate((rows, np.zeros((count - len(rows), columns), dtype=np.int64)))


def _upload(flat: np.ndarray, device: torch.device) -> torch.Tensor:
    """`flat` on `device`. To CUDA through pinned memory, asynchronously: a copy from pageable memory waits for every
    kernel already queued, so each step's host work (this plan included) would wait for the previous step's
    kernels instead of running beside them. The caching host allocator keeps the pinned block until the copy
    has read it."""
    if device.type != "cuda":
        return torch.from_numpy(flat).to(device)
    return pinned_copy(flat).to(device, non_blocking=True)


def _expand(counts: np.ndarray) -> np.ndarray:
    """i repeated counts[i] times, for every i: [0, 0, 1, 2, 2, 2] for counts [2, 1, 3]."""
    return np.repeat(np.arange(counts.size, dtype=np.int64), counts)


def _within(counts: np.ndarray) -> np.ndarray:
    """0 .. counts[i] - 1 for every i, concatenated: [0, 1, 0, 0, 1, 2] for counts [2, 1, 3]."""
    starts = np.cumsum(counts) - counts
    within: np.ndarray = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(starts, counts)
    return within


def _padded(values: np.ndarray, size: int, fill: int = 0) -> np.ndarray:
    padded: np.ndarray = np.concatenate((values, np.full(size - values.size, fill, dtype=np.int64)))
    return padded


def _widths() -> list[int]:
    """Every tile width a plan may use."""
    return [1 << k for k in range(_MIN_BLOCK_M.bit_length() - 1, MAX_BLOCK_M.bit_length())]


def _block_m(items: np.ndarray) -> np.ndarray:
    """The tile width for groups of `items` query items: the next power of two, within _MIN_BLOCK_M..MAX_BLOCK_M."""
    power = np.left_shift(1, np.ceil(np.log2(np.maximum(items, 1))).astype(np.int64))
    width: np.ndarray = np.minimum(MAX_BLOCK_M, np.maximum(_MIN_BLOCK_M, power))
    return width


def auto_splits(programs: int, most_segments: int) -> int:
    """Splits of each request's chunk list so that `programs` (unsplit, all KV heads) reach about
    REQUEST_TARGET_PROGRAMS, at most one chunk a split."""
    return max(1, min(-(-REQUEST_TARGET_PROGRAMS // max(programs, 1)), most_segments))


def _auto_pieces(readers: np.ndarray, lengths: np.ndarray, group: int, kv_heads: int) -> int:
    """Pieces per chunk so that the chunk programs reach about _TARGET_PROGRAMS, no piece under _MIN_PIECE
    (`readers` and `lengths`: per chunk read)."""
    items = readers * group
    programs = kv_heads * int((-(-items // _block_m(items))).sum())
    return max(1, min(-(-_TARGET_PROGRAMS // programs), int(lengths.max()) // _MIN_PIECE))


class SegmentAttention:
    """One step's segment attention: the plan and its rotation tables, reused by every layer."""

    def __init__(self, plan: SegmentPlan, rotary: Rotary, context: ContextScaling | None = None) -> None:
        self.plan = plan
        self.context = context or ContextScaling()
        self._rotary = rotary
        cos, sin = rotary.cos_sin(plan.q_positions)  # [entries, D] fp32
        self._cos, self._sin = cos.contiguous(), sin.contiguous()

    def refresh(self) -> None:
        """Recompute the rotation tables in place after `plan.copy_from` (a captured graph reads these tensors)."""
        cos, sin = self._rotary.cos_sin(self.plan.q_positions)
        self._cos.copy_(cos)
        self._sin.copy_(sin)

    def __call__(self, q: torch.Tensor, arena: torch.Tensor, tail_kv: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention [N, Hq, D] of the unrotated queries q [N, Hq, D] over the arena's chunks and the pool's tails
        (both [2, Hkv, slots, D], q's dtype, unit stride on D), in q's dtype."""
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
        rotation = _Rotation(q, self._cos, self._sin, plan.q_rows)
        partials = (rotation, plan.pair_q, plan.pair_visible, part_out, part_lse, group)
        for launch in plan.chunks:
            if plan.by_request:
                chunk_scale = scale / self.context.temperature
                _run_request_partials(launch, arena, rotation, plan.segments, part_out, part_lse, group, chunk_scale)
            else:
                _run_partials(launch, arena, *partials, scale / self.context.temperature)
        for launch in plan.tails:
            _run_partials(launch, tail_kv, *partials, scale)
        return _run_merge(plan, part_out, part_lse, q.dtype, self.context.scale)


@dataclass(frozen=True)
class _Rotation:
    """What the kernel rotates queries from: q [N, Hq, D] unrotated, cos/sin [entries, D], each entry's row."""

    q: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    rows: torch.Tensor


def _run_partials(
    launch: Launch,
    kv: torch.Tensor,
    rotation: _Rotation,
    pair_q: torch.Tensor,
    pair_visible: torch.Tensor,
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    group: int,
    scale: float,
) -> None:
    if kv.stride(-1) != 1:
        raise ValueError("segment attention needs unit stride on the head dimension")
    if launch.tiles.shape[0] == 0:
        return
    q = rotation.q
    dim = q.shape[-1]
    grid = (launch.tiles.shape[0], kv.shape[1])
    _kernels()[0][grid](
        q,
        rotation.cos,
        rotation.sin,
        kv,
        launch.tiles,
        rotation.rows,
        pair_q,
        pair_visible,
        part_out,
        part_lse,
        q.stride(0),
        q.stride(1),
        rotation.cos.stride(0),
        kv.stride(0),
        kv.stride(1),
        kv.stride(2),
        part_out.stride(0),
        part_out.stride(1),
        part_lse.stride(0),
        scale * LOG2E,
        group=group,
        head_dim=dim,
        dim_p2=next_power_of_2(dim),
        block_m=launch.block_m,
        block_n=BLOCK_N,
        ieee=kv.dtype == torch.float32,
        num_warps=_warps(launch.block_m),
        **({} if NUM_STAGES is None else {"num_stages": NUM_STAGES}),
    )


def _run_request_partials(
    launch: Launch,
    kv: torch.Tensor,
    rotation: _Rotation,
    segments: torch.Tensor,
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    group: int,
    scale: float,
) -> None:
    if kv.stride(-1) != 1:
        raise ValueError("segment attention needs unit stride on the head dimension")
    if launch.tiles.shape[0] == 0:
        return
    q = rotation.q
    dim = q.shape[-1]
    _request_kernel()[(launch.tiles.shape[0], kv.shape[1])](
        q,
        rotation.cos,
        rotation.sin,
        kv,
        launch.tiles,
        segments,
        part_out,
        part_lse,
        q.stride(0),
        q.stride(1),
        rotation.cos.stride(0),
        kv.stride(0),
        kv.stride(1),
        kv.stride(2),
        part_out.stride(0),
        part_out.stride(1),
        part_lse.stride(0),
        scale * LOG2E,
        group=group,
        head_dim=dim,
        dim_p2=next_power_of_2(dim),
        block_m=launch.block_m,
        block_n=BLOCK_N,
        ieee=kv.dtype == torch.float32,
        num_warps=REQUEST_WARPS,
        **({} if REQUEST_STAGES is None else {"num_stages": REQUEST_STAGES}),
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
