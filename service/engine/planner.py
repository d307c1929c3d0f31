"""The scheduler's policy: who waits, who runs, who is admitted this step and how each one's prompt goes in.

The planner owns the three lines (waiting, prefilling, running) and the KV pool's reservations. It decides and
never touches the device: `admit` reserves each admitted request's slab (its whole sequence: context + question +
answer budget, so a running request never needs more memory and none is ever preempted), fetches its chunk KV
through the KV source, and sorts it into how its prompt goes in (`AdmissionPlan`); `naive_chunks` picks the naive
prompt tokens this step prefills; `continuing` picks the running requests that need a row in the next step.

First come, first served: a request the pool cannot hold yet waits at the head of the line and nothing behind it
overtakes it, so a long request cannot starve.

Shadow requests (a sample of answers run again naive, to watch fidelity) wait in a line of their own, the low
priority lane: one is admitted only while no other request waits and the batch has room. When the head of the
main line cannot be admitted (no room in the batch or the pool), every shadow admitted is preempted (`preempted`:
ended, its slab freed, not run again), so a request never waits longer for a shadow than the step already launched.
A running naive shadow's prompt chunks also go after every other request's.

Shared-chunk mode (`shared`, `shared_chunks.py`): a request reading its chunks from the arena reserves a slab of
its tail only; at admission the chunks the arena holds are pinned there, and only the others' KV is fetched
(pinned where the source pins; nothing when all are resident) and placed in the arena, pinned too. When pinned
chunks leave the arena no room it waits at the head of the line, as for a full pool, holding no pin and no block.
Every end of a request gives both pins back (`release_chunks`). Its question rides in the running answers' next
decode step where `prefill_with_decode` is on and the shared step holds it (`_shared_rides`); the part of a wave
the step cannot hold waits for the next step rather than sending the whole wave to a prefill apart
(`_ride_is_full`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from service.engine.batch_request import BatchRequest, RequestStatus
from service.engine.chunk_arena import ArenaFullError
from service.engine.chunk_source import ChunkSource, PinningChunkSource
from service.engine.engine import GenerationMode, StitchEngine, check_request
from service.engine.kv_pool import KVPool
from service.engine.shared_chunks import SharedChunks


class QueueFullError(RuntimeError):
    """The waiting line is at its limit; the caller should refuse the request (HTTP 503/429)."""


class PrefillShapes(Protocol):
    """What the device can run together (`SlabPrefill`): whether several requests' new tokens run as one forward,
    and whether a decode step of `batch` rows can hold `questions` prefilled in it."""

    batched: bool

    def mixes(self, batch: int, questions: Sequence[BatchRequest]) -> bool: ...


@dataclass
class AdmissionPlan:
    """The requests admitted in one step, by how their prompt goes in."""

    alone: list[BatchRequest] = field(default_factory=list)  # prefilled one by one
    together: list[BatchRequest] = field(default_factory=list)  # turbo questions in one batched forward
    riding: list[BatchRequest] = field(default_factory=list)  # turbo questions in this step's decode forward
    failed: list[tuple[BatchRequest, BaseException]] = field(default_factory=list)  # their KV could not be had
    shared: list[BatchRequest] = field(default_factory=list)  # questions prefilled over the chunk arena
    shared_riding: list[BatchRequest] = field(default_factory=list)  # shared questions in this step's decode forward


@dataclass(frozen=True)
class NaiveChunk:
    """The next tokens of a naive prompt prefilled in chunks, from `begin`."""

    request: BatchRequest
    ids: list[int]
    begin: int

    @property
    def completes(self) -> bool:
        return self.begin + len(self.ids) == self.request.result.prompt_tokens


class Planner:
    """Waiting, prefilling and running requests over one KV pool."""

    def __init__(
        self,
        engine: StitchEngine,
        pool: KVPool,
        shapes: PrefillShapes,
        kv_source: ChunkSource | None,
        max_batch: int,
        max_waiting: int | None,
        prefill_chunk: int,
        batch_prefill_min: int,
        prefill_with_decode: bool,
        shared: SharedChunks | None = None,
    ) -> None:
        if prefill_chunk < 0 or batch_prefill_min < 0:
            raise ValueError("prefill_chunk and batch_prefill_min must be >= 0")
        if max_batch <= 0:
            raise ValueError("max_batch must be positive")
        self.engine = engine
        self.pool = pool
        self.shapes = shapes
        self.kv_source = kv_source
        self.max_batch = max_batch
        self.max_waiting = max_waiting
        self.prefill_chunk = prefill_chunk
        self.batch_prefill_min = batch_prefill_min
        self.prefill_with_decode = prefill_with_decode
        self.shared = shared
        self.max_tokens = pool.slots - pool.used_slots  # what one request may ever hold (the graphs keep a slot)
        self.waiting: deque[BatchRequest] = deque()
        self.prefilling: deque[BatchRequest] = deque()  # admitted naive requests whose prompt goes in by chunks
        self.running: deque[BatchRequest] = deque()
        self.shadows: deque[BatchRequest] = deque()  # the low-priority lane; its bound is the caller's

    def add(self, request: BatchRequest) -> None:
        """Queue a request; ValueError when it can never run, QueueFullError when the line is full."""
        request.chunk_ready = check_request(self.engine, request.prompt, request.chunk_kv, request.chunk_ready)
        need = request.tokens_needed
        if need > self.engine.spec.max_context:
            raise ValueError(f"sequence of {need} tokens exceeds the model's context of {self.engine.spec.max_context}")
        if self.shared is not None and self.shared.applies(request):
            request.tail_tokens = need = self.shared.tail_tokens(request)
        if need > self.max_tokens:
            raise ValueError(f"a request of {need} tokens can never fit a KV pool of {self.max_tokens}")
        if request.shadow:
            request.added_at = time.perf_counter()
            self.shadows.append(request)
            return
        if self.max_waiting is not None and len(self.waiting) >= self.max_waiting:
            raise QueueFullError(f"{len(self.waiting)} requests already wait")
        request.added_at = time.perf_counter()
        self.waiting.append(request)

    def cancelled(self) -> list[BatchRequest]:
        return [r for r in (*self.waiting, *self.shadows, *self.prefilling, *self.running) if r.cancelled]

    def preempted(self) -> list[BatchRequest]:
        """The admitted shadows to end now: the head of the main line cannot be admitted (the batch is full or the
        pool has no slab for it), so they make room for it."""
        shadows = [r for r in (*self.prefilling, *self.running) if r.shadow]
        if not (shadows and self.waiting) or self._admissible(self.waiting[0], 0):
            return []
        return shadows

    def has_work(self) -> bool:
        return bool(self.waiting or self.shadows or self.prefilling or self.running)

    def remove(self, request: BatchRequest) -> None:
        """Take an ended request out of whichever line holds it."""
        for line in (self.waiting, self.shadows, self.running, self.prefilling):
            if request in line:
                line.remove(request)

    def start_running(self, request: BatchRequest) -> None:
        """The request's first token is known (read or still on the device): it decodes from the next step."""
        if request in self.prefilling:
            self.prefilling.remove(request)
        self.running.append(request)

    # ---- admission -------------------------------------------------------------------------------------------

    def admit(self, only: Callable[[BatchRequest], bool] | None = None) -> AdmissionPlan:
        """Admit from the head of the line while the batch and the pool have room (and, given `only`, while the
        head is one it accepts). Turbo questions admitted together go into one batched forward when there are at
        least `batch_prefill_min` of them, or into the decode step's forward where it holds them
        (`_rides_in_step`)."""
        plan = AdmissionPlan()
        admitted: list[BatchRequest] = []
        # The shadows' lane only once the main line is empty: a shadow never takes a place a request could have.
        for line in (self.waiting, self.shadows):
            if line is self.shadows and self.waiting:
                break
            while line:
                request = line[0]
                if only is not None and not only(request):
                    break
                if not self._admissible(request, len(admitted) + len(plan.shared)):
                    break
                if self._ride_is_full(plan.shared, request):
                    break
                try:
                    error = self._reserve(request)
                except ArenaFullError:
                    break  # pinned chunks fill the arena: it waits at the head of the line, as for a full pool
                line.popleft()
                if error is not None:
                    plan.failed.append((request, error))
                elif request.tail_tokens is not None:
                    plan.shared.append(request)
                elif self._chunked(request):
                    self.prefilling.append(request)
                else:
                    admitted.append(request)
        together = [r for r in admitted if self._joins_batched_prefill(r)]
        riding = self._rides_in_step(together)
        if not self.shapes.batched or (len(together) < self.batch_prefill_min and not riding):
            together = []
        plan.alone = [r for r in admitted if r not in together]
        if riding:
            plan.riding = together
        else:
            plan.together = together
        if self._shared_rides(plan):
            plan.shared_riding, plan.shared = plan.shared, []
        return plan

    def _ride_is_full(self, riders: Sequence[BatchRequest], request: BatchRequest) -> bool:
        """Whether shared `request` must wait for the next step because this step's decode forward holds `riders`
        but not `request` beside them. Admitting it would send the whole wave to a prefill apart: a forward of its
        own that every running answer waits for, where the rest of the wave rides in the next step instead. A
        request that rides with no other (too long for any rider bucket) is admitted and prefilled apart."""
        if not (riders and request.tail_tokens is not None and self.prefill_with_decode and self.shared is not None):
            return False
        if self.prefilling or not self.shared.mixes(len(self.running), riders):
            return False  # this step's questions go apart anyway: nothing is gained by holding one back
        return not self.shared.mixes(len(self.running), [*riders, request])

    def _admissible(self, request: BatchRequest, admitted: int) -> bool:
        """Whether `request` can be admitted now, beside `admitted` others admitted in this step: the batch has a
        row and the pool a slab for it."""
        batch = len(self.running) + len(self.prefilling) + admitted
        return batch < self.max_batch and self.pool.can_allocate(request.slab_tokens)

    def _reserve(self, request: BatchRequest) -> BaseException | None:
        """Give the request its slab and its chunk KV (and, shared, its chunks' arena ranges); the error when the KV
        could not be had (its slab, which no step has written, goes straight back to the pool). Raises
        `ArenaFullError`, having reserved nothing, when the arena has no room for its chunks now."""
        shared = self.shared if request.tail_tokens is not None else None
        if shared is not None and not shared.may_fit(request):
            raise ArenaFullError("pinned chunks leave the arena no room for the request's chunks")
        request.slab = self.pool.allocate(request.slab_tokens)
        request.kv = self.pool.buffer(request.slab)
        try:
            if shared is not None:
                self._place_shared(request, shared)
            else:
                self._fetch(request)
        except ArenaFullError:
            self._unreserve(request)
            if request.fetch is not None:  # fetched again when it is next tried: no block held while it waits
                request.drop_chunk_kv()
            raise
        except Exception as err:  # one request's failure (its KV index away, say) must not take the batch down
            self._unreserve(request)
            return err
        request.queue_ms = (time.perf_counter() - request.added_at) * 1e3
        request.status = RequestStatus.RUNNING
        return None

    def _unreserve(self, request: BatchRequest) -> None:
        """Undo an admission that no step has run: the slab back to the pool, the pins given back."""
        assert request.slab is not None
        self.pool.free(request.slab)
        request.slab, request.kv = None, None
        self.release_chunks(request)

    def release_chunks(self, request: BatchRequest) -> None:
        """Give back what a shared request pins: its arena ranges and its fetch's device-tier blocks (every end
        of a request comes here; a second call finds nothing). At once, unlike a slab (`InFlight.release`): a step
        still running reads the ranges, never writes them, and whatever reuses them next (an arena placement, the
        poison of an eviction) is queued on the same stream after that step."""
        if self.shared is None:
            return
        self.shared.release(request)
        if request.fetch is not None and isinstance(self.kv_source, PinningChunkSource):
            self.kv_source.release(request.fetch)

    def _fetch(self, request: BatchRequest) -> None:
        """The chunks' KV from the source's tiers, at admission, so blocks occupy device memory only once the
        request runs; copies may still land after this returns (the stitch waits for each block)."""
        if self.kv_source is None or request.mode is not GenerationMode.TURBO or request.chunk_kv is not None:
            return
        fetched = self.kv_source.fetch(request.prompt.blocks)
        request.fetch = fetched
        request.chunk_kv = fetched.blocks
        request.chunk_ready = check_request(self.engine, request.prompt, fetched.blocks, fetched.ready or None)

    def _place_shared(self, request: BatchRequest, shared: SharedChunks) -> None:
        """A shared request's chunks into the arena: those it holds pinned first, then only the others' KV fetched
        (nothing when every chunk is resident) and placed. Raises `ArenaFullError` when they find no room."""
        missing = shared.pin_resident(request)
        self._fetch_missing(request, missing)
        shared.place(request, missing)

    def _fetch_missing(self, request: BatchRequest, missing: Sequence[int]) -> None:
        """The KV of a shared request's chunks the arena lacks (`missing`, by index), from the source's tiers; its
        device-tier blocks pinned where the source can (released with the arena ranges). Nothing when the arena
        holds every chunk or the KV was handed in with the request."""
        if self.kv_source is None or request.chunk_kv is not None or not missing:
            return
        wanted = [request.prompt.blocks[i] for i in missing]
        source = self.kv_source
        fetched = source.fetch(wanted, pin=True) if isinstance(source, PinningChunkSource) else source.fetch(wanted)
        request.fetch = fetched  # first: whatever is checked below, the release finds what the fetch pinned
        if [b.token_ids for b in fetched.blocks] != wanted or len(fetched.ready) not in (0, len(wanted)):
            raise ValueError("the KV source's blocks do not hold the chunks asked for")

    def _chunked(self, request: BatchRequest) -> bool:
        return (
            self.prefill_chunk > 0
            and request.mode is GenerationMode.NAIVE
            and request.result.prompt_tokens > self.prefill_chunk
        )

    @staticmethod
    def _joins_batched_prefill(request: BatchRequest) -> bool:
        # Recompute needs its own eager pass between stitch and question; keep it on the one-request path.
        return request.mode is GenerationMode.TURBO and not request.recompute.active and bool(request.prompt.question)

    def _rides_in_step(self, questions: Sequence[BatchRequest]) -> bool:
        """Whether this step's admitted `questions` go into its decode step's forward: answers are running (so the
        step runs), the batched forward is what the device runs, a mixed step holds them, and no naive chunk runs
        before the step: a chunk is timed synchronously, so a question riding in the step would wait for it,
        where prefilled apart its first token is read before it."""
        if not (questions and self.prefill_with_decode and self.shapes.batched and self.batch_prefill_min > 0):
            return False
        if self.shared is not None:  # the mixed forward reads slabs only; shared mode's step is the segment one
            return False
        return bool(self.running) and not self.prefilling and self.shapes.mixes(len(self.running), questions)

    def _shared_rides(self, plan: AdmissionPlan) -> bool:
        """Whether the shared questions admitted in this step go into its decode step's forward: as
        `_rides_in_step` says for stitched ones, answers are running and no naive chunk runs before the step, and
        the shared step holds them (`SharedChunks.mixes`)."""
        if not (plan.shared and self.prefill_with_decode and self.shared is not None) or self.prefilling:
            return False
        return self.shared.mixes(len(self.running), plan.shared)

    # ---- the step's rows -------------------------------------------------------------------------------------

    def naive_chunks(self) -> list[NaiveChunk]:
        """Up to `prefill_chunk` tokens of the chunked naive prompts, oldest first. Where the batched forward runs
        every request's share of the budget goes in this step; elsewhere one chunk of the oldest alone."""
        chunks: list[NaiveChunk] = []
        budget = self.prefill_chunk
        for request in sorted(self.prefilling, key=lambda r: r.shadow):  # stable: shadows last, else oldest first
            ids, begin = request.prompt.joined(), request.buffer.length
            take = min(len(ids) - begin, budget)
            chunks.append(NaiveChunk(request, list(ids[begin : begin + take]), begin))
            budget -= take
            if budget == 0 or not self.shapes.batched:
                break
        return chunks

    def continuing(self, unread: dict[int, int]) -> list[BatchRequest]:
        """The running requests that need a row in the next step: not those whose unread token (`unread`: by
        request id) is their last by their budget — reading it will end them, and a row for them would be
        computed and dropped. (One ended by EOS or a stop string cannot be known before the read: it gets one.)"""
        return [
            r for r in self.running if id(r) not in unread or len(r.result.token_ids) + 1 < r.sampling.max_new_tokens
        ]

    def rides(self, batch: Sequence[BatchRequest], questions: Sequence[BatchRequest]) -> bool:
        """Whether `questions` can still ride in a step over `batch`: it has rows (every answer may have ended, or
        have its last token unread, since admission) and a mixed step holds them beside those rows (requests
        prefilled alone in the same admission may have joined the running ones)."""
        if self.shared is not None:
            return self.shared.mixes(len(batch), questions)
        return bool(batch) and self.shapes.mixes(len(batch), questions)
