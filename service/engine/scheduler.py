"""Continuous batching of stitched requests over one `KVPool`: plan → run → output, once per step.

`Scheduler.step()` reads as the algorithm. The planner (`planner.py`) takes out cancelled requests and admits
waiting ones while fewer than `max_batch` run and the pool has a slab for them; the runner (`runner.py`) stitches
and prefills the admitted, prefills the naive prompts' chunks and runs ONE batched decode step over every running
request; the output processor (`output.py`) applies what came back: appends each token, emits its text, finishes
a request on EOS / max tokens / a stop string and frees its slab. Requests join and leave at any step.

Threading: the scheduler belongs to one thread (the engine loop, the GPU's one owner). `cancel` only sets a flag
the next step acts on, so it may be called from anywhere; `add` and `step` from the loop's thread only.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator

from service.engine import batching_defaults
from service.engine.batch_decode import BatchDecoder
from service.engine.batch_graph import BatchGraphs
from service.engine.batch_request import BatchRequest
from service.engine.chunk_arena import ChunkArena
from service.engine.chunk_source import ChunkSource
from service.engine.engine import StitchEngine
from service.engine.kv_pool import KVPool
from service.engine.launch_pacer import LaunchPacer
from service.engine.output import Failed, OutputProcessor, StepOutput
from service.engine.planner import Planner, QueueFullError
from service.engine.runner import STEP_PHASES, StepRunner
from service.engine.shared_chunks import SharedChunks
from service.engine.slab_prefill import SlabPrefill

DEFAULT_MAX_BATCH = batching_defaults.MAX_BATCH
__all__ = ["DEFAULT_MAX_BATCH", "STEP_PHASES", "QueueFullError", "Scheduler"]


class Scheduler:
    """Waiting and running requests over one KV pool; `step()` plans, runs and applies the outputs."""

    def __init__(
        self,
        engine: StitchEngine,
        pool: KVPool,
        max_batch: int = DEFAULT_MAX_BATCH,
        max_waiting: int | None = None,
        attention: str = "auto",
        cuda_graphs: bool = False,
        prefill_chunk: int = 0,
        batch_prefill_min: int = 2,
        prefill_with_decode: bool = False,
        overlap: bool = False,
        overlap_admissions: bool = True,
        kv_source: ChunkSource | None = None,
        arena: ChunkArena | None = None,
        late_launch: bool = False,
        early_prefill_below: int = 0,
    ) -> None:
        """`cuda_graphs`: decode through `BatchGraphs` (CUDA, flash_varlen or sdpa_gather attention only).
        `prefill_chunk`: a naive prompt longer than this many tokens goes in by chunks, at most this many tokens
        per step over all such requests (oldest first), between the running answers' decode steps, instead of
        stalling them for its whole prefill (0: never).
        `batch_prefill_min`: when at least this many turbo requests are admitted in one step, their questions are
        prefilled together in one batched forward, and a step's naive chunks run as one forward (0: never).
        `prefill_with_decode`: turbo questions admitted while answers run are prefilled in the running answers'
        decode step's forward where a mixed step holds them: one pass over the weights instead of a prefill and
        then a decode step (Sarathi-Serve's piggybacking).
        `overlap`: launch each decode step before reading the previous one (see `runner.py`); it pays where the
        device runs asynchronously to the host (CUDA) and changes no request's tokens.
        `overlap_admissions` (with `overlap`): admitted requests' first tokens stay on the device too, fed to the
        next step and read while it runs; False reads each at its admission.
        `kv_source`: where an admitted turbo request without chunk KV gets it (the KV store's tiers); None: the
        engine computes it (offline use, tests).
        `arena`: shared-chunk mode (`shared_chunks.py`): turbo requests without recompute read their chunks from
        it; its decode steps replay `shared_graph.py`'s graphs where `cuda_graphs` (else run eagerly), and with
        `prefill_with_decode` its questions ride in decode steps (`SharedChunks.mixes`).
        `late_launch` (with `overlap`): the loop waits before each launch until shortly before the running step
        ends (`launch_delay_s`, `launch_pacer.py`), so the questions arriving meanwhile ride a step sooner.
        `early_prefill_below` (shared mode, with `overlap`): while fewer answers than this run, questions admitted
        while a step runs are prefilled at once on a second stream beside it (`side_stream.py`), not held to ride in
        the step after the queued one (0: never)."""
        shared_graphs = cuda_graphs
        if arena is not None:
            cuda_graphs = False
        decoder = BatchDecoder(engine.forward, pool, attention)
        shared = None
        if arena is not None:
            shared = SharedChunks(engine, decoder, arena, shared_graphs, 2 * max_batch, prefill_with_decode)
        # A step's rows may feed from a decode step and the admitted requests' first tokens, both unread.
        graphs = BatchGraphs(decoder, 2 * max_batch) if cuda_graphs else None
        # In shared mode only shared questions ride (`SharedChunks.mixed`): the slabs' mixed step is never run.
        mixed_picks = 2 * max_batch if prefill_with_decode and arena is None else 0
        slabs = SlabPrefill(engine, decoder, cuda_graphs, batch_prefill_min, mixed_picks)
        self.engine = engine
        self.pool = pool
        self.planner = Planner(
            engine,
            pool,
            slabs,
            kv_source,
            max_batch,
            max_waiting,
            prefill_chunk,
            batch_prefill_min,
            prefill_with_decode,
            shared,
        )
        pacer = LaunchPacer() if late_launch else None
        self.runner = StepRunner(
            engine,
            self.planner,
            decoder,
            slabs,
            graphs,
            overlap,
            overlap_admissions,
            shared,
            pacer,
            early_prefill_below,
        )
        self.output = OutputProcessor(self.planner, self.runner.inflight.release, engine.eos_ids())
        # The answers handed to the engine loop since it last looked (its own; None: none are taken mid-step).
        self.arrivals: Callable[[], list[BatchRequest]] | None = None
        if early_prefill_below > 0:
            self.runner.on_wait = self._admit_while_waiting

    # ---- the loop --------------------------------------------------------------------------------------------

    def add(self, request: BatchRequest) -> None:
        """Queue a request; raises ValueError when it can never run, QueueFullError when the line is full."""
        self.planner.add(request)

    def add_arrived(self, requests: Iterable[BatchRequest]) -> None:
        """Queue requests handed over by the engine loop; one that can never run (too long for the pool, the line
        full) fails alone."""
        for request in requests:
            try:
                self.add(request)
            except Exception as err:
                request.error = err
                self.finish_unstarted(request, err)

    def _admit_while_waiting(self) -> Iterator[StepOutput]:
        """While a step runs (the runner polls): the answers handed over since, admitted at once and prefilled
        early on the side stream, as long as the head of the line can be (`early_eligible`); the rest wait for
        the next step's admission."""
        if self.arrivals is not None:
            self.add_arrived(self.arrivals())
        yield from self._admitted(only=early_eligible)  # nothing when the head cannot go early

    def _admitted(self, only: Callable[[BatchRequest], bool] | None = None) -> Iterator[StepOutput]:
        """Admit from the line (`Planner.admit`) and run the plan: those whose KV could not be had fail, the rest
        are prefilled or held to ride. Where early prefills apply, the head of the line that can go early is
        admitted on the side stream first, and only that: what then heads the line (a request that cannot go
        early, or a shadow) is admitted on the main stream, whose work the side stream must not take over."""
        if self.runner.early_applies():
            waiting = self.planner.waiting
            if waiting and early_eligible(waiting[0]):  # else no side-stream work to queue (nor a mark to join)
                yield from self._admitted_on(early_eligible, early=True)
            if only is not None or not self._head_needs_main():
                return
        yield from self._admitted_on(only, early=False)

    def _admitted_on(self, only: Callable[[BatchRequest], bool] | None, early: bool) -> Iterator[StepOutput]:
        with self.runner.admission(early):
            plan = self.planner.admit(only)
        yield from (Failed([request], error) for request, error in plan.failed)
        yield from self.runner.admit(plan)

    def _head_needs_main(self) -> bool:
        """After an early admission: whether the head of the line is one to admit on the main stream (a request
        that cannot go early; with the line empty, a shadow)."""
        waiting = self.planner.waiting
        return not early_eligible(waiting[0]) if waiting else bool(self.planner.shadows)

    def cancel(self, request: BatchRequest) -> None:
        """Stop a request at the next step (its slab is freed there); safe from any thread."""
        request.cancelled = True

    def step(self) -> list[BatchRequest]:
        """One iteration; returns the requests that ended in it."""
        busy, began = self.runner.busy_s, time.perf_counter()
        finished = self._end(self.planner.cancelled(), "cancelled")
        finished += self._end(self.planner.preempted(), "preempted")
        finished += self._apply(self._admitted())
        busy["admit"] += time.perf_counter() - began
        if self.planner.prefilling:
            # A naive chunk is timed synchronously: read what is queued before it first, so the first tokens of
            # the questions just admitted go out now, not after the chunk.
            finished += self.drain()
        chunk_began = time.perf_counter()
        finished += self._apply(self.runner.prefill_chunks(self.planner.naive_chunks()))
        busy["prefill"] += time.perf_counter() - chunk_began
        finished += self._apply(self.runner.decode_step())
        return finished

    def launch_delay_s(self, now: float) -> float:
        """Seconds the loop may wait (taking in arrivals) before the next `step` with the device kept busy: 0
        unless `late_launch` and a launched step runs."""
        return self.runner.launch_delay_s(now)

    def drain(self) -> list[BatchRequest]:
        """Read every launched step and unread first token (before work that must not overlap them); returns the
        requests that ended."""
        return self._apply(self.runner.drain())

    def has_work(self) -> bool:
        return self.planner.has_work() or self.runner.has_work()

    def run_until_idle(self) -> None:
        """Step until nothing waits or runs (offline use and tests)."""
        while self.has_work():
            self.step()

    def warm(self, tokens: int) -> None:
        """Capture the decode step's graphs for live lengths up to `tokens` and every batched-prefill graph now
        (server start), so no capture happens while answers are served."""
        if self.graphs is not None:
            self.graphs.warm(tokens)
        self.slabs.warm()
        self.slabs.warm_mixed(tokens)

    def finish_unstarted(self, request: BatchRequest, error: BaseException) -> None:
        """Report a request that never entered the line (`add` refused it) as failed, through `on_finish`."""
        self.output.fail(request, error)

    def fail_all(self, error: BaseException) -> list[BatchRequest]:
        """End every request with `error` (a step itself failed: the device state of the batch is unknown)."""
        planner = self.planner
        failed = [*planner.waiting, *planner.shadows, *planner.prefilling, *planner.running, *self.runner.questions]
        self.runner.questions = []
        self.runner.inflight.forget()
        for request in failed:
            self.output.fail(request, error)
        return failed

    def _apply(self, outputs: Iterable[StepOutput]) -> list[BatchRequest]:
        """Apply each output as it comes, before the runner goes on; returns the requests they ended."""
        ended: list[BatchRequest] = []
        for output in outputs:
            ended += self.output.apply(output)
        return ended

    def _end(self, requests: list[BatchRequest], reason: str) -> list[BatchRequest]:
        for request in requests:
            self.output.finish(request, reason)
        return requests

    # ---- what the loop, the metrics and the tests read -------------------------------------------------------

    @property
    def waiting(self) -> deque[BatchRequest]:
        return self.planner.waiting

    @property
    def prefilling(self) -> deque[BatchRequest]:
        return self.planner.prefilling

    @property
    def running(self) -> deque[BatchRequest]:
        return self.planner.running

    @property
    def max_batch(self) -> int:
        return self.planner.max_batch

    @property
    def max_waiting(self) -> int | None:
        return self.planner.max_waiting

    @property
    def prefill_chunk(self) -> int:
        return self.planner.prefill_chunk

    @property
    def batch_prefill_min(self) -> int:
        return self.planner.batch_prefill_min

    @property
    def prefill_with_decode(self) -> bool:
        return self.planner.prefill_with_decode

    @prefill_with_decode.setter
    def prefill_with_decode(self, on: bool) -> None:
        """Benchmarks pair passes with and without it in one server."""
        self.planner.prefill_with_decode = on

    @property
    def shared(self) -> SharedChunks | None:
        return self.planner.shared

    @property
    def decoder(self) -> BatchDecoder:
        return self.runner.decoder

    @property
    def slabs(self) -> SlabPrefill:
        return self.runner.slabs

    @property
    def graphs(self) -> BatchGraphs | None:
        return self.runner.graphs

    @property
    def overlap(self) -> bool:
        return self.runner.overlap

    @overlap.setter
    def overlap(self, on: bool) -> None:
        """Benchmarks pair passes with and without it in one server."""
        self.runner.overlap = on

    @property
    def overlap_admissions(self) -> bool:
        return self.runner.overlap_admissions

    @overlap_admissions.setter
    def overlap_admissions(self, on: bool) -> None:
        self.runner.overlap_admissions = on

    @property
    def busy_s(self) -> dict[str, float]:
        return self.runner.busy_s

    @property
    def last_batch(self) -> int:
        return self.runner.last_batch

    @property
    def prefilled_together(self) -> int:
        return self.runner.prefilled_together

    @property
    def prefilled_with_decode(self) -> int:
        return self.runner.prefilled_with_decode

    @property
    def prefilled_early(self) -> int:
        return self.runner.prefilled_early

    def rider_tokens(self) -> dict[str, int]:
        """Shared mode's riding question tokens and their padding (`SharedChunks.rider_tokens`); zeros without."""
        return self.shared.rider_tokens() if self.shared is not None else {"question": 0, "padding": 0}


def early_eligible(request: BatchRequest) -> bool:
    """Whether a waiting request can be admitted and prefilled early, on the side stream: a shared-chunk answer
    (its question prefilled over the arena), not a shadow (background work takes no priority), not asking for
    log-probabilities (read with the logits, on the host, at once)."""
    return request.tail_tokens is not None and not request.shadow and request.sampling.logprobs is None
