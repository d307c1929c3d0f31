"""Continuous batching of stitched requests: a nano-vllm-shaped scheduler over one `KVPool`.

`Scheduler.step()` reads as the algorithm: drop cancelled requests, admit waiting ones (while fewer than
`max_batch` run and the pool has a slab for them: stitch their chunk KV into the slab and prefill the question,
or prefill the whole joined prompt in the naive mode), run ONE batched decode step over every running request,
then postprocess (append each token, emit its text, finish on EOS / max tokens / a stop string, free the slab
at once). Requests join and leave at any step.

Overlapped decode (`overlap`, on by default on CUDA): a step is launched before the previous step's tokens have
reached the host, its rows fed from the previous picks still on the device, and the previous step is read
(tokens accepted, text emitted, finished requests ended) while the GPU runs this one, so the host's per-step work
no longer leaves the GPU idle between steps (SGLang's overlap scheduler). A request whose unread token is its last
by its budget gets no further row; the price is for one that the previous step ended by EOS or a stop string: one
more row computed and dropped (its slab holds the whole answer budget, so the row fits), and a slab is returned to
the pool only once the steps that may still write it have run. Questions admitted while answers run ride in the
step (`prefill_with_decode`) and their first tokens are read with it. Steps that need the tokens on the host
first (log-probabilities) read the previous step before they launch.

Admission reserves a request's whole sequence (context + question + max_new_tokens) in one slab, so a running
request never needs more memory and none is ever preempted; a request the pool cannot hold yet waits at the
head of the line (first come, first served: nothing behind it overtakes it, so a long request cannot starve).
A request that could never fit (longer than the model's context or than the whole pool) is refused by `add`.

The scheduler decides who is admitted and what runs together; `SlabPrefill` (slab_prefill.py) does the stitching
and prefilling into slabs; `BatchRequest` (batch_request.py) is one request's inputs, state and result.

Threading: the scheduler belongs to one thread (the engine loop, the GPU's one owner). `cancel` only sets a flag
the next step acts on, so it may be called from anywhere; `add` and `step` from the loop's thread only.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from service.engine import batching_defaults
from service.engine.batch_decode import BatchDecoder, DecodeRows, StepFeed
from service.engine.batch_graph import BatchGraphs
from service.engine.batch_request import BatchRequest, RequestStatus
from service.engine.detokenize import IncrementalDetokenizer
from service.engine.engine import (
    GenerationMode,
    StitchEngine,
    Stopwatch,
    check_request,
    stage_setter,
)
from service.engine.kv_pool import KVPool, Slab
from service.engine.sampling import Sampler, TokenLogprobs, logprobs_rows, pick_rows, pick_rows_on_device
from service.engine.slab_prefill import SlabPrefill

log = logging.getLogger(__name__)

DEFAULT_MAX_BATCH = batching_defaults.MAX_BATCH
STEP_PHASES = ("admit", "prefill", "decode", "emit")


class QueueFullError(RuntimeError):
    """The waiting line is at its limit; the caller should refuse the request (HTTP 503/429)."""


@dataclass
class _InFlight:
    """Picks queued on the device but not read yet — a decode step's, the first tokens of requests admitted
    together, or both (questions piggybacked on the step) — their host copy, and the slabs to return to the pool
    once this work has run (their requests ended while it, or work queued before it, could still write them)."""

    batch: list[BatchRequest]
    picks: torch.Tensor  # [B] int64 on the device
    host: torch.Tensor  # their copy on the host (pinned on CUDA), valid once `copied` has passed
    copied: Any  # torch.cuda.Event on CUDA; None where the copy was synchronous
    first_from: int  # rows from here on are first tokens (0: an admission's; len(batch): none, a plain step)
    watch: Stopwatch | None = None  # what timed the first tokens' stages
    free_after: list[Slab] = field(default_factory=list)

    def tokens(self) -> list[int]:
        """The picks on the host, waiting for the step (and the copy) to finish."""
        if self.copied is not None:
            self.copied.synchronize()
        tokens: list[int] = self.host.tolist()  # int64: Python ints
        return tokens


class Scheduler:
    """Waiting and running requests over one KV pool; `step()` admits, decodes once, postprocesses."""

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
    ) -> None:
        """`cuda_graphs`: decode through `BatchGraphs` (CUDA, flash_varlen or sdpa_gather attention only).
        `prefill_chunk`: a naive request's prompt longer than this many tokens is prefilled in chunks, at most
        this many tokens per step over all such requests (oldest first), between the running answers' decode
        steps, instead of stalling them for its whole prefill (0: never).
        `batch_prefill_min`: when at least this many turbo requests are admitted in one step, their questions are
        prefilled together in one batched forward instead of one prefill each, and the naive chunks of a step run
        as one batched forward too (0: never, and one naive chunk per step).
        `prefill_with_decode`: where the batched forward runs (`batch_prefill_min` > 0 and it pays on the device),
        the turbo questions admitted while answers are running are prefilled in the same forward as the running
        answers' decode step (`BatchDecoder.mixed`: each running answer one new token through the decode step's
        attention, each question its own tokens through the extend's), where a mixed step holds them (on CUDA a
        captured shape, `MixedGraphs`; more or longer questions are prefilled apart): one pass over the weights
        instead of a prefill and then a decode step (Sarathi-Serve's piggybacking). Overlapped like any step: the
        questions' first tokens are read with it. Through the gateway on an H100 at 32 clients: tokens/s +2 to
        +8 % in paired runs (docs/benchmarks.md §10.11).
        `overlap`: launch each decode step before reading the previous one (see the module's docstring); it pays
        where the device runs asynchronously to the host (CUDA) and changes no request's tokens.
        `overlap_admissions` (with `overlap`): admitted requests' first tokens stay on the device too, fed to the
        next step and read while it runs; False reads each at its admission (benchmarks compare the two)."""
        if prefill_chunk < 0 or batch_prefill_min < 0:
            raise ValueError("prefill_chunk and batch_prefill_min must be >= 0")
        self.prefill_chunk = prefill_chunk
        self.batch_prefill_min = batch_prefill_min
        if max_batch <= 0:
            raise ValueError("max_batch must be positive")
        self.engine = engine
        self.pool = pool
        self.max_batch = max_batch
        self.max_waiting = max_waiting
        self.decoder = BatchDecoder(engine.forward, pool, attention)
        # A step's rows may feed from a decode step and the admitted requests' first tokens, both unread.
        self.graphs = BatchGraphs(self.decoder, 2 * max_batch) if cuda_graphs else None
        self.overlap = overlap
        self.overlap_admissions = overlap_admissions
        self._inflight: deque[_InFlight] = deque()  # launched decode steps not read yet, oldest first
        # Stitch and prefill into slabs; the batched prefill replays its own graphs on CUDA.
        mixed_picks = 2 * max_batch if prefill_with_decode else 0
        self.slabs = SlabPrefill(engine, self.decoder, cuda_graphs, batch_prefill_min, mixed_picks)
        self._max_tokens = pool.slots - pool.used_slots  # what one request may ever hold (the graphs keep a slot)
        self.waiting: deque[BatchRequest] = deque()
        self.running: deque[BatchRequest] = deque()
        self.prefilling: deque[BatchRequest] = deque()  # admitted naive requests whose prompt is prefilled in chunks
        self.last_batch = 0  # requests in the last decode step (0: the step decoded nothing)
        self.prefilled_together = 0  # requests whose question went through a batched prefill (tests, benchmarks)
        self.prefill_with_decode = prefill_with_decode
        self.prefilled_with_decode = 0  # of those, the ones prefilled in a decode step's forward
        self._questions: list[BatchRequest] = []  # stitched this step, prefilled in its decode step's forward
        self._question_watch: Stopwatch | None = None  # times their stages
        # Wall seconds spent per phase of `step` since start (the engine's utilisation, exported as a metric):
        # admit (fetch, stitch, question prefill), prefill (naive chunks), decode (the batched step and the pick,
        # which waits for the GPU), emit (detokenize and hand the text to the listeners).
        self.busy_s = dict.fromkeys(STEP_PHASES, 0.0)
        self._eos = engine.eos_ids()

    # ---- the public loop -----------------------------------------------------------------------------------

    def add(self, request: BatchRequest) -> None:
        """Queue a request; raises ValueError when it can never run, QueueFullError when the line is full."""
        request.chunk_ready = check_request(self.engine, request.prompt, request.chunk_kv, request.chunk_ready)
        need = request.tokens_needed
        if need > self.engine.spec.max_context:
            raise ValueError(f"sequence of {need} tokens exceeds the model's context of {self.engine.spec.max_context}")
        if need > self._max_tokens:
            raise ValueError(f"a request of {need} tokens can never fit a KV pool of {self._max_tokens}")
        if self.max_waiting is not None and len(self.waiting) >= self.max_waiting:
            raise QueueFullError(f"{len(self.waiting)} requests already wait")
        request.added_at = time.perf_counter()
        self.waiting.append(request)

    def cancel(self, request: BatchRequest) -> None:
        """Stop a request at the next step (its slab is freed there); safe from any thread."""
        request.cancelled = True

    def step(self) -> list[BatchRequest]:
        """One iteration: reap cancelled, admit, one batched decode step; returns the requests finished in it."""
        busy, began = self.busy_s, time.perf_counter()
        finished = self._reap_cancelled()
        finished += self._admit()
        admitted = time.perf_counter()
        busy["admit"] += admitted - began
        if self.prefilling:
            # A naive chunk's time is taken synchronously: read what is queued before it first, so the first
            # tokens of the questions just admitted go out now, not after the chunk (~35 ms at 1,024 tokens).
            # (`_read` counts its own waits.)
            finished += self.drain()
        chunk_began = time.perf_counter()
        finished += self._prefill_chunk()
        busy["prefill"] += time.perf_counter() - chunk_began
        finished += self._decode_step()
        return finished

    def drain(self) -> list[BatchRequest]:
        """Read every launched decode step and unread first token (before work that must not overlap them);
        returns the requests that ended."""
        finished: list[BatchRequest] = []
        while self._inflight:
            finished += self._read(self._inflight.popleft())
        return finished

    def warm(self, tokens: int) -> None:
        """Capture the decode step's graphs for live lengths up to `tokens` and every batched-prefill graph now
        (server start), so no capture happens while answers are served."""
        if self.graphs is not None:
            self.graphs.warm(tokens)
        self.slabs.warm()
        self.slabs.warm_mixed(tokens)

    def finish_unstarted(self, request: BatchRequest, error: BaseException) -> None:
        """Report a request that never entered the line (`add` refused it) as failed, through `on_finish`."""
        self._fail(request, error)

    def fail_all(self, error: BaseException) -> list[BatchRequest]:
        """End every request with `error` (a step itself failed: the device state of the batch is unknown)."""
        failed = [*self.waiting, *self.prefilling, *self.running, *self._questions]
        self._questions = []
        stale, self._inflight = list(self._inflight), deque()  # unread: the device's state is unknown
        for step in stale:
            for slab in step.free_after:
                self.pool.free(slab)
        for request in failed:
            self._fail(request, error)
        return failed

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running or self._inflight or self._questions)

    def run_until_idle(self) -> None:
        """Step until nothing waits or runs (offline use and tests)."""
        while self.has_work():
            self.step()

    # ---- schedule ------------------------------------------------------------------------------------------

    def _reap_cancelled(self) -> list[BatchRequest]:
        done = [r for r in (*self.waiting, *self.prefilling, *self.running) if r.cancelled]
        for request in done:
            self._finish(request, "cancelled")
        return done

    def _admit(self) -> list[BatchRequest]:
        """Admit from the head of the line while the batch and the pool have room; returns those that already
        finished (after their first token, or failing). Turbo questions admitted together are prefilled in one
        batched forward (`_prefill_together`) when there are at least `batch_prefill_min` of them."""
        finished: list[BatchRequest] = []
        admitted: list[BatchRequest] = []
        while self.waiting and len(self.running) + len(self.prefilling) + len(admitted) < self.max_batch:
            request = self.waiting[0]
            if not self.pool.can_allocate(request.tokens_needed):
                break
            self.waiting.popleft()
            if not self._begin(request):
                finished.append(request)
            elif self._chunked(request):
                self.prefilling.append(request)
            else:
                admitted.append(request)
        together = [r for r in admitted if self._joins_batched_prefill(r)]
        with_decode = self._prefills_with_decode(together)
        if not self.slabs.batched or (len(together) < self.batch_prefill_min and not with_decode):
            together = []
        for request in admitted:
            if request not in together:
                self._start_admitted(request, finished)
        if together and with_decode:
            self._question_watch = self._watch()
            stitched = self._stitched(together, finished, self._question_watch)
            self._questions = self._decoding(stitched, finished)
        elif together:
            finished += self._prefill_together(together)
        return finished

    def _prefills_with_decode(self, questions: Sequence[BatchRequest]) -> bool:
        """Whether this step's admitted `questions` go into its decode step's forward: answers are running (so the
        step runs), the batched forward is what the device runs (see `SlabPrefill.batched`), a mixed step holds
        them, and no naive chunk runs before the step: it is timed synchronously, so a question riding in the
        step would wait for the chunk (~35 ms a 1,024-token chunk on an H100; TTFT at 8 clients of both modes
        57 → 104 ms, docs/benchmarks.md §10.11), where prefilled apart its first token is read before it."""
        if not (questions and self.prefill_with_decode and self.slabs.batched and self.batch_prefill_min > 0):
            return False
        return bool(self.running) and not self.prefilling and self.slabs.mixes(len(self.running), questions)

    def _joins_batched_prefill(self, request: BatchRequest) -> bool:
        # Recompute needs its own eager pass between stitch and question; keep it on the one-request path.
        return request.mode is GenerationMode.TURBO and not request.recompute.active and bool(request.prompt.question)

    def _start_admitted(self, request: BatchRequest, finished: list[BatchRequest]) -> None:
        """Prefill one admitted request alone and pick its first token."""
        watch = self._watch()
        try:
            logits = self.slabs.prefill_alone(request, request.buffer, watch)
        except Exception as err:  # one request's bad input must not take the batch down
            self._fail(request, err)
            finished.append(request)
            return
        finished += self._first_tokens_of([request], logits.unsqueeze(0), watch)

    def _watch(self) -> Stopwatch:
        """Times an admission's stages: deferred where steps overlap on CUDA (settled at the first token), so
        timing a stitch never stalls the GPU."""
        return Stopwatch(self.engine.spec.device, deferred=self.overlap and self.overlap_admissions)

    def _prefill_together(self, group: list[BatchRequest]) -> list[BatchRequest]:
        """Stitch each request's chunks into its slab, then prefill every question in one batched forward
        (`BatchDecoder.extend`); returns the requests that finished (failed, or done at their first token)."""
        finished: list[BatchRequest] = []
        watch = self._watch()
        stitched = self._stitched(group, finished, watch)
        return finished + self._prefill_stitched(stitched, watch)

    def _prefill_stitched(self, stitched: list[BatchRequest], watch: Stopwatch) -> list[BatchRequest]:
        """Prefill the questions of requests stitched into their slabs in one batched forward; returns those
        that finished."""
        if not stitched:
            return []
        try:
            logits = self.slabs.extend(stitched)
        except Exception as err:  # the forward failed for all of them: their slabs' state is unknown
            log.exception("batched question prefill of %d requests failed", len(stitched))
            for request in stitched:
                self._fail(request, err)
            return stitched
        # Each waited for the whole group's prefill: that is its share of the TTFT.
        watch.lap(_set_stage(stitched, "prefill_ms"))
        self.prefilled_together += len(stitched)
        return self._first_tokens_of(stitched, logits, watch)

    def _stitched(
        self, group: list[BatchRequest], finished: list[BatchRequest], watch: Stopwatch
    ) -> list[BatchRequest]:
        """Each request's chunks stitched into its slab; those that failed go to `finished`. Each request's
        stitch time is the group's (every member waits for all of it)."""
        stitched = []
        for request in group:
            try:
                self.slabs.stitch_into_slab(request)
                stitched.append(request)
            except Exception as err:  # one request's blocks (a bad file, say) fail that request alone
                self._fail(request, err)
                finished.append(request)
        watch.lap(_set_stage(stitched, "stitch_ms"))
        return stitched

    def _chunked(self, request: BatchRequest) -> bool:
        return (
            self.prefill_chunk > 0
            and request.mode is GenerationMode.NAIVE
            and request.result.prompt_tokens > self.prefill_chunk
        )

    def _begin(self, request: BatchRequest) -> bool:
        """Give the request its slab (and its chunk KV, via `on_admit`); False when that failed (it is finished)."""
        request.queue_ms = (time.perf_counter() - request.added_at) * 1e3
        request.status = RequestStatus.RUNNING
        request.slab = self.pool.allocate(request.tokens_needed)
        request.kv = self.pool.buffer(request.slab)
        try:
            if request.on_admit is not None:
                request.on_admit(request)
                request.chunk_ready = check_request(self.engine, request.prompt, request.chunk_kv, request.chunk_ready)
        except Exception as err:  # one request's failure (its KV index away, say) must not take the batch down
            self._fail(request, err)
            return False
        return True

    def _prefill_chunk(self) -> list[BatchRequest]:
        """Up to `prefill_chunk` tokens of the chunked naive prefills, oldest first (the running answers decode
        between steps); returns the requests that finished (error, or already done at their first token). Where
        the batched prefill pays, every request's chunk of this step runs in one batched forward (through its CUDA
        graphs on CUDA); elsewhere one chunk of the oldest runs alone."""
        if not self.prefilling:
            return []
        if not self.slabs.batched:
            return self._prefill_chunk_alone(self.prefilling[0])
        return self._prefill_chunks_together()

    def _prefill_chunk_alone(self, request: BatchRequest) -> list[BatchRequest]:
        ids = request.prompt.joined()
        begin = request.buffer.length
        end = min(len(ids), begin + self.prefill_chunk)
        watch = Stopwatch(self.engine.spec.device)
        try:
            logits = self.slabs.chunk_alone(request, ids[begin:end], begin)
        except Exception as err:
            self._fail(request, err)
            return [request]
        request.result.timings.prefill_ms += watch.lap_ms()
        return self._after_chunk(request, logits, end == len(ids))

    def _prefill_chunks_together(self) -> list[BatchRequest]:
        """This step's chunks (the oldest requests' next tokens, `prefill_chunk` in all) in one batched forward."""
        group, chunks, budget = [], [], self.prefill_chunk
        for request in self.prefilling:
            ids, begin = request.prompt.joined(), request.buffer.length
            take = min(len(ids) - begin, budget)
            group.append(request)
            chunks.append(list(ids[begin : begin + take]))
            budget -= take
            if budget == 0:
                break
        watch = Stopwatch(self.engine.spec.device)
        try:
            logits = self.slabs.extend(group, chunks)
        except Exception as err:  # the forward failed for all of them: their slabs' state is unknown
            log.exception("batched prefill of %d naive chunks failed", len(group))
            for request in group:
                self._fail(request, err)
            return group
        spent = watch.lap_ms()
        finished = []
        for row, request in enumerate(group):
            request.result.timings.prefill_ms += spent
            done = request.buffer.length == request.result.prompt_tokens
            finished += self._after_chunk(request, logits[row], done)
        return finished

    def _after_chunk(self, request: BatchRequest, logits: torch.Tensor, done: bool) -> list[BatchRequest]:
        """A chunk of `request`'s prompt went in: at the end of the prompt its first token is picked and it runs."""
        if not done:
            return []
        self.prefilling.remove(request)
        if self._first_token(request, logits):
            self.running.append(request)
            return []
        return [request]

    def _first_tokens_of(self, group: list[BatchRequest], logits: torch.Tensor, watch: Stopwatch) -> list[BatchRequest]:
        """The first tokens of requests prefilled together (logits [len(group), vocab]); returns those that
        ended. Overlapped (and none asks for log-probabilities, which need the logits now), they are picked on the
        device and the requests run at once: the next step feeds the picks from there, and they are read (and
        emitted) while it runs. Otherwise each is picked and accepted here."""
        if not (self.overlap_admissions and self._overlaps(group)):
            ended = []
            for row, request in enumerate(group):
                if self._first_token(request, logits[row], watch):
                    self.running.append(request)
                else:
                    ended.append(request)
            return ended
        finished: list[BatchRequest] = []
        started = self._decoding(group, finished)
        if not started:
            return finished
        if len(started) < len(group):
            kept = {id(r) for r in started}
            logits = logits[[row for row, r in enumerate(group) if id(r) in kept]]
        try:
            picks = pick_rows_on_device(logits, [r.running_sampler for r in started])
        except Exception as err:
            for request in started:
                self._fail(request, err)
            return finished + started
        self._inflight.append(_copy_to_host(started, picks, 0, watch))
        self.running.extend(started)
        return finished

    def _decoding(self, group: list[BatchRequest], finished: list[BatchRequest]) -> list[BatchRequest]:
        """`group` with each request's sampler and detokenizer started; one that fails to start ends alone (in
        `finished`), not the forward it was to share."""
        started = []
        for request in group:
            try:
                self._start_decoding(request)
                started.append(request)
            except Exception as err:
                self._fail(request, err)
                finished.append(request)
        return started

    def _start_decoding(self, request: BatchRequest) -> None:
        """The request's sampler and detokenizer, made once (a question riding in a step has them from its
        admission; nothing has been drawn or decoded before its first token)."""
        if request.sampler is not None:
            return
        request.sampler = Sampler(request.sampling, self.engine.spec.device)
        request.detok = IncrementalDetokenizer(self.engine.tokenizer, request.sampling.stop)

    def _first_token(self, request: BatchRequest, logits: torch.Tensor, watch: Stopwatch | None = None) -> bool:
        """Pick and accept the request's first token here; False when that already ended it."""
        try:
            self._start_decoding(request)
            first = request.running_sampler.pick(logits)
            logprobs = self._logprobs([request], logits.unsqueeze(0), [first])[0]
        except Exception as err:
            self._fail(request, err)
            return False
        self._first_token_read(request, watch)
        return self._accept(request, first, logprobs)

    def _first_token_read(self, request: BatchRequest, watch: Stopwatch | None) -> None:
        """The request's first token reached the host: its TTFT, and its stage times where they were deferred.
        Deferred times are the GPU's own, so the wait for the work queued before the request's (the running
        step) moves into its queue time, as it was when every stage waited for the device."""
        request.first_token_at = time.perf_counter()
        timings = request.result.timings
        timings.ttft_ms = (request.first_token_at - request.added_at) * 1e3
        if watch is not None and watch.deferred:
            watch.settle()
            request.queue_ms = max(request.queue_ms, timings.ttft_ms - timings.stages_ms)

    # ---- run -----------------------------------------------------------------------------------------------

    def _decode_step(self) -> list[BatchRequest]:
        """One batched decode step over the running requests; returns those that ended. Overlapped, the step is
        launched first and the previous one read while it runs; otherwise the previous one (if any) is read, then
        this one runs and is read at once."""
        questions, watch = self._questions, self._question_watch
        self._questions, self._question_watch = [], None
        if not self._step_overlaps(questions):
            return self._read_then_step(questions, watch)
        finished: list[BatchRequest] = []
        batch = self._continuing()
        if questions and not self._rides(batch, questions):
            finished += self._prefill_apart(questions, watch)
            questions, batch = [], self._continuing()
        self.last_batch = len(batch)
        if batch:
            self._launch(batch, questions, watch)
        while len(self._inflight) > (1 if batch else 0):  # the step just launched runs on
            finished += self._read(self._inflight.popleft())
        return finished

    def _read_then_step(self, questions: list[BatchRequest], watch: Stopwatch | None) -> list[BatchRequest]:
        """Not overlapped: read everything in flight, then one step (with `questions` in it) read at once."""
        finished = self.drain()
        if questions and not self._rides(list(self.running), questions):
            finished += self._prefill_apart(questions, watch) + self.drain()
            questions = []
        self.last_batch = len(self.running)
        return finished + (self._decode(questions, watch) if self.running else [])

    def _rides(self, batch: list[BatchRequest], questions: list[BatchRequest]) -> bool:
        """Whether `questions` can still ride in a step over `batch`: it has rows (every answer may have ended, or
        have its last token unread, since admission) and a mixed step holds them beside those rows (requests
        prefilled alone in the same admission may have joined the running ones)."""
        return bool(batch) and self.slabs.mixes(len(batch), questions)

    def _prefill_apart(self, questions: list[BatchRequest], watch: Stopwatch | None) -> list[BatchRequest]:
        """Questions stitched to ride in a step that has no rows after all, prefilled in their own forward."""
        assert watch is not None
        return self._prefill_stitched(questions, watch)

    def _continuing(self) -> list[BatchRequest]:
        """The running requests that need a row in the next step: not those whose unread token is their last by
        their budget (`max_new_tokens`) — reading it will end them, and a row for them would be computed and
        dropped. (One ended by EOS or a stop string cannot be known before the read: it gets that row.)"""
        unread = self._unread()
        return [
            r for r in self.running if id(r) not in unread or len(r.result.token_ids) + 1 < r.sampling.max_new_tokens
        ]

    def _unread(self) -> dict[int, int]:
        """Per request (by id) with a token still unread on the device, its index in the unread picks, record
        after record (a request is in one unread record at most: all but the newest step are read before the
        next launch, and first tokens are of requests admitted since)."""
        unread: dict[int, int] = {}
        offset = 0
        for record in self._inflight:
            unread.update((id(r), offset + row) for row, r in enumerate(record.batch))
            offset += len(record.batch)
        return unread

    def _step_overlaps(self, questions: Sequence[BatchRequest]) -> bool:
        """Whether this step (over the running requests, with `questions` prefilled in it) is launched before the
        previous one is read; its questions' first tokens then stay on the device too (`overlap_admissions`)."""
        return self._overlaps([*self.running, *questions]) and (self.overlap_admissions or not questions)

    def _overlaps(self, rows: Sequence[BatchRequest]) -> bool:
        """Whether picks of `rows` may stay unread on the device: overlap is on and none asks for
        log-probabilities (computed from the logits, which the next forward overwrites)."""
        return self.overlap and all(r.sampling.logprobs is None for r in rows)

    def _launch(self, batch: list[BatchRequest], questions: list[BatchRequest], watch: Stopwatch | None) -> None:
        """Queue a decode step over `batch` (with `questions` prefilled in its forward, their stages timed by
        `watch`) and its picks' copy to the host, without waiting for either. A row whose last token is still
        unread on the device (a pick of the previous step, or a first token) is fed from there; the others feed
        their host token. The questions' first tokens are picked with the step's and read with them."""
        began = time.perf_counter()
        feed = self._feed(batch)
        rows = [*batch, *questions]
        try:
            if questions:
                assert watch is not None
                logits = self._mixed_logits(batch, questions, feed, watch)
            else:
                logits = self._decode_logits(batch, feed)
            picks = pick_rows_on_device(logits, [r.running_sampler for r in rows])
            self._inflight.append(_copy_to_host(rows, picks, len(batch), watch))
            self.running.extend(questions)
        except Exception as err:  # the step failed for the whole batch: end it, keep the loop serving
            log.exception("batched decode step over %d requests failed", len(rows))
            for request in rows:
                self._fail(request, err)
        self.busy_s["decode"] += time.perf_counter() - began

    def _mixed_logits(
        self, batch: Sequence[BatchRequest], questions: Sequence[BatchRequest], feed: StepFeed | None, watch: Stopwatch
    ) -> torch.Tensor:
        """The decode step over `batch` with `questions` prefilled in its forward (`SlabPrefill.mixed`); logits of
        the decode rows, then each question's (their samplers started at admission). The questions' prefill time
        is the step's (every member waits for all of it)."""
        ids, positions, spans = self._rows(batch)
        logits = self.slabs.mixed((ids, positions, spans, None), feed, questions)
        for request in batch:
            request.buffer.commit(1, request.buffer.next_position + 1)
        watch.lap(_set_stage(questions, "prefill_ms"))
        self.prefilled_together += len(questions)
        self.prefilled_with_decode += len(questions)
        return logits

    def _feed(self, batch: Sequence[BatchRequest]) -> StepFeed | None:
        """Where each row of a step over `batch` finds an unread last token: its index in the unread picks."""
        unread = self._unread()
        src = tuple(unread.get(id(r), -1) for r in batch)
        if max(src, default=-1) < 0:
            return None
        records = list(self._inflight)
        picks = records[0].picks if len(records) == 1 else torch.cat([record.picks for record in records])
        return StepFeed(picks, src)

    def _read(self, step: _InFlight) -> list[BatchRequest]:
        """Wait for queued picks, return the slabs that work was the last to write, accept each live row's token
        (a first token starts its request's stream); returns the requests it ended."""
        began = time.perf_counter()
        try:
            tokens = step.tokens()
        except Exception as err:
            log.exception("batched decode step over %d requests failed", len(step.batch))
            live = [r for r in step.batch if not r.finished]
            for request in live:
                self._fail(request, err)
            return live
        finally:
            for slab in step.free_after:
                self.pool.free(slab)
        read = time.perf_counter()
        self.busy_s["admit" if step.first_from == 0 else "decode"] += read - began
        # A row whose request ended before this step was read (the previous step's token, a cancel) is dropped.
        pairs = enumerate(zip(step.batch, tokens, strict=True))
        rows = [(row, r, token) for row, (r, token) in pairs if not r.finished]
        for row, request, _ in rows:
            if row >= step.first_from:
                self._first_token_read(request, step.watch)
        finished = [r for _, r, token in rows if not self._accept(r, token)]
        self.busy_s["emit"] += time.perf_counter() - read
        return finished

    def _decode(self, questions: list[BatchRequest], watch: Stopwatch | None) -> list[BatchRequest]:
        """One batched step over every running request (and the `questions` admitted to prefill with it, their
        stages timed by `watch`), read at once; returns those it finished."""
        batch = list(self.running)
        began = time.perf_counter()
        try:
            tokens, logprobs, question_logits = self._step_tokens(batch, questions, watch)
        except Exception as err:  # the step failed for the whole batch: end it, keep the loop serving
            log.exception("batched decode step over %d requests failed", len(batch) + len(questions))
            for request in (*batch, *questions):
                self._fail(request, err)
            return [*batch, *questions]
        decoded = time.perf_counter()
        self.busy_s["decode"] += decoded - began
        # `_accept` finishes (and takes out of `running`) the requests a token ends.
        rows = zip(batch, tokens, logprobs, strict=True)
        finished = [r for r, token, lp in rows if not self._accept(r, token, lp)]
        finished += self._first_tokens(questions, question_logits, watch)
        self.busy_s["emit"] += time.perf_counter() - decoded
        return finished

    def _first_tokens(
        self, questions: Sequence[BatchRequest], logits: torch.Tensor | None, watch: Stopwatch | None
    ) -> list[BatchRequest]:
        """The questions prefilled in the decode step: each one's first token; returns those it already ended."""
        finished = []
        for row, request in enumerate(questions):
            assert logits is not None
            if self._first_token(request, logits[row], watch):
                self.running.append(request)
            else:
                finished.append(request)
        return finished

    def _step_tokens(
        self, batch: Sequence[BatchRequest], questions: Sequence[BatchRequest], watch: Stopwatch | None
    ) -> tuple[list[int], list[TokenLogprobs | None], torch.Tensor | None]:
        """Feed every request its last token, one batched step; the next token of each (and its
        log-probabilities where the request asks for them). With `questions`, they are prefilled in the step's
        forward (`_mixed_logits`); their rows' logits come back too."""
        if questions:
            assert watch is not None
            both = self._mixed_logits(batch, questions, None, watch)
            logits, question_logits = both[: len(batch)], both[len(batch) :]
        else:
            logits, question_logits = self._decode_logits(batch), None
        tokens = pick_rows(logits, [r.running_sampler for r in batch])
        return tokens, self._logprobs(batch, logits, tokens), question_logits

    def _decode_logits(self, batch: Sequence[BatchRequest], feed: StepFeed | None = None) -> torch.Tensor:
        """The decode step proper: each request's last token (or, with `feed`, the previous step's pick still on
        the device) through the step's graph (or eagerly)."""
        ids, positions, spans = self._rows(batch)
        if self.graphs is not None:
            logits = self.graphs.step(ids, positions, spans, feed)
        else:
            logits = self.decoder.step(DecodeRows.build(ids, positions, spans, self.engine.spec.device, feed))
        for request in batch:
            request.buffer.commit(1, request.buffer.next_position + 1)
        return logits

    @staticmethod
    def _logprobs(
        batch: Sequence[BatchRequest], logits: torch.Tensor, tokens: Sequence[int]
    ) -> list[TokenLogprobs | None]:
        """Per row, the picked token's log-probabilities, for the rows that ask (nothing computed otherwise)."""
        wanted = [row for row, r in enumerate(batch) if r.sampling.logprobs is not None]
        out: list[TokenLogprobs | None] = [None] * len(batch)
        if not wanted:
            return out
        rows = logits if len(wanted) == len(batch) else logits[wanted]
        top = [batch[row].sampling.logprobs or 0 for row in wanted]
        for row, found in zip(wanted, logprobs_rows(rows, [tokens[row] for row in wanted], top), strict=True):
            out[row] = found
        return out

    def _rows(self, batch: Sequence[BatchRequest]) -> tuple[list[int], list[int], list[tuple[int, int]]]:
        """Each request's token to feed, its position, and its slab's (start, live slots after this step)."""
        ids, positions, spans = [], [], []
        for request in batch:
            assert request.slab is not None
            slot = request.buffer.reserve(1)  # the slab always has room: it holds the whole answer budget
            ids.append(request.last_token)
            positions.append(request.buffer.next_position)
            spans.append((request.slab.start, slot + 1))
        return ids, positions, spans

    # ---- postprocess ---------------------------------------------------------------------------------------

    def _accept(self, request: BatchRequest, token: int, logprobs: TokenLogprobs | None = None) -> bool:
        """Append a token and emit its text, as `GenerationStream` does; False when it ended the request."""
        detok = request.detok
        assert detok is not None
        request.result.token_ids.append(token)
        if token in self._eos and not request.sampling.ignore_eos:
            self._finish(request, "stop")
            return False
        if logprobs is not None:  # before the text goes out, so a listener finds the token's entry with it
            request.result.logprobs.append(logprobs)
        self._emit(request, detok.push(token))
        if detok.stopped:
            self._finish(request, "stop")
        elif len(request.result.token_ids) == request.sampling.max_new_tokens:
            self._finish(request, "length")
        else:
            request.last_token = token
            return True
        return False

    def _fail(self, request: BatchRequest, error: BaseException) -> None:
        """End a request with `error` (finish reason "error")."""
        request.error = error
        self._finish(request, "error")

    def _finish(self, request: BatchRequest, reason: str) -> None:
        """End a request wherever it is: free its slab at once, flush its text, report it."""
        if request in self.waiting:
            self.waiting.remove(request)
        if request in self.running:
            self.running.remove(request)
        if request in self.prefilling:
            self.prefilling.remove(request)
        if request.slab is not None:
            self._release(request.slab)
            request.slab, request.kv = None, None
        detok = request.detok
        if detok is not None:
            if reason in ("stop", "length"):
                self._emit(request, detok.flush())
            request.result.text = detok.text
        if request.first_token_at:
            request.result.timings.decode_ms = (time.perf_counter() - request.first_token_at) * 1e3
        request.result.finish_reason = reason
        request.status = RequestStatus.FINISHED
        if request.on_finish is not None:
            request.on_finish(request)

    def _release(self, slab: Slab) -> None:
        """Return a slab to the pool, once the launched steps that may still write it have run: a step launched
        before its request ended computes one more row into it."""
        if self._inflight:
            self._inflight[-1].free_after.append(slab)
        else:
            self.pool.free(slab)

    @staticmethod
    def _emit(request: BatchRequest, delta: str) -> None:
        if not delta or request.on_text is None:
            return
        try:
            request.on_text(delta)
        except Exception:  # the consumer is gone (a closed stream): treat it as a disconnect
            log.warning("text callback failed; cancelling the request", exc_info=True)
            request.cancelled = True


def _copy_to_host(
    batch: list[BatchRequest], picks: torch.Tensor, first_from: int, watch: Stopwatch | None = None
) -> _InFlight:
    """The record of queued picks, their host copy queued behind them (pinned memory and an event on CUDA);
    rows from `first_from` on are first tokens, whose stages `watch` timed."""
    if picks.device.type != "cuda":
        return _InFlight(batch, picks, picks, None, first_from, watch)
    host = torch.empty(picks.shape, dtype=picks.dtype, pin_memory=True)
    host.copy_(picks, non_blocking=True)
    copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
    copied.record()
    return _InFlight(batch, picks, host, copied, first_from, watch)


def _set_stage(group: Sequence[BatchRequest], stage: str) -> Callable[[float], None]:
    """A `Stopwatch.lap` setter giving every request of `group` the same stage time (they waited for all of it)."""

    setters = [stage_setter(request.result.timings, stage) for request in group]

    def set_ms(ms: float) -> None:
        for setter in setters:
            setter(ms)

    return set_ms
