"""Continuous batching of stitched requests: a nano-vllm-shaped scheduler over one `KVPool`.

`Scheduler.step()` reads as the algorithm: drop cancelled requests, admit waiting ones (while fewer than
`max_batch` run and the pool has a slab for them: stitch their chunk KV into the slab and prefill the question,
or prefill the whole joined prompt in the naive mode), run ONE batched decode step over every running request,
then postprocess (append each token, emit its text, finish on EOS / max tokens / a stop string, free the slab
at once). Requests join and leave at any step.

Admission reserves a request's whole sequence (context + question + max_new_tokens) in one slab, so a running
request never needs more memory and none is ever preempted; a request the pool cannot hold yet waits at the
head of the line (first come, first served: nothing behind it overtakes it, so a long request cannot starve).
A request that could never fit (longer than the model's context or than the whole pool) is refused by `add`.

Threading: the scheduler belongs to one thread (the engine loop, the GPU's one owner). `cancel` only sets a flag
the next step acts on, so it may be called from anywhere; `add` and `step` from the loop's thread only.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from enum import StrEnum

import torch

from service.engine import batching_defaults
from service.engine.attention import FLASH_VARLEN
from service.engine.batch_decode import BatchDecoder, DecodeRows, ExtendRows
from service.engine.batch_graph import BatchGraphs
from service.engine.detokenize import IncrementalDetokenizer
from service.engine.engine import (
    GenerationMode,
    GenerationResult,
    StitchEngine,
    Stopwatch,
    TurboPrefill,
    check_request,
)
from service.engine.extend_graph import ExtendGraphs
from service.engine.kv_buffer import KVBuffer
from service.engine.kv_layout import KVBlock
from service.engine.kv_pool import KVPool, Slab
from service.engine.prompt import PromptIds
from service.engine.recompute_spec import NO_RECOMPUTE, RecomputeSpec
from service.engine.sampling import Sampler, SamplingParams, TokenLogprobs, logprobs_rows, pick_rows
from service.engine.stitch import BlockReady, PositionMode

log = logging.getLogger(__name__)

DEFAULT_MAX_BATCH = batching_defaults.MAX_BATCH
STEP_PHASES = ("admit", "prefill", "decode", "emit")

TextSink = Callable[[str], None]


class RequestStatus(StrEnum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class QueueFullError(RuntimeError):
    """The waiting line is at its limit; the caller should refuse the request (HTTP 503/429)."""


class BatchRequest:
    """One request through the scheduler: its inputs, its slab and decoding state while running, its result.

    `on_text(delta)` is called with each text delta and `on_finish(request)` once at the end, both on the
    scheduler's thread; `on_admit(request)` at admission, before the prefill. `result.finish_reason` ends as
    "length", "stop", "cancelled" or "error" (`error` then holds the exception).
    """

    def __init__(
        self,
        prompt: PromptIds,
        sampling: SamplingParams,
        mode: GenerationMode | str = GenerationMode.TURBO,
        positions: PositionMode | str = PositionMode.REORDERED,
        chunk_kv: Sequence[KVBlock] | None = None,
        chunk_ready: Sequence[BlockReady | None] | None = None,
        on_text: TextSink | None = None,
        on_finish: Callable[[BatchRequest], None] | None = None,
        on_admit: Callable[[BatchRequest], None] | None = None,
        recompute: RecomputeSpec = NO_RECOMPUTE,
    ) -> None:
        self.prompt = prompt
        self.sampling = sampling
        self.mode = GenerationMode(mode)
        self.positions = PositionMode(positions)
        self.chunk_kv = chunk_kv
        self.chunk_ready = chunk_ready
        self.recompute = recompute  # turbo only: part of the stitched context recomputed before the question
        self.on_text = on_text
        self.on_finish = on_finish
        # Called at admission, before the prefill, on the scheduler's thread: where a server fetches the chunk
        # KV (`chunk_kv`, `chunk_ready`), so blocks occupy device memory only once the request runs.
        self.on_admit = on_admit
        self.status = RequestStatus.WAITING
        self.cancelled = False
        self.error: BaseException | None = None
        self.result = GenerationResult(prompt_tokens=len(prompt.joined()), context_tokens=prompt.context_tokens)
        self.queue_ms = 0.0  # from `add` to admission; part of `result.timings.ttft_ms`
        # State the scheduler keeps while the request runs.
        self.slab: Slab | None = None
        self.kv: KVBuffer | None = None  # over the slab
        self.sampler: Sampler | None = None
        self.detok: IncrementalDetokenizer | None = None
        self.last_token = -1  # the token the next decode step feeds
        self.added_at = 0.0
        self.first_token_at = 0.0

    @property
    def tokens_needed(self) -> int:
        """Slots the request's slab holds: the joined prompt and the answer budget (as `generate` reserves)."""
        return self.result.prompt_tokens + self.sampling.max_new_tokens

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def buffer(self) -> KVBuffer:
        assert self.kv is not None, "the request is not running"
        return self.kv

    @property
    def running_sampler(self) -> Sampler:
        assert self.sampler is not None, "the request is not running"
        return self.sampler


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
    ) -> None:
        """`cuda_graphs`: decode through `BatchGraphs` (CUDA, flash_varlen or sdpa_gather attention only).
        `prefill_chunk`: a naive request's prompt longer than this many tokens is prefilled in chunks, at most
        this many tokens per step over all such requests (oldest first), between the running answers' decode
        steps, instead of stalling them for its whole prefill (0: never).
        `batch_prefill_min`: when at least this many turbo requests are admitted in one step, their questions are
        prefilled together in one batched forward instead of one prefill each, and the naive chunks of a step run
        as one batched forward too (0: never, and one naive chunk per step)."""
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
        self.graphs = BatchGraphs(self.decoder) if cuda_graphs else None
        # The batched question prefill through graphs too, where it runs batched at all (flash on CUDA).
        capture_extend = cuda_graphs and batch_prefill_min > 0 and ExtendGraphs.fit(pool.slots)
        capture_extend = capture_extend and self._batched_prefill_pays()
        self.extend_graphs = ExtendGraphs(self.decoder) if capture_extend else None
        self._max_tokens = pool.slots - pool.used_slots  # what one request may ever hold (the graphs keep a slot)
        self.waiting: deque[BatchRequest] = deque()
        self.running: deque[BatchRequest] = deque()
        self.prefilling: deque[BatchRequest] = deque()  # admitted naive requests whose prompt is prefilled in chunks
        self.last_batch = 0  # requests in the last decode step (0: the step decoded nothing)
        self.prefilled_together = 0  # requests whose question went through a batched prefill (tests, benchmarks)
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
        finished += self._prefill_chunk()
        prefilled = time.perf_counter()
        busy["prefill"] += prefilled - admitted
        self.last_batch = len(self.running)
        if self.running:
            finished += self._decode()
        return finished

    def warm(self, tokens: int) -> None:
        """Capture the decode step's graphs for live lengths up to `tokens` and every batched-prefill graph now
        (server start), so no capture happens while answers are served."""
        if self.graphs is not None:
            self.graphs.warm(tokens)
        if self.extend_graphs is not None:
            self.extend_graphs.warm()

    def finish_unstarted(self, request: BatchRequest, error: BaseException) -> None:
        """Report a request that never entered the line (`add` refused it) as failed, through `on_finish`."""
        request.error = error
        self._finish(request, "error")

    def fail_all(self, error: BaseException) -> list[BatchRequest]:
        """End every request with `error` (a step itself failed: the device state of the batch is unknown)."""
        failed = [*self.waiting, *self.prefilling, *self.running]
        for request in failed:
            request.error = error
            self._finish(request, "error")
        return failed

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

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
        if self.batch_prefill_min == 0 or len(together) < self.batch_prefill_min or not self._batched_prefill_pays():
            together = []
        for request in admitted:
            if request not in together:
                self._start_admitted(request, finished)
        if together:
            finished += self._prefill_together(together)
        return finished

    def _joins_batched_prefill(self, request: BatchRequest) -> bool:
        # Recompute needs its own eager pass between stitch and question; keep it on the one-request path.
        return request.mode is GenerationMode.TURBO and not request.recompute.active and bool(request.prompt.question)

    def _start_admitted(self, request: BatchRequest, finished: list[BatchRequest]) -> None:
        """Prefill one admitted request alone and accept its first token."""
        try:
            logits = self._prefill(request, request.buffer)
        except Exception as err:  # one request's bad input must not take the batch down
            request.error = err
            self._finish(request, "error")
            finished.append(request)
            return
        if self._first_token(request, logits):
            self.running.append(request)
        else:
            finished.append(request)

    def _prefill_together(self, group: list[BatchRequest]) -> list[BatchRequest]:
        """Stitch each request's chunks into its slab, then prefill every question in one batched forward
        (`BatchDecoder.extend`); returns the requests that finished (failed, or done at their first token)."""
        finished: list[BatchRequest] = []
        watch = Stopwatch(self.engine.spec.device)
        stitched = []
        for request in group:
            try:
                self._stitch_into_slab(request)
                stitched.append(request)
            except Exception as err:  # one request's blocks (a bad file, say) fail that request alone
                request.error = err
                self._finish(request, "error")
                finished.append(request)
        if not stitched:
            return finished
        stitch_ms = watch.lap_ms()
        try:
            logits = self._extend(stitched)
        except Exception as err:  # the forward failed for all of them: their slabs' state is unknown
            log.exception("batched question prefill of %d requests failed", len(stitched))
            for request in stitched:
                request.error = err
                self._finish(request, "error")
            return finished + stitched
        prefill_ms = watch.lap_ms()
        self.prefilled_together += len(stitched)
        for row, request in enumerate(stitched):
            # Each waited for the whole group's stitch and prefill: that is its share of the TTFT.
            request.result.timings.stitch_ms = stitch_ms
            request.result.timings.prefill_ms = prefill_ms
            if self._first_token(request, logits[row]):
                self.running.append(request)
            else:
                finished.append(request)
        return finished

    def _stitch_into_slab(self, request: BatchRequest) -> None:
        """The request's chunks stitched into its slab. On CUDA through a leased graph's buffer, where the fused
        stitch kernel runs (it needs a contiguous buffer; a slab is a strided view of the pool), then copied into
        the slab (device to device, live slots only)."""
        engine, prompt = self.engine, request.prompt
        chunk_kv = self._chunk_kv(request)
        room = len(prompt.question) + request.sampling.max_new_tokens
        graph = engine.lease_graph(prompt.context_tokens, len(prompt.question), 0)
        if graph is None:
            engine.stitch(chunk_kv, request.positions, room, request.chunk_ready, into=request.buffer)
            return
        try:
            staged, _ = engine.stitch(
                chunk_kv, request.positions, len(prompt.question), request.chunk_ready, graph.buffer
            )
            request.buffer.copy_from(staged)
        finally:
            engine.release_graph(graph)

    def _chunk_kv(self, request: BatchRequest) -> Sequence[KVBlock]:
        """The chunks' KV as fetched at admission, or computed here when none was given (offline use, tests)."""
        if request.chunk_kv is not None:
            return request.chunk_kv
        blocks = request.prompt.blocks
        return self.engine.precompute(blocks) if blocks else []

    def _batched_prefill_pays(self) -> bool:
        """On the CPU the loop attention is the reference kernel, so one forward for all questions only saves
        work. On CUDA only with flash varlen (its start-up probe agreed): the loop there is one eager attention
        per request, slower than each question's own CUDA-graph prefill (measured, docs/benchmarks.md §10.5)."""
        return self.engine.spec.device.type == "cpu" or self.decoder.extend_backend == FLASH_VARLEN

    def _extend(self, group: Sequence[BatchRequest], new_ids: Sequence[list[int]] | None = None) -> torch.Tensor:
        """Each request's new tokens (default: its question) after its live slots, one batched forward; logits
        [len(group), vocab] of each one's last new token."""
        device = self.engine.spec.device
        tokens = new_ids if new_ids is not None else [list(r.prompt.question) for r in group]
        entries = []
        for request, ids in zip(group, tokens, strict=True):
            buffer = request.buffer
            buffer.reserve(len(ids))
            assert request.slab is not None
            entries.append((ids, buffer.next_position, request.slab.start, buffer.length))
        if self.extend_graphs is not None:
            logits = self.extend_graphs.extend(entries)
        else:
            logits = self.decoder.extend(ExtendRows.build(entries, device))
        for request, ids in zip(group, tokens, strict=True):
            request.buffer.commit(len(ids), request.buffer.next_position + len(ids))
        return logits

    def _chunked(self, request: BatchRequest) -> bool:
        return (
            self.prefill_chunk > 0
            and request.mode is GenerationMode.NAIVE
            and len(request.prompt.joined()) > self.prefill_chunk
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
            request.error = err
            self._finish(request, "error")
            return False
        return True

    def _prefill_chunk(self) -> list[BatchRequest]:
        """Up to `prefill_chunk` tokens of the chunked naive prefills, oldest first (the running answers decode
        between steps); returns the requests that finished (error, or already done at their first token). Where
        the batched prefill pays, every request's chunk of this step runs in one batched forward (through its CUDA
        graphs on CUDA); elsewhere one chunk of the oldest runs alone."""
        if not self.prefilling:
            return []
        if self.batch_prefill_min == 0 or not self._batched_prefill_pays():
            return self._prefill_chunk_alone(self.prefilling[0])
        return self._prefill_chunks_together()

    def _prefill_chunk_alone(self, request: BatchRequest) -> list[BatchRequest]:
        ids = request.prompt.joined()
        begin = request.buffer.length
        end = min(len(ids), begin + self.prefill_chunk)
        watch = Stopwatch(self.engine.spec.device)
        try:
            logits = self.engine.forward.extend(request.buffer, ids[begin:end], torch.arange(begin, end))
        except Exception as err:
            request.error = err
            self._finish(request, "error")
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
            logits = self._extend(group, chunks)
        except Exception as err:  # the forward failed for all of them: their slabs' state is unknown
            log.exception("batched prefill of %d naive chunks failed", len(group))
            for request in group:
                request.error = err
                self._finish(request, "error")
            return group
        spent = watch.lap_ms()
        finished = []
        for row, request in enumerate(group):
            request.result.timings.prefill_ms += spent
            done = request.buffer.length == len(request.prompt.joined())
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

    def _first_token(self, request: BatchRequest, logits: torch.Tensor) -> bool:
        """Pick and accept the request's first token; False when that already ended it."""
        try:
            request.sampler = Sampler(request.sampling, self.engine.spec.device)
            request.detok = IncrementalDetokenizer(self.engine.tokenizer, request.sampling.stop)
            first = request.sampler.pick(logits)
            logprobs = self._logprobs([request], logits.unsqueeze(0), [first])[0]
        except Exception as err:
            request.error = err
            self._finish(request, "error")
            return False
        request.first_token_at = time.perf_counter()
        request.result.timings.ttft_ms = (request.first_token_at - request.added_at) * 1e3
        return self._accept(request, first, logprobs)

    def _prefill(self, request: BatchRequest, buffer: KVBuffer) -> torch.Tensor:
        """Fill the slab as `generate` fills its buffer (same stitch and prefill code); logits of the last token.

        With CUDA graphs a turbo request is stitched and prefilled in a leased graph's buffer (the question
        through its prefill graph, pipelined with the copies still landing) and its live KV then copied into
        the slab: a device-to-device copy of ~0.1 ms at 8K on an H200 against the ~3x slower eager prefill."""
        engine, timings, prompt = self.engine, request.result.timings, request.prompt
        watch = Stopwatch(engine.spec.device)
        if request.mode is GenerationMode.NAIVE:
            _, logits = engine.prefill_naive(prompt, request.sampling.max_new_tokens, into=buffer)
            timings.prefill_ms = watch.lap_ms()
            return logits
        chunk_kv = self._chunk_kv(request)
        if request.chunk_kv is None:
            timings.precompute_ms = watch.lap_ms()
        extra = request.sampling.max_new_tokens
        turbo = TurboPrefill(
            chunk_kv, prompt.question, request.positions, extra, request.chunk_ready, request.recompute
        )
        graph = engine.lease_graph(prompt.context_tokens, len(prompt.question), 0)
        if graph is None:
            return engine.prefill_turbo(turbo, watch, request.result, into=buffer)[1]
        try:
            staged, logits = engine.prefill_turbo(replace(turbo, extra_tokens=0), watch, request.result, graph)
            buffer.copy_from(staged)
        finally:
            engine.release_graph(graph)
        return logits

    # ---- run -----------------------------------------------------------------------------------------------

    def _decode(self) -> list[BatchRequest]:
        """One batched step over every running request; returns those it finished."""
        batch = list(self.running)
        began = time.perf_counter()
        try:
            tokens, logprobs = self._step_tokens(batch)
        except Exception as err:  # the step failed for the whole batch: end it, keep the loop serving
            log.exception("batched decode step over %d requests failed", len(batch))
            for request in batch:
                request.error = err
                self._finish(request, "error")
            return batch
        decoded = time.perf_counter()
        self.busy_s["decode"] += decoded - began
        # `_accept` finishes (and takes out of `running`) the requests a token ends.
        rows = zip(batch, tokens, logprobs, strict=True)
        finished = [r for r, token, lp in rows if not self._accept(r, token, lp)]
        self.busy_s["emit"] += time.perf_counter() - decoded
        return finished

    def _step_tokens(self, batch: Sequence[BatchRequest]) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Feed every request its last token, one batched step; the next token of each (and its
        log-probabilities where the request asks for them)."""
        ids, positions, spans = self._rows(batch)
        if self.graphs is not None:
            logits = self.graphs.step(ids, positions, spans)
        else:
            logits = self.decoder.step(DecodeRows.build(ids, positions, spans, self.engine.spec.device))
        for request in batch:
            request.buffer.commit(1, request.buffer.next_position + 1)
        tokens = pick_rows(logits, [r.running_sampler for r in batch])
        return tokens, self._logprobs(batch, logits, tokens)

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

    def _finish(self, request: BatchRequest, reason: str) -> None:
        """End a request wherever it is: free its slab at once, flush its text, report it."""
        if request in self.waiting:
            self.waiting.remove(request)
        if request in self.running:
            self.running.remove(request)
        if request in self.prefilling:
            self.prefilling.remove(request)
        if request.slab is not None:
            self.pool.free(request.slab)
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

    @staticmethod
    def _emit(request: BatchRequest, delta: str) -> None:
        if not delta or request.on_text is None:
            return
        try:
            request.on_text(delta)
        except Exception:  # the consumer is gone (a closed stream): treat it as a disconnect
            log.warning("text callback failed; cancelling the request", exc_info=True)
            request.cancelled = True
