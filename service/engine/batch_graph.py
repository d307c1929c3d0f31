"""The batched decode step captured in CUDA graphs, one per (batch bucket, capacity bucket), over a `KVPool`.

Eager, a decode step costs the same ~1,500 kernel launches at batch 1 or 32 (cuda_graph.py); a graph replays
them with one call. A graph fixes shapes and pointers, so each is captured for a batch size from
`STEP_BUCKETS` (a step of B requests runs in the smallest bucket >= B, the rest padded) and for a capacity (the
longest live length a row may have: flash's max_seqlen_k, the gather's width; powers of two as `bucket_capacity`).
The step reads its ids, positions, slab starts and live lengths from one static device tensor, filled by one
pinned host-to-device copy per replay, and writes K/V straight into the pool (graphs capture the pool's tensor).
A row may instead take its id from the previous step's picks, still on the device (the overlapped step,
scheduler.py): the graphs read them from one static `feed` tensor, by the row index a fifth input row gives.

Padding rows feed token 0 at position 0 into a one-slot scratch slab the graphs own: they write and read only
that slot, so no request's slab is touched; their logits are dropped. Only the `flash_varlen` and `sdpa_gather`
attentions can be captured (the loop slices by host lengths).

`test_engine_batch.py`'s gpu-marked tests compare it with the eager step and, fed or not, with eager decoding.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from service.engine.batch_decode import LOOP, BatchDecoder, DecodeRows, StepFeed, fed_ids
from service.engine.cuda_graph import _capture, bucket_capacity
from service.engine.device_copy import copy_into

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)
# Decode rows per captured step, finer than powers of two from 8 on: flash-attention splits each row's keys over
# several thread blocks only while rows x KV heads stay under 80 % of the SMs, and it counts padding rows. 24
# answers (Qwen2-7B's 4 KV heads, 132 SMs) padded to 32 would run 128 blocks that each walk a whole context on
# one SM, so they would cost what 32 answers do.
STEP_BUCKETS = (1, 2, 4, 8, 12, 16, 20, 24, 28, 32)


def batch_bucket(batch: int, buckets: Sequence[int] = BATCH_BUCKETS) -> int | None:
    """The smallest captured batch size holding `batch` rows, or None when none does."""
    if batch <= 0:
        raise ValueError("a decode step needs at least one row")
    return next((b for b in sorted(buckets) if b >= batch), None)


class StepInputs:
    """A captured decode step's static inputs: [ids; positions; slab starts; live slots; feed row or -1] per row,
    padding rows feeding token 0 at position 0 into the one-slot `scratch` slab. Filled by one asynchronous copy
    per replay (`copy_into`)."""

    def __init__(self, batch: int, scratch: int, device: torch.device) -> None:
        self.batch = batch
        self._scratch = scratch
        self._device = torch.zeros((5, batch), dtype=torch.long, device=device)
        self.fill([0] * batch, [0] * batch, [(scratch, 1)] * batch, None)

    def rows(self, feed: torch.Tensor) -> DecodeRows:
        """The step's rows over the static inputs (built inside a capture), ids fed from `feed` where asked."""
        inputs = self._device
        return DecodeRows(fed_ids(inputs[0], inputs[4], feed), inputs[1], inputs[2], inputs[3], ())

    def fill(
        self,
        ids: Sequence[int],
        positions: Sequence[int],
        spans: Sequence[tuple[int, int]],
        src: Sequence[int] | None,
    ) -> None:
        pad = self.batch - len(ids)
        fed = list(src) if src is not None else [-1] * len(ids)
        rows = [list(ids), list(positions), [s for s, _ in spans], [u for _, u in spans], fed]
        padding = [0, 0, self._scratch, 1, -1]
        values = [row + [p] * pad for row, p in zip(rows, padding, strict=True)]
        copy_into(self._device, torch.tensor(values, dtype=torch.long))


class BatchGraph:
    """One captured batched step for `batch` rows of live lengths up to `capacity`."""

    def __init__(
        self, decoder: BatchDecoder, batch: int, capacity: int, scratch: int, pool: Any, feed: torch.Tensor
    ) -> None:
        device = decoder.forward.spec.device
        self.batch = batch
        self.capacity = capacity
        self._inputs = StepInputs(batch, scratch, device)

        def step() -> torch.Tensor:
            return decoder.step(self._inputs.rows(feed), capacity)

        self._graph = torch.cuda.CUDAGraph()
        start = time.perf_counter()
        self._logits: torch.Tensor = _capture(self._graph, step, device, pool)
        self.capture_ms = (time.perf_counter() - start) * 1e3

    def replay(
        self,
        ids: Sequence[int],
        positions: Sequence[int],
        spans: Sequence[tuple[int, int]],
        src: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """The step for len(ids) <= batch rows; fp32 logits [len(ids), vocab], static (read before the next).
        `src`: per row, its index in the feed tensor (the previous step's picks, copied there) or -1."""
        if not 0 < len(ids) <= self.batch or any(u > self.capacity for _, u in spans):
            raise ValueError(f"{len(ids)} rows do not fit a graph of {self.batch} rows up to {self.capacity} slots")
        self._inputs.fill(ids, positions, spans, src)
        self._graph.replay()
        return self._logits[: len(ids)]


class BatchGraphs:
    """Batched-step graphs by (batch bucket, capacity bucket), captured on first use, over one decoder's pool."""

    def __init__(self, decoder: BatchDecoder, max_picks: int = max(STEP_BUCKETS)) -> None:
        """`max_picks`: the most unread picks a step may be fed from (the size of `feed`)."""
        spec = decoder.forward.spec
        if spec.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        if decoder.attention == LOOP:
            raise ValueError("the loop attention slices by host lengths and cannot be captured")
        self.decoder = decoder
        self._scratch = decoder.pool.allocate(1)  # the padding rows' slot, held as long as the graphs live
        self._pool = torch.cuda.graph_pool_handle()
        self._graphs: dict[tuple[int, int], BatchGraph] = {}
        # The previous step's picks, for rows fed from them: one static tensor every graph reads.
        self._feed = torch.zeros(max(max_picks, *STEP_BUCKETS), dtype=torch.long, device=spec.device)

    def step(
        self,
        ids: Sequence[int],
        positions: Sequence[int],
        spans: Sequence[tuple[int, int]],
        feed: StepFeed | None = None,
    ) -> torch.Tensor:
        """The batched step through its bucket's graph, or eagerly for a batch larger than every bucket. `feed`:
        rows whose id is the previous step's pick, still on the device."""
        device = self.decoder.forward.spec.device
        bucket = batch_bucket(len(ids), STEP_BUCKETS)
        if bucket is None:
            return self.decoder.step(DecodeRows.build(ids, positions, spans, device, feed))
        capacity = bucket_capacity(max(u for _, u in spans), self.decoder.forward.spec.max_context)
        graph = self._graph(bucket, capacity)
        if feed is None:
            return graph.replay(ids, positions, spans)
        picks = feed.picks.numel()
        if picks > self._feed.numel():
            raise ValueError(f"{picks} picks do not fit the feed of {self._feed.numel()}")
        with torch.inference_mode():
            # Queued after the previous replay (which read the feed before) and before this one: stream order.
            self._feed[:picks].copy_(feed.picks)
        return graph.replay(ids, positions, spans, feed.src)

    def _graph(self, batch: int, capacity: int) -> BatchGraph:
        graph = self._graphs.get((batch, capacity))
        if graph is None:
            graph = BatchGraph(self.decoder, batch, capacity, self._scratch.start, self._pool, self._feed)
            self._graphs[(batch, capacity)] = graph
            log.info("captured the batch-%d decode step up to %d slots in %.0f ms", batch, capacity, graph.capture_ms)
        return graph

    def warm(self, tokens: int) -> None:
        """Capture every batch bucket's step for live lengths up to `tokens` now (server start), so the first
        answers of each batch size do not pay for the capture."""
        capacity = bucket_capacity(tokens, self.decoder.forward.spec.max_context)
        for bucket in STEP_BUCKETS:
            self._graph(bucket, capacity)

    def close(self) -> None:
        """Give the scratch slot back to the pool (the graphs must not replay afterwards)."""
        self._graphs.clear()
        self.decoder.pool.free(self._scratch)
