"""The scheduler's execution side: what a plan runs on the device, reported as `StepOutput`s.

Each method is a generator of outputs; the scheduler applies each (`OutputProcessor.apply`) before the runner goes
on, so what the runner decides next (which rows a step has, whether questions still ride in it) sees every
request that has ended by then.

What it runs: an admitted request prefilled alone (`SlabPrefill.prefill_alone`), turbo questions stitched and
prefilled in one batched forward, or held to ride in the decode step's forward; the naive prompts' chunks; then
one batched decode step over the running requests (through its CUDA graphs where captured). In shared-chunk
mode (`shared`) shared requests' questions are prefilled together over the chunk arena or ride in the decode step
(`SharedChunks.mixed`), and every decode step runs through segment attention (`SharedChunks.step`).

Overlapped (`overlap`, on by default on CUDA): a step is launched before the previous step's picks reach the host,
its rows fed from the picks still on the device, and the previous step is read while the GPU runs this one, so
the host's per-step work does not leave the GPU idle (SGLang's overlap scheduler). Admitted requests' first tokens
stay on the device too (`overlap_admissions`). Steps that need tokens on the host first (log-probabilities) read
everything before they launch.

Early prefills (`early_below`, shared mode, overlapped): while fewer answers run than that, questions are not held
to ride in the next step, which would start only after the step queued behind the running one: they are admitted
and prefilled at once on a second stream (`side_stream.py`), beside the running step (those admitted at a step's
start, and, through `on_wait`, those handed over while the runner waits for a step, which it then polls), and
their first tokens are read as soon as they are there, ahead of the older steps still running.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Generator, Iterator, Sequence

import torch

from service.engine.batch_decode import BatchDecoder, DecodeRows, StepFeed
from service.engine.batch_graph import BatchGraphs
from service.engine.batch_request import BatchRequest
from service.engine.detokenize import IncrementalDetokenizer
from service.engine.engine import StitchEngine, Stopwatch, stage_setter
from service.engine.first_logits import keep_first_logits
from service.engine.inflight import InFlight, PendingPicks, copy_to_host
from service.engine.kv_pool import Poison, Slab
from service.engine.launch_pacer import LaunchPacer
from service.engine.output import Failed, Started, StepOutput, Tokens
from service.engine.planner import AdmissionPlan, NaiveChunk, Planner
from service.engine.sampling import Sampler, TokenLogprobs, logprobs_rows, pick_rows, pick_rows_on_device
from service.engine.shared_chunks import SharedChunks
from service.engine.side_stream import SideStream
from service.engine.slab_prefill import SlabPrefill

log = logging.getLogger(__name__)

STEP_PHASES = ("admit", "prefill", "decode", "emit")
SIDE_POLL_S = 0.0002  # between looks at early first tokens while a step runs (the sleep lets other threads run)
STALL_LOG_S = 10.0  # a polled step still running after this long is logged once, with where each stream stands
Outputs = Iterator[StepOutput]


class StepRunner:
    """Runs admissions, naive chunks and decode steps over the planner's requests."""

    def __init__(
        self,
        engine: StitchEngine,
        planner: Planner,
        decoder: BatchDecoder,
        slabs: SlabPrefill,
        graphs: BatchGraphs | None,
        overlap: bool,
        overlap_admissions: bool,
        shared: SharedChunks | None = None,
        pacer: LaunchPacer | None = None,
        early_below: int = 0,
    ) -> None:
        self.engine = engine
        self.pacer = pacer  # overlapped steps launched as late as the device allows (`launch_pacer.py`)
        self.shared = shared
        self.planner = planner
        self.decoder = decoder
        self.slabs = slabs
        self.graphs = graphs
        self.overlap = overlap
        self.overlap_admissions = overlap_admissions
        self.inflight = InFlight(decoder.pool, self._free_slab)
        self.last_batch = 0  # requests in the last decode step (0: the step decoded nothing)
        self.prefilled_together = 0  # requests whose question went through a batched prefill
        self.prefilled_with_decode = 0  # of those, the ones prefilled in a decode step's forward
        self.prefilled_early = 0  # of those, the ones prefilled at once on the side stream
        self.early_below = early_below if shared is not None else 0
        self.side = SideStream(engine.spec.device) if self.early_below > 0 else None
        self._early = False  # the admission under way runs on the side stream (`admission`)
        self._waiting_on: PendingPicks | None = None  # the step `_read` waits for (a step runs)
        # Admits the answers handed over while a step runs, early (the scheduler's; None: only at the step's start).
        self.on_wait: Callable[[], Outputs] | None = None
        self.questions: list[BatchRequest] = []  # stitched this step, prefilled in its decode step's forward
        self._question_watch: Stopwatch | None = None  # times their stages
        # Wall seconds per phase of a step since start (the engine's utilisation, exported as a metric): admit
        # (fetch, stitch, question prefill), prefill (naive chunks), decode (the step and the pick, which waits
        # for the GPU), emit (detokenize and hand the text to the listeners).
        self.busy_s = dict.fromkeys(STEP_PHASES, 0.0)

    def has_work(self) -> bool:
        return bool(self.inflight) or bool(self.questions)

    def launch_delay_s(self, now: float) -> float:
        """How long the loop may wait before the next step's admissions and launch with the device kept busy
        (0 unless paced, overlapped and a step runs)."""
        if self.pacer is None or not self.overlap or not self.inflight:
            return 0.0
        return self.pacer.delay_s(now)

    # ---- admission -------------------------------------------------------------------------------------------

    def admission(self, early: bool) -> contextlib.AbstractContextManager[None]:
        """Where an admission's device work (the planner's placements, prefix copies and frees) runs: for early
        prefills (`early_applies`; `admit` then prefills them there too) on the side stream, else on the main
        stream, after the side stream's work (a slab or arena range it last wrote may be handed out again here)."""
        self._early = early
        if early:
            assert self.side is not None
            return self.side.enter()
        self._join_side()
        return contextlib.nullcontext()

    def early_applies(self) -> bool:
        """Early prefills may serve (`_early_possible`) and a step runs: else a question's prefill starts at once
        anyway."""
        return self._early_possible() and (self._waiting_on is not None or bool(self.inflight))

    def _early_possible(self) -> bool:
        """A side stream, first tokens that may stay on the device, and fewer answers running than `early_below`
        (more, and riding in the step pays: one pass over the weights)."""
        return (
            self.side is not None
            and self.overlap
            and self.overlap_admissions
            and len(self.planner.running) < self.early_below
        )

    def admit(self, plan: AdmissionPlan) -> Outputs:
        early, self._early = self._early, False
        if early:
            yield from self._admit_early(plan)
        if not (plan.alone or plan.together or plan.riding or plan.shared or plan.shared_riding):
            return
        self._join_side()
        yield from self._admit_here(plan)
        if self.side is not None:  # placed (unless early) and prefilled here: side work waits for it
            self.side.mark_main()

    def _admit_early(self, plan: AdmissionPlan) -> Outputs:
        """The plan's shared questions (those not asking for log-probabilities, which need their logits read now)
        prefilled at once on the side stream, their first tokens picked and copied there; taken out of the plan."""
        assert self.side is not None and self.shared is not None
        questions = [*plan.shared_riding, *plan.shared]
        early = [r for r in questions if r.sampling.logprobs is None]
        if not early:
            return
        plan.shared_riding = [r for r in plan.shared_riding if r not in early]
        plan.shared = [r for r in plan.shared if r not in early]
        queued = len(self.inflight)
        # The outputs are handed on once the block is left: applied with the side stream current, a finish's free
        # or a callback's device work would be queued there, and an exception there would leave it current.
        with self.side.enter():
            outputs = list(self._prefill_together(early, self.shared.extend, "early", self._watch()))
        yield from outputs
        for record in self.inflight.newest(len(self.inflight) - queued):
            record.side = True
            self.side.used_on_main(record.picks)
        self.prefilled_early += len(early)

    def _join_side(self) -> None:
        """The main stream's next work waits for the side stream's (it reads the early requests' slabs and picks)."""
        if self.side is not None:
            self.side.join()

    def _free_slab(self, slab: Slab) -> None:
        """A slab back to the pool once its last writer has been read. With a side stream its poison is queued there:
        on the main stream it would land behind the running step, after an early admission on the side stream had
        been handed the slab and written it; main-stream work that takes it next joins the side stream first."""
        pool = self.inflight.pool
        if self.side is None or pool.poison is Poison.NONE:
            pool.free(slab)
            return
        with self.side.enter():
            pool.free(slab)

    def _admit_here(self, plan: AdmissionPlan) -> Outputs:
        for request in plan.alone:
            yield from self._prefill_alone(request)
        if plan.shared:
            yield from self._prefill_shared(plan.shared)
        if plan.shared_riding:
            self._question_watch = self._watch()
            self.questions = yield from self._decoding(plan.shared_riding)
        elif plan.riding:
            self._question_watch = watch = self._watch()
            stitched = yield from self._stitched(plan.riding, watch)
            self.questions = yield from self._decoding(stitched)
        elif plan.together:
            watch = self._watch()
            stitched = yield from self._stitched(plan.together, watch)
            yield from self._prefill_stitched(stitched, watch)

    def _prefill_alone(self, request: BatchRequest) -> Outputs:
        watch = self._watch()
        try:
            logits = self.slabs.prefill_alone(request, request.buffer, watch)
        except Exception as err:  # one request's bad input must not take the batch down
            yield Failed([request], err)
            return
        yield from self._first_tokens([request], logits.unsqueeze(0), watch)

    def _watch(self) -> Stopwatch:
        """Times an admission's stages: deferred where steps overlap on CUDA (settled at the first token), so
        timing a stitch never stalls the GPU."""
        return Stopwatch(self.engine.spec.device, deferred=self.overlap and self.overlap_admissions)

    def _stitched(self, group: list[BatchRequest], watch: Stopwatch) -> Generator[StepOutput, None, list[BatchRequest]]:
        """Each request's chunks stitched into its slab (one that fails ends alone); each one's stitch time is the
        group's (every member waits for all of it)."""
        stitched = []
        for request in group:
            try:
                self.slabs.stitch_into_slab(request)
                stitched.append(request)
            except Exception as err:  # one request's blocks (a bad file, say) fail that request alone
                yield Failed([request], err)
        watch.lap(_set_stage(stitched, "stitch_ms"))
        return stitched

    def _prefill_stitched(self, stitched: list[BatchRequest], watch: Stopwatch) -> Outputs:
        """The questions of requests stitched into their slabs, prefilled in one batched forward."""
        yield from self._prefill_together(stitched, self.slabs.extend, "batched", watch)

    def _prefill_apart(self, questions: list[BatchRequest], watch: Stopwatch) -> Outputs:
        """Questions that were to ride in a step that cannot hold them after all, prefilled in a forward of
        their own: over the chunk arena in shared mode (only shared questions ride there), else their slabs."""
        if self.shared is not None:
            yield from self._prefill_together(questions, self.shared.extend, "shared", watch)
        else:
            yield from self._prefill_stitched(questions, watch)

    def _prefill_shared(self, group: list[BatchRequest]) -> Outputs:
        """Shared requests' questions in one forward over the chunk arena (their prefixes are in their slabs)."""
        assert self.shared is not None
        yield from self._prefill_together(group, self.shared.extend, "shared", self._watch())

    def _prefill_together(
        self,
        group: list[BatchRequest],
        extend: Callable[[list[BatchRequest]], torch.Tensor],
        kind: str,
        watch: Stopwatch,
    ) -> Outputs:
        """The questions of `group` through one forward (`extend`: logits [len(group), vocab]), then their first
        tokens; a failed forward fails them all."""
        if not group:
            return
        try:
            logits = extend(group)
        except Exception as err:  # the forward failed for all of them: their slabs' state is unknown
            log.exception("%s question prefill of %d requests failed", kind, len(group))
            yield Failed(group, err)
            return
        watch.lap(_set_stage(group, "prefill_ms"))
        self.prefilled_together += len(group)
        yield from self._first_tokens(group, logits, watch)

    def _first_tokens(self, group: list[BatchRequest], logits: torch.Tensor, watch: Stopwatch | None) -> Outputs:
        """The first tokens of requests prefilled together (logits [len(group), vocab]). Overlapped (and none asks
        for log-probabilities, which need the logits now), they are picked on the device and the requests run at
        once: the next step feeds the picks from there, and they are read while it runs."""
        if not (self.overlap_admissions and self._overlaps(group)):
            yield from self._first_tokens_now(group, logits, watch)
            return
        started = yield from self._decoding(group)
        if not started:
            return
        if len(started) < len(group):
            kept = {id(r) for r in started}
            logits = logits[[row for row, r in enumerate(group) if id(r) in kept]]
        keep_first_logits(started, logits)
        try:
            picks = pick_rows_on_device(logits, [r.running_sampler for r in started])
        except Exception as err:
            yield Failed(started, err)
            return
        self.inflight.push(copy_to_host(started, picks, 0, watch))
        yield Started(started)

    def _first_tokens_now(
        self, group: Sequence[BatchRequest], logits: torch.Tensor, watch: Stopwatch | None
    ) -> Outputs:
        """Each request's first token picked and read here; those it does not end start running."""
        keep_first_logits(group, logits)
        for row, request in enumerate(group):
            try:
                self.start_decoding(request)
                first = request.running_sampler.pick(logits[row])
                logprobs = _logprobs([request], logits[row].unsqueeze(0), [first])
            except Exception as err:
                yield Failed([request], err)
                continue
            yield Tokens([request], [first], logprobs, 0, watch, start=True)

    def _decoding(self, group: list[BatchRequest]) -> Generator[StepOutput, None, list[BatchRequest]]:
        """`group` with each request's sampler and detokenizer started; one that fails to start ends alone, not
        the forward it was to share."""
        started = []
        for request in group:
            try:
                self.start_decoding(request)
                started.append(request)
            except Exception as err:
                yield Failed([request], err)
        return started

    def start_decoding(self, request: BatchRequest) -> None:
        """The request's sampler and detokenizer, made once (a question riding in a step has them from its
        admission; nothing has been drawn or decoded before its first token)."""
        if request.sampler is not None:
            return
        request.sampler = Sampler(request.sampling, self.engine.spec.device)
        request.detok = IncrementalDetokenizer(self.engine.tokenizer, request.sampling.stop)

    # ---- naive chunks ----------------------------------------------------------------------------------------

    def prefill_chunks(self, chunks: list[NaiveChunk]) -> Outputs:
        """The step's chunks of naive prompts; a prompt whose last chunk went in gets its first token. Where the
        batched forward pays they run as one forward; elsewhere the planner hands one chunk."""
        if not chunks:
            return
        group = [chunk.request for chunk in chunks]
        watch = Stopwatch(self.engine.spec.device)
        try:
            if self.slabs.batched:
                logits = self.slabs.extend(group, [chunk.ids for chunk in chunks])
            else:
                logits = self.slabs.chunk_alone(group[0], chunks[0].ids, chunks[0].begin).unsqueeze(0)
        except Exception as err:  # the forward failed for all of them: their slabs' state is unknown
            if self.slabs.batched:
                log.exception("batched prefill of %d naive chunks failed", len(group))
            yield Failed(group, err)
            return
        spent = watch.lap_ms()
        for row, chunk in enumerate(chunks):
            chunk.request.result.timings.prefill_ms += spent
            if chunk.completes:
                yield from self._first_tokens_now([chunk.request], logits[row : row + 1], None)

    # ---- the decode step -------------------------------------------------------------------------------------

    def decode_step(self) -> Outputs:
        """One batched decode step over the running requests. Overlapped, the step is launched first and the
        previous one read while it runs; otherwise the previous one (if any) is read, then this one runs and is
        read at once."""
        questions, watch = self.questions, self._question_watch
        self.questions, self._question_watch = [], None
        if not self._step_overlaps(questions):
            yield from self._read_then_step(questions, watch)  # its drain joins the side stream
            return
        pending = self._first_tokens_pending()
        if not pending:
            self._join_side()  # the step reads the early requests' slabs and first tokens
        batch = self._continuing(pending)
        if questions and not self.planner.rides(batch, questions):
            assert watch is not None
            self._join_side()  # the question-prefill graphs' inputs are shared with the side stream's
            yield from self._prefill_apart(questions, watch)  # no step to ride in after all
            if self.side is not None:
                self.side.mark_main()
            questions, batch = [], self._continuing(set())
        self.last_batch = len(batch)
        launched = None
        if batch:
            queued = len(self.inflight)
            yield from self._launch(batch, questions, watch)
            launched = self.inflight.newest(1)[0] if len(self.inflight) > queued else None
        # Everything older than the step just launched (which runs on); early first tokens admitted while these
        # are read come after it, read as they arrive or after it.
        while self.inflight and self.inflight.first() is not launched:
            yield from self._read(self.inflight.oldest())

    def _first_tokens_pending(self) -> set[int]:
        """The requests (by id) whose first token the side stream is still computing. The step launched now leaves
        them out and does not wait for the side stream: joined, it would start only once their prefill ended,
        holding every running answer back by it; they join the next step. (A request whose record is ready has
        all its side-stream work done: the step may read it without a join.)"""
        return self.inflight.side_pending() if self.side is not None else set()

    def _continuing(self, pending: set[int]) -> list[BatchRequest]:
        return [r for r in self.planner.continuing(self.inflight.unread()) if id(r) not in pending]

    def drain(self) -> Outputs:
        """Read every launched step and unread first token (before work that must not overlap them); the main
        stream then waits for the side stream too (work admitted early while these were read)."""
        while self.inflight:
            yield from self._read(self.inflight.oldest())
        self._join_side()

    def _read_then_step(self, questions: list[BatchRequest], watch: Stopwatch | None) -> Outputs:
        """Not overlapped: read everything in flight, then one step (with `questions` in it) read at once."""
        yield from self.drain()
        if questions and not self.planner.rides(list(self.planner.running), questions):
            assert watch is not None
            yield from self._prefill_apart(questions, watch)
            yield from self.drain()
            questions = []
        self.last_batch = len(self.planner.running)
        if self.planner.running:
            yield from self._decode(questions, watch)

    def _step_overlaps(self, questions: Sequence[BatchRequest]) -> bool:
        """Whether this step (over the running requests, with `questions` prefilled in it) is launched before the
        previous one is read; its questions' first tokens then stay on the device too (`overlap_admissions`)."""
        return self._overlaps([*self.planner.running, *questions]) and (self.overlap_admissions or not questions)

    def _overlaps(self, rows: Sequence[BatchRequest]) -> bool:
        """Whether picks of `rows` may stay unread on the device: overlap is on and none asks for
        log-probabilities (computed from the logits, which the next forward overwrites)."""
        return self.overlap and all(r.sampling.logprobs is None for r in rows)

    def _launch(self, batch: list[BatchRequest], questions: list[BatchRequest], watch: Stopwatch | None) -> Outputs:
        """Queue a decode step over `batch` (with `questions` prefilled in its forward) and its picks' copy to the
        host, without waiting for either. A row whose last token is still unread on the device is fed from there;
        the questions' first tokens are picked with the step's and read with them."""
        began = time.perf_counter()
        feed = self.inflight.feed(batch)
        rows = [*batch, *questions]
        outcome: StepOutput = Started(questions)
        try:
            if questions:
                assert watch is not None
                logits = self._mixed_logits(batch, questions, feed, watch)
                keep_first_logits(questions, logits[len(batch) :])
            else:
                logits = self._decode_logits(batch, feed)
            picks = pick_rows_on_device(logits, [r.running_sampler for r in rows])
            self.inflight.push(copy_to_host(rows, picks, len(batch), watch))
        except Exception as err:  # the step failed for the whole batch: end it, keep the loop serving
            log.exception("batched decode step over %d requests failed", len(rows))
            outcome = Failed(rows, err)
        launched = time.perf_counter()
        if self.pacer is not None:
            self.pacer.launched(launched, riding=bool(questions))
        self.busy_s["decode"] += launched - began
        yield outcome

    def _read(self, step: PendingPicks) -> Outputs:
        """Wait for queued picks, return the slabs that work was the last to write, report each live row's token
        (a first token starts its request's stream). While it waits, early first tokens (side stream) are read as
        they arrive."""
        if not step.side and (self.inflight.has_side() or self._admits_while_waiting()):
            yield from self._wait_polling(step)
        began = time.perf_counter()
        try:
            tokens = step.tokens()
        except Exception as err:
            log.exception("batched decode step over %d requests failed", len(step.batch))
            failed: Failed | None = Failed([r for r in step.batch if not r.finished], err)
        else:
            failed = None
        for slab in step.free_after:
            self._free_slab(slab)
        if failed is not None:
            yield failed
            return
        read = time.perf_counter()
        if self.pacer is not None and not step.side:
            self.pacer.read(began, read, step.launched_at, riding=step.first_from < len(step.batch))
        self.busy_s["admit" if step.first_from == 0 else "decode"] += read - began
        # A row whose request ended before this step was read (the previous step's token, a cancel) is dropped.
        live = [
            (row, r, token) for row, (r, token) in enumerate(zip(step.batch, tokens, strict=True)) if not r.finished
        ]
        first_from = sum(1 for row, _, _ in live if row < step.first_from)
        yield Tokens([r for _, r, _ in live], [t for _, _, t in live], None, first_from, step.watch)
        self.busy_s["emit"] += time.perf_counter() - read

    def _admits_while_waiting(self) -> bool:
        """Whether answers handed over while a step runs are admitted at once (`on_wait`), early: the step being
        read is the one that runs."""
        return self.on_wait is not None and self._early_possible()

    def _wait_polling(self, step: PendingPicks) -> Outputs:
        """Until `step` is done: read each side-stream record whose picks are on the host, and admit early what
        arrives (`on_wait`). Polling: a wait on the step's event would hold both back until it ends."""
        began = time.perf_counter()
        stall_at = began + STALL_LOG_S
        self._waiting_on = step
        try:
            while not step.ready():
                if time.perf_counter() > stall_at:
                    self._log_stall(step)
                    stall_at = float("inf")
                for record in self.inflight.side_ready(behind=step):
                    self.busy_s["decode"] += time.perf_counter() - began
                    yield from self._read(record)
                    began = time.perf_counter()
                if self.on_wait is not None and self._admits_while_waiting():
                    self.busy_s["decode"] += time.perf_counter() - began
                    yield from self.on_wait()
                    began = time.perf_counter()
                elif not self.inflight.has_side():
                    break
                time.sleep(SIDE_POLL_S)
        finally:
            self._waiting_on = None
        self.busy_s["decode"] += time.perf_counter() - began

    def _log_stall(self, step: PendingPicks) -> None:
        """A step polled for over `STALL_LOG_S`: what the device and the records in flight show (a step's picks
        take milliseconds; this one's work, or what it waits for, does not advance)."""
        records = [(len(r.batch), r.side, r.ready()) for r in self.inflight.records()]
        log.error(
            "a decode step of %d rows has run for over %.0f s; %s; in flight (rows, side, ready): %s",
            len(step.batch),
            STALL_LOG_S,
            self.side.describe() if self.side is not None else "no side stream",
            records,
        )

    def _decode(self, questions: list[BatchRequest], watch: Stopwatch | None) -> Outputs:
        """One batched step over every running request (and the `questions` admitted to prefill with it), read at
        once."""
        batch = list(self.planner.running)
        began = time.perf_counter()
        try:
            tokens, logprobs, question_logits = self._step_tokens(batch, questions, watch)
        except Exception as err:  # the step failed for the whole batch: end it, keep the loop serving
            log.exception("batched decode step over %d requests failed", len(batch) + len(questions))
            yield Failed([*batch, *questions], err)
            return
        decoded = time.perf_counter()
        self.busy_s["decode"] += decoded - began
        yield Tokens(batch, tokens, logprobs, len(batch))
        if questions:
            assert question_logits is not None
            yield from self._first_tokens_now(questions, question_logits, watch)
        self.busy_s["emit"] += time.perf_counter() - decoded

    def _step_tokens(
        self, batch: Sequence[BatchRequest], questions: Sequence[BatchRequest], watch: Stopwatch | None
    ) -> tuple[list[int], list[TokenLogprobs | None], torch.Tensor | None]:
        """Feed every request its last token, one batched step; the next token of each (and its log-probabilities
        where the request asks for them). With `questions`, their rows' logits come back too."""
        if questions:
            assert watch is not None
            both = self._mixed_logits(batch, questions, None, watch)
            logits, question_logits = both[: len(batch)], both[len(batch) :]
        else:
            logits, question_logits = self._decode_logits(batch), None
        tokens = pick_rows(logits, [r.running_sampler for r in batch])
        return tokens, _logprobs(batch, logits, tokens), question_logits

    def _mixed_logits(
        self, batch: Sequence[BatchRequest], questions: Sequence[BatchRequest], feed: StepFeed | None, watch: Stopwatch
    ) -> torch.Tensor:
        """The decode step over `batch` with `questions` prefilled in its forward; logits of the decode rows, then
        each question's. The questions' prefill time is the step's (every member waits for all of it)."""
        ids, positions, spans = _rows(batch)
        if self.shared is not None:
            logits = self.shared.mixed(batch, (ids, positions, spans), feed, questions)
        else:
            logits = self.slabs.mixed((ids, positions, spans, None), feed, questions)
        for request in batch:
            request.buffer.commit(1, request.buffer.next_position + 1)
        watch.lap(_set_stage(questions, "prefill_ms"))
        self.prefilled_together += len(questions)
        self.prefilled_with_decode += len(questions)
        return logits

    def _decode_logits(self, batch: Sequence[BatchRequest], feed: StepFeed | None = None) -> torch.Tensor:
        """The decode step proper: each request's last token (or, with `feed`, the previous step's pick still on
        the device) through the step's graph (or eagerly)."""
        ids, positions, spans = _rows(batch)
        if self.shared is not None:
            logits = self.shared.step(batch, ids, positions, spans, feed)
        elif self.graphs is not None:
            logits = self.graphs.step(ids, positions, spans, feed)
        else:
            logits = self.decoder.step(DecodeRows.build(ids, positions, spans, self.engine.spec.device, feed))
        for request in batch:
            request.buffer.commit(1, request.buffer.next_position + 1)
        return logits


def _rows(batch: Sequence[BatchRequest]) -> tuple[list[int], list[int], list[tuple[int, int]]]:
    """Each request's token to feed, its position, and its slab's (start, live slots after this step)."""
    ids, positions, spans = [], [], []
    for request in batch:
        assert request.slab is not None
        slot = request.buffer.reserve(1)  # the slab always has room: it holds the whole answer budget
        ids.append(request.last_token)
        positions.append(request.buffer.next_position)
        spans.append((request.slab.start, slot + 1))
    return ids, positions, spans


def _logprobs(batch: Sequence[BatchRequest], logits: torch.Tensor, tokens: Sequence[int]) -> list[TokenLogprobs | None]:
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


def _set_stage(group: Sequence[BatchRequest], stage: str) -> Callable[[float], None]:
    """A `Stopwatch.lap` setter giving every request of `group` the same stage time (they waited for all of it)."""
    setters = [stage_setter(request.result.timings, stage) for request in group]

    def set_ms(ms: float) -> None:
        for setter in setters:
            setter(ms)

    return set_ms
