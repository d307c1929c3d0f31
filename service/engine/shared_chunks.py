"""The scheduler's shared-chunk mode (`KVSTITCH_SHARED_CHUNKS=on`): turbo answers read their chunks from one
`ChunkArena` instead of a stitched copy in their own slab.

Which requests: turbo ones without recompute (recomputed tokens are per-request) whose chunks can ever fit the
arena; naive requests, recompute and shadows keep the copy path. A shared request's slab holds its tail only:
the template prefix at 0 .. P-1, its question at the plan's `question_start`, its answer budget after.

One forward for both kinds: every decode step runs through `SharedDecoder.step`, a copy-path row being a
request with no segments whose whole context is its tail (its slab, stitched as before), which segment
attention supports. That keeps one batched step, one pick and one overlap record per step, where separate
forwards for the two kinds would split every step (and its feed of unread picks) in two.

Decode steps of up to 128 rows replay CUDA graphs where the segment kernels run (`shared_graph.py`: the step's
plan padded to its bucket's capacity), and so do question prefills of up to 32 requests and 1,024 question tokens
(`shared_extend_graph.py`, the same padding; a larger group in parts); larger steps and the CPU run eagerly.

Questions admitted while answers run may ride in the next decode step's forward (`mixed`, the scheduler's
`prefill_with_decode`): one pass over the weights for the step and the prefill instead of two, and the running
answers do not stall while the questions prefill apart. Where steps run through graphs so do mixed steps
(`shared_mixed_graph.py`), and questions no mixed graph holds are prefilled apart.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

from service.engine.arena_stats import ArenaStats
from service.engine.batch_decode import BatchDecoder, DecodeRows, ExtendRows, StepFeed
from service.engine.batch_request import BatchRequest
from service.engine.chunk_arena import ArenaFullError, ChunkArena
from service.engine.engine import GenerationMode, StitchEngine
from service.engine.kv_layout import KVBlock
from service.engine.segment_attention import ChunkRange, ContextScaling
from service.engine.shared_decode import (
    PrefixPlacer,
    Reads,
    SharedDecoder,
    decode_batch,
    extend_batch,
    placements,
)
from service.engine.shared_extend_graph import SharedExtendGraphs
from service.engine.shared_graph import SharedStepGraphs, reads_bucket
from service.engine.shared_mixed_graph import SharedMixedGraphs
from service.engine.slab_prefill import commit_new_tokens, reserve_new_tokens
from service.engine.stitch import BlockReady

# Question tokens that may ride in one decode step (`SharedChunks.mixes`); module-level so a benchmark can try others.
RIDE_TOKENS = 1024


class SharedChunks:
    """Places shared requests' chunks in the arena and runs their question prefill and every decode step."""

    def __init__(
        self,
        engine: StitchEngine,
        decoder: BatchDecoder,
        arena: ChunkArena,
        graphs: bool = False,
        max_picks: int = 0,
        riding: bool = False,
    ) -> None:
        """`graphs`: decode steps and question prefills through CUDA graphs where the segment kernels run
        (`shared_graph.py`, `shared_extend_graph.py`; the prefill's where the pool spares its padding slab), and
        with `riding` (questions may ride in steps) the mixed steps (`shared_mixed_graph.py`); `max_picks`: the
        most unread picks a step may be fed from."""
        self.engine = engine
        self.arena = arena
        context = ContextScaling(temperature=engine.context_temperature, scale=engine.context_scale)
        self.decoder = SharedDecoder(decoder, arena, context)
        self._prefix = PrefixPlacer(decoder.pool, engine.forward.rotary)
        graphed = graphs and self.decoder.kernels
        self.graphs = SharedStepGraphs(self.decoder, max_picks) if graphed else None
        spec = engine.spec
        prefill_graphed = graphed and SharedExtendGraphs.fit(decoder.pool.slots, spec.num_heads // spec.num_kv_heads)
        self.extend_graphs = SharedExtendGraphs(self.decoder) if prefill_graphed else None
        self.mixed_graphs: SharedMixedGraphs | None = None
        if self.graphs is not None and riding and SharedMixedGraphs.riders_for(decoder.pool.slots):
            self.mixed_graphs = SharedMixedGraphs(self.decoder, self.graphs.feed, self.graphs.scratch_slot)
        # Counts for the metrics: answers placed since start, and those that first waited for room. Requests held
        # back are kept weakly: one cancelled while it waits is simply forgotten.
        self.answers = 0
        self.waited = 0
        self.resident_reads = 0  # chunks answers read from the arena as they found it: no fetch, no copy
        self.rider_question_tokens = 0  # question tokens prefilled riding in decode steps
        self._held_back: weakref.WeakSet[BatchRequest] = weakref.WeakSet()
        self._reading: weakref.WeakSet[BatchRequest] = weakref.WeakSet()

    # ---- admission --------------------------------------------------------------------------------------

    def applies(self, request: BatchRequest) -> bool:
        """Whether `request` reads its chunks from the arena: turbo, nothing recomputed, a question to prefill,
        not a shadow, and chunks the arena can ever hold at once (unpinned chunks are evicted to make room)."""
        prompt = request.prompt
        return (
            request.mode is GenerationMode.TURBO
            and not request.recompute.active
            and not request.shadow
            and bool(prompt.question)
            and sum(len(b) for b in prompt.blocks) <= self.arena.slots
        )

    def tail_tokens(self, request: BatchRequest) -> int:
        """Slots a shared request's slab holds: prefix, question and answer budget (its chunks live in the arena)."""
        return len(request.prompt.prefix) + len(request.prompt.question) + request.sampling.max_new_tokens

    def may_fit(self, request: BatchRequest) -> bool:
        """Whether the arena could take the request's chunks now (checked before its KV is fetched, so a request
        waiting for room fetches nothing)."""
        fits = self.arena.may_hold(self.engine.kv_version, request.prompt.blocks, request.prompt.block_hashes)
        if not fits:
            self._held_back.add(request)
        return fits

    def pin_resident(self, request: BatchRequest) -> list[int]:
        """Pin the request's chunks the arena holds now; the indices of those it lacks, the only ones whose KV
        admission fetches (then `place`). Pinned before any missing chunk is placed: placing one may evict unpinned
        chunks, never then one this request reads. The pins are the request's `arena_ranges` at once, so however
        its admission ends, its `release` gives them back."""
        held = self.arena.pin_held(self.engine.kv_version, request.prompt.blocks, request.prompt.block_hashes)
        request.arena_ranges = tuple(chunk for chunk in held if chunk is not None)
        request.resident_chunks = tuple(i for i, chunk in enumerate(held) if chunk is not None)
        return [i for i, chunk in enumerate(held) if chunk is None]

    def place(self, request: BatchRequest, missing: Sequence[int]) -> None:
        """Place the chunks `pin_resident` found `missing` (their KV on the device: fetched, given or computed) and
        pin them beside the resident ones, then put the prefix in the slab. `ArenaFullError`, having placed and
        pinned none of them, when pinned chunks leave no room (the resident pins stay for `release`)."""
        assert request.slab is not None
        blocks, ready = self._missing_kv(request, missing)
        for arrival in ready:
            if arrival is not None:
                arrival()  # the stream waits for the block's copy before the arena copies it
        engine = self.engine
        try:
            placed = self.arena.acquire(blocks, engine.kv_version)
        except ArenaFullError:
            self._held_back.add(request)
            raise
        request.arena_ranges = _in_request_order(request.arena_ranges, placed, missing)
        self._count_placed(request, len(request.resident_chunks))
        lengths = [engine.prefix_block.num_tokens, *(len(ids) for ids in request.prompt.blocks)]
        plan = engine.plan_lengths(request.positions, lengths)
        request.reads = placements(plan, request.arena_ranges)
        request.kv = self._prefix.place(request.slab, engine.prefix_block)
        # The question goes at its true index, after the chunks the slab does not hold.
        request.kv.truncate(request.kv.length, plan.question_start)

    def release(self, request: BatchRequest) -> None:
        """Unpin the request's chunks (once: a second call finds nothing)."""
        ranges, request.arena_ranges, request.reads = request.arena_ranges, (), Reads()
        self._reading.discard(request)
        if ranges:
            self.arena.release(ranges)

    def _count_placed(self, request: BatchRequest, resident: int) -> None:
        self.answers += 1
        self.resident_reads += resident
        self._reading.add(request)
        if request in self._held_back:
            self._held_back.discard(request)
            self.waited += 1

    def stats(self) -> ArenaStats:
        """The arena's figures now (read from the metrics' thread: counters only, no walk over the chunks)."""
        arena = self.arena
        return ArenaStats(
            arena.used_bytes,
            arena.capacity_bytes,
            arena.chunks,
            arena.pinned_chunks,
            len(self._reading),
            self.answers,
            self.waited,
            arena.evictions,
            self.resident_reads,
        )

    def rider_tokens(self) -> dict[str, int]:
        """Token slots the decode steps' forwards computed for riding questions since start: the questions' own
        (`question`) and their graphs' bucket padding (`padding`), which every running answer waits for too."""
        padded = self.mixed_graphs.padded_tokens if self.mixed_graphs is not None else 0
        return {"question": self.rider_question_tokens, "padding": padded}

    def _missing_kv(
        self, request: BatchRequest, missing: Sequence[int]
    ) -> tuple[Sequence[KVBlock], Sequence[BlockReady | None]]:
        """The KV of the `missing` chunks, in order, with the waits for their copies: as fetched at admission (the
        fetch asked for those alone), else picked from the KV handed in with the request, else computed (offline
        use, tests)."""
        if request.fetch is not None:
            return request.fetch.blocks, request.fetch.ready
        if request.chunk_kv is not None:
            ready = request.chunk_ready or [None] * len(request.chunk_kv)
            return [request.chunk_kv[i] for i in missing], [ready[i] for i in missing]
        blocks = request.prompt.blocks
        return (self.engine.precompute([blocks[i] for i in missing]) if missing else []), ()

    # ---- the forwards -----------------------------------------------------------------------------------

    def mixes(self, batch: int, questions: Sequence[BatchRequest]) -> bool:
        """Whether `questions` may ride in a decode step of `batch` rows. Where steps run through graphs, only
        where a mixed step's graph holds them: an eager mixed forward costs the host more than a graphed step
        and a graphed prefill apart. Eagerly, up to RIDE_TOKENS question tokens (a larger wave, the first of a
        burst, is prefilled apart)."""
        lengths = [len(r.prompt.question) for r in questions]
        if self.graphs is not None:
            return self.mixed_graphs is not None and self.mixed_graphs.fits(batch, lengths)
        return batch > 0 and sum(lengths) <= RIDE_TOKENS

    def mixed(
        self,
        batch: Sequence[BatchRequest],
        decode: tuple[Sequence[int], Sequence[int], Sequence[tuple[int, int]]],
        feed: StepFeed | None,
        questions: Sequence[BatchRequest],
    ) -> torch.Tensor:
        """A decode step over `batch` (`decode`: each row's id, position and slab span; `feed`: rows fed from the
        previous step's picks) with `questions` prefilled in its forward (`SharedDecoder.mixed`); fp32 logits
        [B + Q, vocab], the decode rows' then each question's last token's. The decode rows' slots are the
        caller's to reserve and commit, as for `step`."""
        ids, positions, spans = decode
        device = self.engine.spec.device
        step_call = decode_batch(positions, spans, [r.reads for r in batch])
        tokens = [list(request.prompt.question) for request in questions]
        self.rider_question_tokens += sum(map(len, tokens))
        entries = reserve_new_tokens(questions, tokens)
        reads = [r.reads for r in questions]
        logits = None
        if self.mixed_graphs is not None:
            logits = self.mixed_graphs.step(decode, step_call, feed, entries, reads)
        if logits is None:
            rows = DecodeRows.build(ids, positions, spans, device, feed)
            extend = ExtendRows.build(entries, device)
            logits = self.decoder.mixed(rows, step_call, extend, extend_batch(entries, reads))
        commit_new_tokens(questions, tokens)
        return logits

    def extend(self, group: Sequence[BatchRequest]) -> torch.Tensor:
        """Every request's question after its prefix, at its true index (the buffer's next position), in one
        forward over the arena; logits [len(group), vocab] of each one's last question token."""
        tokens = [list(request.prompt.question) for request in group]
        entries = reserve_new_tokens(group, tokens)
        reads = [r.reads for r in group]
        if self.extend_graphs is not None:
            logits = self.extend_graphs.extend(entries, reads)
        else:
            logits = self.decoder.extend(
                ExtendRows.build(entries, self.engine.spec.device), extend_batch(entries, reads)
            )
        commit_new_tokens(group, tokens)
        return logits

    def step(
        self,
        batch: Sequence[BatchRequest],
        ids: Sequence[int],
        positions: Sequence[int],
        spans: Sequence[tuple[int, int]],
        feed: StepFeed | None = None,
    ) -> torch.Tensor:
        """One decode step over `batch` (each request's id, position and slab span; `feed`: rows fed from the
        previous step's picks): shared rows read their chunks from the arena, copy-path rows (no segments) their
        slab alone. Through a captured graph where one holds the step, else eagerly."""
        call = decode_batch(positions, spans, [r.reads for r in batch])
        if self.graphs is not None:
            logits = self.graphs.step(ids, positions, spans, call, feed)
            if logits is not None:
                return logits
        rows = DecodeRows.build(ids, positions, spans, self.engine.spec.device, feed)
        return self.decoder.step(rows, call)

    def warm(self, most_reads: int, max_batch: int, min_question: int) -> None:
        """Capture the decode step's and the question prefill's graphs now (server start) for rows reading up to
        `most_reads` chunks, so no answer waits for a capture (one is hundreds of ms; the first compiles kernels)."""
        levels = sorted({reads_bucket(reads) for reads in range(1, most_reads + 1)})
        for reads in levels:
            if self.graphs is not None:
                self.graphs.warm(reads, max_batch)
            if self.extend_graphs is not None:
                self.extend_graphs.warm(reads, max_batch, max(self.extend_graphs.buckets), min_question)
        # The mixed steps at the most reads only: one serves steps reading fewer (`held_reads`), and with a graph
        # per decode and rider bucket they are most of the start-up's captures.
        if self.mixed_graphs is not None and levels:
            self.mixed_graphs.warm(levels[-1], max_batch)

    def close(self) -> None:
        """Give the graphs' scratch slots back (the arena is closed by its owner)."""
        if self.mixed_graphs is not None:
            self.mixed_graphs.close()
            self.mixed_graphs = None
        if self.graphs is not None:
            self.graphs.close()
            self.graphs = None
        if self.extend_graphs is not None:
            self.extend_graphs.close()
            self.extend_graphs = None


def _in_request_order(
    resident: Sequence[ChunkRange], placed: Sequence[ChunkRange], missing: Sequence[int]
) -> tuple[ChunkRange, ...]:
    """Every chunk's range in the request's order, from those pinned resident and those placed at `missing`."""
    resident_ranges, placed_ranges = iter(resident), iter(placed)
    at_missing = set(missing)
    count = len(resident) + len(placed)
    return tuple(next(placed_ranges) if i in at_missing else next(resident_ranges) for i in range(count))
