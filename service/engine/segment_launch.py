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

`SegmentPlan.build` runs on the host once per step (every layer reuses it); `SegmentAttention` holds the step's
rotation tables and runs one layer. For CUDA graphs a plan is padded to a `PlanCapacity` and each step's plan is
copied into the captured one (`copy_from`, then `SegmentAttention.refresh`).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from service.engine.fused_stitch import triton_available
from service.engine.rotary import Rotary
from service.engine.segment_attention import ContextScaling, SegmentBatch

# A tile row: arena start and length of its key range, its group's first pair and pair count, its query block.
TILE_COLUMNS = 5
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
_MIN_PIECE = 128
_MERGE_HEADS = 8
_LOG2E = 1.4426950408889634


def segment_kernels_apply(device: torch.device, interpreter: bool = False) -> bool:
    """Whether the kernels run for tensors on `device`: CUDA with triton. `interpreter` (tests only, with
    TRITON_INTERPRET=1 set before triton imports) lets CPU tensors through Triton's interpreter."""
    if not triton_available():
        return False
    return device.type == "cuda" or (interpreter and device.type == "cpu")


@functools.cache
def _kernels() -> tuple[Any, Any]:
    from service.engine import _segment_kernel

    return _segment_kernel.segment_partials_kernel, _segment_kernel.segment_merge_kernel


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
    chunk_tiles: int  # per tile width (16, 32, ... MAX_BLOCK_M query items)
    tail_tiles: int  # per tile width


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

    @classmethod
    def build(
        cls,
        batch: SegmentBatch,
        group: int,
        kv_heads: int,
        device: torch.device,
        pieces: int | None = None,
        capacity: PlanCapacity | None = None,
    ) -> SegmentPlan:
        """The plan of `batch` for `group` query heads per KV head; `pieces`: ranges each chunk is cut into
        (None: enough for about _TARGET_PROGRAMS programs); `capacity`: padded to these sizes (ValueError when
        the batch does not fit)."""
        host = _HostPlan(batch, group)
        host.add_chunks(pieces if pieces is not None else _auto_pieces(batch, group, kv_heads))
        host.add_tails()
        if capacity is not None:
            host.pad(capacity)
        tensor = functools.partial(torch.tensor, dtype=torch.int64)
        flat = [i for parts in host.row_parts for i in parts]
        row_ptr = [0]
        for parts in host.row_parts:
            row_ptr.append(row_ptr[-1] + len(parts))
        if capacity is not None:
            flat += [0] * (capacity.pairs - len(flat))
        return cls(
            q_rows=tensor(host.q_rows).to(device),
            q_positions=tensor(host.q_positions).to(device),
            pair_q=tensor(host.pair_q).to(device),
            pair_visible=tensor(host.pair_visible).to(device),
            chunks=_launches(host.chunk_tiles, device),
            tails=_launches(host.tail_tiles, device),
            row_ptr=tensor(row_ptr).to(device),
            row_parts=tensor(flat or [0]).to(device),
            row_tail=tensor(host.row_tail).to(device),
            pairs=len(host.pair_q),
            reach=batch.reach(),
        )

    def copy_from(self, other: SegmentPlan) -> None:
        """Take `other`'s metadata into this plan's tensors in place (both padded to one capacity): a captured
        graph then replays `other`'s call."""
        mine, theirs = self._tensors(), other._tensors()
        if [t.shape for t in mine] != [t.shape for t in theirs]:
            raise ValueError("plans of different capacities")
        for dst, src in zip(mine, theirs, strict=True):
            dst.copy_(src, non_blocking=True)
        self.reach = other.reach

    def _tensors(self) -> list[torch.Tensor]:
        fixed = [self.q_rows, self.q_positions, self.pair_q, self.pair_visible, self.row_ptr, self.row_parts]
        return [*fixed, self.row_tail, *(launch.tiles for launch in (*self.chunks, *self.tails))]


class _HostPlan:
    """The plan's lists, built on the host: query entries, pairs, tiles and each row's partials."""

    def __init__(self, batch: SegmentBatch, group: int) -> None:
        self.batch = batch
        self.group = group
        self.q_rows: list[int] = []
        self.q_positions: list[int] = []
        self.pair_q: list[int] = []
        self.pair_visible: list[int] = []
        self.row_parts: list[list[int]] = [[] for _ in batch.rows]
        self.row_tail: list[int] = [0] * len(batch.rows)
        # Tiles by the query items they hold: a group of few readers is not padded to the widest group's block.
        self.chunk_tiles: dict[int, list[list[int]]] = {}
        self.tail_tiles: dict[int, list[list[int]]] = {}

    def pad(self, capacity: PlanCapacity) -> None:
        """Pad every list to `capacity`, with a tile list of each width (dead tiles hold no pair)."""
        sizes = {"rows": len(self.row_tail), "entries": len(self.q_rows), "pairs": len(self.pair_q)}
        for tiles, name in ((self.chunk_tiles, "chunk_tiles"), (self.tail_tiles, "tail_tiles")):
            sizes[name] = max((len(rows) for rows in tiles.values()), default=0)
        over = [f"{name} {n} > {getattr(capacity, name)}" for name, n in sizes.items() if n > getattr(capacity, name)]
        if over:
            raise ValueError(f"the batch exceeds the plan's capacity: {', '.join(over)}")
        self.row_parts += [[] for _ in range(capacity.rows - len(self.row_parts))]
        self.row_tail += [-1] * (capacity.rows - len(self.row_tail))
        self.q_rows += [0] * (capacity.entries - len(self.q_rows))
        self.q_positions += [0] * (capacity.entries - len(self.q_positions))
        self.pair_q += [0] * (capacity.pairs - len(self.pair_q))
        self.pair_visible += [0] * (capacity.pairs - len(self.pair_visible))
        for tiles, count in ((self.chunk_tiles, capacity.chunk_tiles), (self.tail_tiles, capacity.tail_tiles)):
            for width in _widths():
                rows = tiles.setdefault(width, [])
                rows += [[0] * TILE_COLUMNS for _ in range(count - len(rows))]

    def _entry(self, row: int, position: int) -> int:
        self.q_rows.append(row)
        self.q_positions.append(position)
        return len(self.q_rows) - 1

    def add_chunks(self, pieces: int) -> None:
        """A query entry per (row, segment), rotated to m - o + base; a group of pairs per chunk piece."""
        batch = self.batch
        readers: dict[int, list[tuple[int, int]]] = {}
        for row, request in enumerate(batch.rows):
            for segment in batch.requests[request].segments:
                chunk = batch.chunks[segment.chunk]
                entry = self._entry(row, batch.positions[row] - segment.offset + chunk.base)
                readers.setdefault(segment.chunk, []).append((entry, row))
        for chunk_id, group in readers.items():
            chunk = batch.chunks[chunk_id]
            for first, length in _cut(chunk.length, pieces):
                self._add_group(self.chunk_tiles, chunk.start + first, length, group, None)

    def add_tails(self) -> None:
        """A group per request: its rows, rotated to their own positions, each seeing its causal prefix."""
        batch = self.batch
        visible = batch.tail_visible()
        rows_of: list[list[int]] = [[] for _ in batch.requests]
        for row, owner in enumerate(batch.rows):
            rows_of[owner].append(row)
        for request, rows in zip(batch.requests, rows_of, strict=True):
            if rows:
                group = [(self._entry(row, batch.positions[row]), row) for row in rows]
                seen = [visible[row] for row in rows]
                self._add_group(self.tail_tiles, request.tail.start, max(seen), group, seen)

    def _add_group(
        self,
        tiles: dict[int, list[list[int]]],
        start: int,
        length: int,
        readers: Sequence[tuple[int, int]],
        seen: Sequence[int] | None,
    ) -> None:
        """Pairs of `readers` (entry, row) over keys start .. start + length (row i sees seen[i] of them, or all;
        `seen` given means these are tail pairs), and the tiles that cover their query items."""
        first = len(self.pair_q)
        for i, (entry, row) in enumerate(readers):
            self.pair_q.append(entry)
            self.pair_visible.append(length if seen is None else seen[i])
            if seen is None:
                self.row_parts[row].append(first + i)
            else:
                self.row_tail[row] = first + i
        items = len(readers) * self.group
        block_m = _block_m(items)
        for block in range(-(-items // block_m)):
            tiles.setdefault(block_m, []).append([start, length, first, len(readers), block])


def _widths() -> list[int]:
    """Every tile width a plan may use."""
    return [1 << k for k in range(_MIN_BLOCK_M.bit_length() - 1, MAX_BLOCK_M.bit_length())]


def _block_m(items: int) -> int:
    return min(MAX_BLOCK_M, max(_MIN_BLOCK_M, 1 << max(items - 1, 0).bit_length()))


def _cut(length: int, pieces: int) -> list[tuple[int, int]]:
    """(first, length) of `pieces` near-equal ranges of a chunk (fewer for a short chunk; none empty)."""
    n = max(1, min(pieces, length))
    edges = [length * i // n for i in range(n + 1)]
    return [(a, b - a) for a, b in itertools.pairwise(edges) if b > a]


def _auto_pieces(batch: SegmentBatch, group: int, kv_heads: int) -> int:
    """Pieces per chunk so that the chunk programs reach about _TARGET_PROGRAMS, no piece under _MIN_PIECE."""
    readers: dict[int, int] = {}
    for request in batch.rows:
        for segment in batch.requests[request].segments:
            readers[segment.chunk] = readers.get(segment.chunk, 0) + 1
    if not readers:
        return 1
    programs = kv_heads * sum(-(-n * group // _block_m(n * group)) for n in readers.values())
    longest = max(batch.chunks[c].length for c in readers)
    return max(1, min(-(-_TARGET_PROGRAMS // programs), longest // _MIN_PIECE))


def _launches(tiles: dict[int, list[list[int]]], device: torch.device) -> tuple[Launch, ...]:
    return tuple(
        Launch(torch.tensor(rows, dtype=torch.int64).view(-1, TILE_COLUMNS).to(device), block_m)
        for block_m, rows in sorted(tiles.items())
    )


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
        scale * _LOG2E,
        group=group,
        head_dim=dim,
        dim_p2=_p2(dim),
        block_m=launch.block_m,
        block_n=BLOCK_N,
        ieee=kv.dtype == torch.float32,
        num_warps=_warps(launch.block_m),
        **({} if NUM_STAGES is None else {"num_stages": NUM_STAGES}),
    )


def _run_merge(
    plan: SegmentPlan, part_out: torch.Tensor, part_lse: torch.Tensor, dtype: torch.dtype, context_scale: float
) -> torch.Tensor:
    rows = plan.row_tail.shape[0]
    heads, dim = part_out.shape[1], part_out.shape[2]
    out = torch.empty((rows, heads, dim), dtype=dtype, device=part_out.device)
    block_h = min(_MERGE_HEADS, _p2(heads))
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
        dim_p2=_p2(dim),
        block_h=block_h,
        num_warps=4,
    )
    return out


def _warps(block_m: int) -> int:
    """Warps a partials program runs with: below 8 the wider tiles spill registers (ptxas, sm_90, head_dim 128)."""
    return 4 if block_m <= 16 else 8


def _p2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()
