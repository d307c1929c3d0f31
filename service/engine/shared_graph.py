"""The shared-chunk decode step captured in CUDA graphs: one per (batch bucket, reads bucket).

Eager, a shared step costs the host its ~1,500 kernel launches plus a Triton launch per tile width and layer,
whatever the batch (docs/benchmarks.md §13.1: ~15 ms at one answer where the kernels need a few). A graph
replays them in one call. It fixes shapes, so the step's segment plan is padded to a `PlanCapacity` sized by the
bucket: `batch` rows reading at most `reads` chunks each, every chunk cut into `pieces` (fixed per bucket, since
the cut changes the plan's shape); each step's plan is built on the host as in the eager step and copied from
there into the captured plan's tensors (`SegmentPlan.load`, one copy), the queries' rotation tables recomputed
inside the graph from them. Dead rows, entries, pairs and tiles of the padding do nothing; a dead row's output is zero.

The step's ids, positions, slab starts, live lengths and feed sources come in one static tensor filled by one
pinned copy per replay, as `batch_graph.BatchGraph` does; padding rows feed token 0 at position 0 into a
one-slot scratch slab the graphs own, so no request's slab is touched.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from service.engine.batch_decode import StepFeed
from service.engine.batch_graph import StepInputs
from service.engine.cuda_graph import _capture
from service.engine.segment_attention import SegmentArrays
from service.engine.segment_launch import HostLayout, SegmentAttention, SegmentPlan, host_layout
from service.engine.segment_plan import PlanCapacity
from service.engine.shared_decode import SharedDecoder

log = logging.getLogger(__name__)

# Rows per captured step: powers of two to 32, then coarser (the step's cost grows slowly with the batch). A bucket's
# plan is padded to its worst case (every row reading its own chunks); since a padded launch holds a bounded number
# of programs that loop over the live tiles (`segment_launch.PADDED_PROGRAMS`), the idle tiles of 192 and 256 rows
# cost less than the thousands of launches an eager step of that size makes the engine thread issue.
SHARED_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)
MIN_READS_BUCKET = 4


def reads_bucket(reads: int) -> int:
    """The captured reads-per-row capacity holding `reads` chunks: the next power of two, at least 4."""
    return max(MIN_READS_BUCKET, 1 << max(reads - 1, 0).bit_length())


def pieces_for(batch: int) -> int:
    """Pieces each chunk is cut into in a bucket of `batch` rows: few rows need the cut to fill the GPU (the eager
    plan chooses it per step; a graph's plan cannot change shape)."""
    return 4 if batch <= 2 else 2 if batch <= 8 else 1


def capacity_for(batch: int, reads: int, pieces: int) -> PlanCapacity:
    """The plan sizes of a bucket: every row reading `reads` chunks cut into `pieces` (a query entry per row and
    chunk, and one per row for its tail), each (entry, piece) at most one tile of each width (a group of r readers
    needs ceil(group x r / width) <= r tiles: width >= 16 > group)."""
    reading = batch * reads
    return PlanCapacity(
        rows=batch,
        entries=reading + batch,
        pairs=reading * pieces + batch,
        chunk_tiles=reading * pieces,
        tail_tiles=batch,
    )


class _StaticAttend:
    """The captured step's attention: the static plan's kernels over the arena's layer and the pool's tails."""

    def __init__(self, attention: SegmentAttention, arena: torch.Tensor) -> None:
        self._attention = attention
        self._arena = arena

    def attend_layer(self, layer: int, q: torch.Tensor, kv: torch.Tensor, scale: float) -> torch.Tensor:
        return self._attention(q, self._arena[layer], kv, scale)


class CapturedPlan:
    """The segment plan a graph captures, padded to `capacity` with every chunk cut into `pieces`: each replay's
    plan is built on the host padded alike (`build`, ValueError over capacity) and copied into it (`load`). Shared
    by the decode step's graphs and the question prefill's (`shared_extend_graph.py`)."""

    def __init__(
        self,
        shared: SharedDecoder,
        capacity: PlanCapacity,
        pieces: int,
        idle: SegmentArrays,
        by_request: bool = False,
    ) -> None:
        spec = shared.decoder.forward.spec
        self.capacity, self.pieces, self.by_request = capacity, pieces, by_request
        self._group, self._kv_heads, self._device = spec.num_heads // spec.num_kv_heads, spec.num_kv_heads, spec.device
        self._shared = shared
        self.plan = SegmentPlan.upload(self.build(idle), self._device)

    def build(self, call: SegmentArrays) -> HostLayout:
        """`call`'s plan on the host, padded to the capacity (ValueError when it does not fit)."""
        return host_layout(call, self._group, self._kv_heads, self.pieces, self.capacity, self.by_request)

    def load(self, layout: HostLayout) -> None:
        """Queue `layout`'s metadata into the captured plan's tensors (stream order: after the last replay)."""
        with torch.inference_mode():
            self.plan.load(layout)

    def attend(self) -> _StaticAttend:
        """The attention over the captured plan (built inside the capture: the rotation tables are recomputed from
        the plan's positions at each replay)."""
        shared = self._shared
        attention = SegmentAttention(self.plan, shared.decoder.forward.rotary, shared.context)
        return _StaticAttend(attention, shared.arena.data)


class SharedStepGraph:
    """One captured shared decode step for up to `batch` rows reading up to `reads` chunks each."""

    def __init__(
        self, shared: SharedDecoder, batch: int, reads: int, scratch: int, pool: Any, feed: torch.Tensor
    ) -> None:
        forward = shared.decoder.forward
        spec = forward.spec
        self.batch, self.reads, self.pieces = batch, reads, pieces_for(batch)
        self.capacity = capacity_for(batch, reads, self.pieces)
        self._plan = CapturedPlan(shared, self.capacity, self.pieces, idle_step_call(batch, scratch))
        self._inputs = StepInputs(batch, scratch, spec.device)
        pool_data = shared.decoder.pool.data

        def step() -> torch.Tensor:
            rows = self._inputs.rows(feed)
            hidden = forward.embed_static(rows.ids.view(1, -1))
            layers = (0, len(forward.layers))
            hidden = forward.layers_static(pool_data, hidden, rows.positions, rows.slots, self._plan.attend(), layers)
            return forward.head_rows(hidden)

        self._graph = torch.cuda.CUDAGraph()
        start = time.perf_counter()
        self._logits: torch.Tensor = _capture(self._graph, step, spec.device, pool)
        self.capture_ms = (time.perf_counter() - start) * 1e3

    @property
    def plan(self) -> SegmentPlan:
        return self._plan.plan

    def fits(self, rows: int, reads: int) -> bool:
        return rows <= self.batch and reads <= self.reads

    def replay(
        self,
        ids: Sequence[int],
        positions: Sequence[int],
        spans: Sequence[tuple[int, int]],
        call: SegmentArrays,
        src: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """The step of len(ids) rows whose segment metadata is `call`; fp32 logits [len(ids), vocab], static (read
        before the next replay). ValueError when the call does not fit the capacity (nothing replayed)."""
        if not 0 < len(ids) <= self.batch:
            raise ValueError(f"{len(ids)} rows do not fit a graph of {self.batch}")
        plan = self._plan.build(call)
        self._inputs.fill(ids, positions, spans, src)
        self._plan.load(plan)
        self._graph.replay()
        return self._logits[: len(ids)]


def stage_feed(buffer: torch.Tensor, feed: StepFeed | None) -> tuple[bool, Sequence[int] | None]:
    """Copy a step's unread picks into the `buffer` its graphs read them from; whether they fit (else the step
    runs eagerly), and each row's index in the buffer (None: no row is fed from the device)."""
    if feed is None:
        return True, None
    picks = feed.picks.numel()
    if picks > buffer.numel():
        return False, None
    with torch.inference_mode():
        buffer[:picks].copy_(feed.picks)  # stream order: after the last replay read it
    return True, feed.src


def idle_step_call(batch: int, scratch: int) -> SegmentArrays:
    """A call of `batch` rows reading no chunk, each its one scratch slot: the plan the graph is captured over."""
    empty = np.zeros(0, dtype=np.int64)
    return SegmentArrays(
        chunks=np.zeros((0, 3), dtype=np.int64),
        seg_counts=np.zeros(batch, dtype=np.int64),
        seg_chunk=empty,
        seg_offset=empty,
        tail_start=np.full(batch, scratch, dtype=np.int64),
        tail_used=np.ones(batch, dtype=np.int64),
        rows=np.arange(batch, dtype=np.int64),
        positions=np.zeros(batch, dtype=np.int64),
    )


class SharedStepGraphs:
    """Shared decode-step graphs by (batch bucket, reads bucket), captured on first use."""

    def __init__(self, shared: SharedDecoder, max_picks: int) -> None:
        spec = shared.decoder.forward.spec
        if spec.device.type != "cuda" or not shared.kernels:
            raise ValueError("shared-step graphs need the segment kernels on a CUDA device")
        self.shared = shared
        self._scratch = shared.decoder.pool.allocate(1)
        self._pool = torch.cuda.graph_pool_handle()
        self._graphs: dict[tuple[int, int], SharedStepGraph] = {}
        self._feed = torch.zeros(max(max_picks, max(SHARED_BUCKETS)), dtype=torch.long, device=spec.device)

    @property
    def feed(self) -> torch.Tensor:
        """Where a step's unread picks are copied for its graph to read (the mixed steps' graphs read it too)."""
        return self._feed

    @property
    def scratch_slot(self) -> int:
        """The pool slot padding rows write (the mixed steps' graphs pad their decode rows there too)."""
        return self._scratch.start

    def step(
        self,
        ids: Sequence[int],
        positions: Sequence[int],
        spans: Sequence[tuple[int, int]],
        call: SegmentArrays,
        feed: StepFeed | None = None,
    ) -> torch.Tensor | None:
        """The step through its bucket's graph; None when no bucket holds it (the caller runs it eagerly)."""
        batch = next((b for b in SHARED_BUCKETS if b >= len(ids)), None)
        reads = int(call.seg_counts.max()) if call.seg_counts.size else 0
        if batch is None or call.rows.size != len(ids):
            return None
        graph = self._graph(batch, reads_bucket(reads))
        staged, src = stage_feed(self._feed, feed)
        if not staged:
            return None
        try:
            return graph.replay(ids, positions, spans, call, src)
        except ValueError:  # a plan over the bucket's capacity: eager, this once
            return None

    def _graph(self, batch: int, reads: int) -> SharedStepGraph:
        graph = self._graphs.get((batch, reads))
        if graph is None:
            graph = SharedStepGraph(self.shared, batch, reads, self._scratch.start, self._pool, self._feed)
            self._graphs[(batch, reads)] = graph
            log.info("captured the shared decode step: %d rows, %d reads, in %.0f ms", batch, reads, graph.capture_ms)
        return graph

    def warm(self, reads: int, max_batch: int) -> None:
        """Capture every bucket up to `max_batch` rows for `reads` chunks a row now (server start)."""
        for batch in SHARED_BUCKETS:
            if batch > max_batch and batch != SHARED_BUCKETS[0]:
                break
            self._graph(batch, reads_bucket(reads))

    def close(self) -> None:
        self._graphs.clear()
        self.shared.decoder.pool.free(self._scratch)
