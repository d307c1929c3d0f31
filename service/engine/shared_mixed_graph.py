"""Shared questions riding in a decode step (`SharedDecoder.mixed`), captured in CUDA graphs.

Eager, a mixed forward costs the host two segment plans' launches per layer on top of the step's ~1,500 kernel
launches: under load, with a question or two arriving at nearly every step, the host became the bottleneck and
the running answers' steps slower than a graphed step plus a graphed prefill apart. A graph replays it in one call.

It joins the two captured shapes the shared path already has: the decode part is `shared_graph`'s (its rows'
static inputs with the feed of unread picks, its by-chunk plan padded to `capacity_for`), the question part is
`shared_extend_graph`'s (`ExtendInputs`, its by-request plan padded to `request_capacity`, the tokens up to the
bucket taken by a padding request in a scratch slab). The two parts' tokens go through one forward, each part's
queries through its own plan (`SplitAttend`).

Buckets: the decode step's rows (`SHARED_BUCKETS`) x reads per row (`reads_bucket`, over both parts) x the
riders (`RIDER_BUCKETS`: up to 16 questions of T tokens in all). A step whose riders fit no bucket does not take
them (`fits`): they are prefilled apart through the prefill's own graphs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from service.engine import shared_decode
from service.engine.batch_decode import StepFeed
from service.engine.batch_graph import StepInputs
from service.engine.cuda_graph import _capture
from service.engine.extend_graph import ExtendInputs, ExtendRequest, buckets_for
from service.engine.segment_attention import SegmentArrays
from service.engine.shared_decode import Reads, SharedDecoder, SplitAttend, side_stream
from service.engine.shared_extend_graph import extend_splits, idle_extend, padded_extend, request_capacity
from service.engine.shared_graph import (
    SHARED_BUCKETS,
    CapturedPlan,
    capacity_for,
    idle_step_call,
    pieces_for,
    reads_bucket,
    stage_feed,
)

log = logging.getLogger(__name__)

# (questions, question tokens in all) a mixed step is captured for. Under load the questions arrive in waves (a
# cohort of answers ends, its clients ask again), several per step, and a question with the template's is ~70-250
# tokens. A wave no bucket holds would be prefilled apart, stalling every running answer for a forward of its own,
# so the planner holds the rest of a wave back for the next step (`Planner.admit`): the largest bucket bounds how
# many questions enter a step while answers run. Sixteen rows cost a graph little (dead tiles are skipped). A replay
# computes its whole token bucket, and every running answer waits for it: a padding token costs what a question
# token does (~25 µs of a 7B model's GEMMs on an H200 at a mixed step's size), so ~200 tokens of padding add ~5 ms
# to a step. Hence token buckets 64 apart up to 768 (waves of up to ~10 questions: 128 clients' waves), 128 apart
# to 1,280 and 256 apart to 2,048: a bucket pads at most 255 tokens, at most 127 below 1,280. Each bucket is one
# more graph per decode-row bucket captured at start (~0.1 s each).
RIDER_TOKENS = (*range(64, 769, 64), 896, 1024, 1152, 1280, 1536, 1792, 2048)
RIDER_BUCKETS = tuple((16, tokens) for tokens in RIDER_TOKENS)


def held_reads(held: Sequence[int], reads: int) -> int:
    """The reads bucket a step reading up to `reads` (a bucket) replays: the smallest captured one (`held`) that
    holds it, else its own (to be captured). A graph for more reads serves fewer: its plan is padded to its
    capacity and its dead tiles are skipped."""
    return min((r for r in held if r >= reads), default=reads)


def rider_bucket(
    questions: int, tokens: int, buckets: Sequence[tuple[int, int]] = RIDER_BUCKETS
) -> tuple[int, int] | None:
    """The smallest of `buckets` holding `questions` questions of `tokens` tokens in all, or None."""
    return next(((q, t) for q, t in buckets if questions <= q and tokens <= t), None)


class SharedMixedGraph:
    """One captured mixed step: up to `batch` decode rows and `riders` = (questions, tokens), every request
    reading up to `reads` chunks."""

    def __init__(
        self,
        shared: SharedDecoder,
        batch: int,
        reads: int,
        riders: tuple[int, int],
        scratch: tuple[int, int],
        pool: Any,
        buffers: tuple[torch.Tensor, torch.Tensor],
    ) -> None:
        """`scratch`: the decode padding rows' one slot and the question padding's slab start; `buffers`: the
        feed of unread picks (shared with the decode step's graphs) and where the logits land."""
        spec = shared.decoder.forward.spec
        group, kv_heads = spec.num_heads // spec.num_kv_heads, spec.num_kv_heads
        questions, tokens = riders
        self.batch, self.reads, self.riders, self._scratch = batch, reads, riders, scratch
        feed, out = buffers
        pieces = pieces_for(batch)
        self._step_inputs = StepInputs(batch, scratch[0], spec.device)
        self._step_plan = CapturedPlan(
            shared, capacity_for(batch, reads, pieces), pieces, idle_step_call(batch, scratch[0])
        )
        splits = extend_splits(tokens, reads, group, kv_heads)
        capacity = request_capacity(questions, tokens, reads, splits, group)
        idle = idle_extend(questions, tokens, scratch[1])
        self._question_inputs = ExtendInputs(questions, tokens, scratch[1], spec.device)
        self._question_plan = CapturedPlan(shared, capacity, splits, idle, by_request=True)

        def mixed() -> torch.Tensor:
            side = side_stream(out.device) if shared_decode.CONCURRENT_SPLIT else None
            attend = SplitAttend(self._step_plan.attend(), self._question_plan.attend(), batch, side)
            rows, static = self._step_inputs.rows(feed), self._question_inputs.static_rows()
            logits = out[: batch + questions]
            logits.copy_(shared.mixed_forward(rows, static, attend, questions))
            return logits

        self._graph = torch.cuda.CUDAGraph()
        start = time.perf_counter()
        self._logits: torch.Tensor = _capture(self._graph, mixed, spec.device, pool)
        self.capture_ms = (time.perf_counter() - start) * 1e3

    def replay(
        self,
        decode: tuple[Sequence[int], Sequence[int], Sequence[tuple[int, int]]],
        step_call: SegmentArrays,
        src: Sequence[int] | None,
        questions: Sequence[ExtendRequest],
        reads: Sequence[Reads],
    ) -> torch.Tensor:
        """fp32 logits [B + Q, vocab]: the B decode rows' (`decode`: ids, positions, spans; `src`: each row's
        index in the feed or -1), then each question's last token's; static (read before the next replay).
        ValueError when either part does not fit (nothing replayed)."""
        ids, positions, spans = decode
        if not 0 < len(ids) <= self.batch:
            raise ValueError(f"{len(ids)} rows do not fit a mixed graph of {self.batch}")
        step_plan = self._step_plan.build(step_call)
        flat, question_call = padded_extend(questions, reads, self.riders[0], self.riders[1], self._scratch[1])
        question_plan = self._question_plan.build(question_call)
        self._step_inputs.fill(ids, positions, spans, src)
        self._question_inputs.load(flat)
        self._step_plan.load(step_plan)
        self._question_plan.load(question_plan)
        self._graph.replay()
        batch = len(ids)
        return torch.cat((self._logits[:batch], self._logits[self.batch : self.batch + len(questions)]))


class SharedMixedGraphs:
    """Mixed-step graphs by (decode bucket, reads bucket, rider bucket), captured on first use or by `warm`. The
    feed of unread picks and the decode rows' padding slot are the decode step graphs' (`SharedStepGraphs`)."""

    @staticmethod
    def riders_for(pool_slots: int) -> tuple[tuple[int, int], ...]:
        """The rider buckets a pool of `pool_slots` can spare the padding slab of (as the prefill's graphs,
        `buckets_for`); none: no mixed graphs, every question prefilled apart."""
        spared = set(buckets_for(pool_slots, [tokens for _, tokens in RIDER_BUCKETS]))
        return tuple(bucket for bucket in RIDER_BUCKETS if bucket[1] in spared)

    def __init__(self, shared: SharedDecoder, feed: torch.Tensor, step_scratch: int) -> None:
        spec = shared.decoder.forward.spec
        if spec.device.type != "cuda" or not shared.kernels:
            raise ValueError("mixed-step graphs need the segment kernels on a CUDA device")
        self.riders = self.riders_for(shared.decoder.pool.slots)
        if not self.riders:
            raise ValueError(f"a pool of {shared.decoder.pool.slots} slots is too small for mixed-step graphs")
        self.shared = shared
        self._feed = feed
        most_tokens = max(t for _, t in self.riders)
        # The question padding's slab, held as long as the graphs live: room for the largest rider bucket.
        self._question_scratch = shared.decoder.pool.allocate(most_tokens)
        self._scratch = (step_scratch, self._question_scratch.start)
        self._pool = torch.cuda.graph_pool_handle()
        self._graphs: dict[tuple[int, int, tuple[int, int]], SharedMixedGraph] = {}
        self._reads_held: dict[tuple[int, tuple[int, int]], list[int]] = {}  # (batch, riders) -> reads captured
        rows = max(SHARED_BUCKETS) + max(q for q, _ in self.riders)
        self._out = torch.empty((rows, spec.vocab_size), dtype=torch.float32, device=spec.device)
        self.replays = 0  # mixed steps that ran through a graph, for tests and benchmarks
        # Token slots the replays computed past their questions' own tokens: the rider buckets' padding (metrics).
        self.padded_tokens = 0

    def fits(self, batch: int, question_tokens: Sequence[int]) -> bool:
        """Whether a decode step of `batch` rows can take questions of these lengths through a graph."""
        riders = rider_bucket(len(question_tokens), sum(question_tokens), self.riders)
        return 0 < batch <= max(SHARED_BUCKETS) and riders is not None

    def step(
        self,
        decode: tuple[Sequence[int], Sequence[int], Sequence[tuple[int, int]]],
        step_call: SegmentArrays,
        feed: StepFeed | None,
        questions: Sequence[ExtendRequest],
        reads: Sequence[Reads],
    ) -> torch.Tensor | None:
        """The mixed step through its bucket's graph; None when none holds it (the caller runs it eagerly)."""
        ids = decode[0]
        batch = next((b for b in SHARED_BUCKETS if b >= len(ids)), None)
        question_tokens = sum(len(q[0]) for q in questions)
        riders = rider_bucket(len(questions), question_tokens, self.riders)
        if batch is None or riders is None:
            return None
        most_reads = max([*map(len, reads), int(step_call.seg_counts.max()) if step_call.seg_counts.size else 0])
        staged, src = stage_feed(self._feed, feed)
        if not staged:
            return None
        reads_held = held_reads(self._reads_held.get((batch, riders), ()), reads_bucket(most_reads))
        graph = self._graph(batch, reads_held, riders)
        try:
            logits = graph.replay(decode, step_call, src, questions, reads)
        except ValueError:  # a plan over the bucket's capacity: eager, this once
            return None
        self.replays += 1
        self.padded_tokens += riders[1] - question_tokens
        return logits

    def _graph(self, batch: int, reads: int, riders: tuple[int, int]) -> SharedMixedGraph:
        key = (batch, reads, riders)
        graph = self._graphs.get(key)
        if graph is None:
            buffers = (self._feed, self._out)
            graph = SharedMixedGraph(self.shared, batch, reads, riders, self._scratch, self._pool, buffers)
            self._graphs[key] = graph
            self._reads_held.setdefault((batch, riders), []).append(reads)
            log.info(
                "captured the shared mixed step: %d rows, %d questions of %d tokens, %d reads, in %.0f ms",
                batch,
                *riders,
                reads,
                graph.capture_ms,
            )
        return graph

    def warm(self, reads: int, max_batch: int) -> None:
        """Capture every bucket up to `max_batch` decode rows for `reads` chunks a request now (server start)."""
        for batch in SHARED_BUCKETS:
            if batch > max_batch and batch != SHARED_BUCKETS[0]:
                break
            for riders in self.riders:
                self._graph(batch, reads_bucket(reads), riders)

    def close(self) -> None:
        """Give the question scratch slab back to the pool (the graphs must not replay afterwards)."""
        self._graphs.clear()
        self._reads_held.clear()
        self.shared.decoder.pool.free(self._question_scratch)
