"""The scheduler's output side: what the runner's picks do to each request.

The runner reports what it ran as `StepOutput`s; the output processor applies them: accept a token (append it,
log-probabilities first, detokenize and emit the text, end the request on EOS, a stop string or its budget),
start a request whose first token came, end a failed one. Ending a request takes it out of its line, returns its
slab (once no launched step can still write it) and reports it through `on_finish`.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from service.engine.batch_request import BatchRequest, RequestStatus
from service.engine.engine import Stopwatch
from service.engine.kv_pool import Slab
from service.engine.planner import Planner
from service.engine.sampling import TokenLogprobs

log = logging.getLogger(__name__)


@dataclass
class Tokens:
    """One token per row, read on the host. Rows from `first_from` on are first tokens (their stages timed by
    `watch`); with `start`, a row whose first token does not end it starts running."""

    rows: Sequence[BatchRequest]
    tokens: Sequence[int]
    logprobs: Sequence[TokenLogprobs | None] | None = None
    first_from: int = 0
    watch: Stopwatch | None = None
    start: bool = False


@dataclass
class Started:
    """Requests whose first tokens are picked but still on the device: they run from the next step, which feeds
    the picks from there; the tokens are read later (a `Tokens` with `first_from` 0)."""

    rows: Sequence[BatchRequest]


@dataclass
class Failed:
    rows: Sequence[BatchRequest]
    error: BaseException


StepOutput = Tokens | Started | Failed


class OutputProcessor:
    """Applies the runner's outputs to requests; `release` returns a slab to the pool once it is safe."""

    def __init__(self, planner: Planner, release: Callable[[Slab], None], eos: set[int]) -> None:
        self.planner = planner
        self.release = release
        self.eos = eos

    def apply(self, output: StepOutput) -> list[BatchRequest]:
        """Apply one output; returns the requests it ended."""
        if isinstance(output, Failed):
            for request in output.rows:
                self.fail(request, output.error)
            return list(output.rows)
        if isinstance(output, Started):
            self.planner.running.extend(output.rows)
            return []
        return self._tokens(output)

    def _tokens(self, output: Tokens) -> list[BatchRequest]:
        ended = []
        for request in output.rows[output.first_from :]:
            self._first_token_read(request, output.watch)
        logprobs = output.logprobs or [None] * len(output.rows)
        for request, token, lp in zip(output.rows, output.tokens, logprobs, strict=True):
            if not self.accept(request, token, lp):
                ended.append(request)
            elif output.start:
                self.planner.start_running(request)
        return ended

    def accept(self, request: BatchRequest, token: int, logprobs: TokenLogprobs | None = None) -> bool:
        """Append a token and emit its text; False when it ended the request."""
        detok = request.detok
        assert detok is not None
        request.result.token_ids.append(token)
        if token in self.eos and not request.sampling.ignore_eos:
            self.finish(request, "stop")
            return False
        if logprobs is not None:  # before the text goes out, so a listener finds the token's entry with it
            request.result.logprobs.append(logprobs)
        self._emit(request, detok.push(token))
        if detok.stopped:
            self.finish(request, "stop")
        elif len(request.result.token_ids) == request.sampling.max_new_tokens:
            self.finish(request, "length")
        else:
            request.last_token = token
            return True
        return False

    @staticmethod
    def _first_token_read(request: BatchRequest, watch: Stopwatch | None) -> None:
        """The request's first token reached the host: its TTFT, and its stage times where they were deferred.
        Deferred times are the GPU's own, so the wait for the work queued before the request's (the running
        step) moves into its queue time, as it was when every stage waited for the device."""
        request.first_token_at = time.perf_counter()
        timings = request.result.timings
        timings.ttft_ms = (request.first_token_at - request.added_at) * 1e3
        if watch is not None and watch.deferred:
            watch.settle()
            request.queue_ms = max(request.queue_ms, timings.ttft_ms - timings.stages_ms)

    def fail(self, request: BatchRequest, error: BaseException) -> None:
        """End a request with `error` (finish reason "error"), whose traceback keeps no local of the failed work."""
        forget_locals(error)
        request.error = error
        self.finish(request, "error")

    def finish(self, request: BatchRequest, reason: str) -> None:
        """End a request wherever it is: free its slab, flush its text, report it, then let go of its chunk KV and
        callbacks (`BatchRequest.let_go`)."""
        self.planner.remove(request)
        self.planner.release_chunks(request)
        if request.slab is not None:
            self.release(request.slab)
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
        try:
            if request.on_finish is not None:
                request.on_finish(request)
        finally:
            request.let_go()  # its chunk KV is in its slab (or the arena), its end reported: nothing reads either

    @staticmethod
    def _emit(request: BatchRequest, delta: str) -> None:
        if not delta or request.on_text is None:
            return
        try:
            request.on_text(delta)
        except Exception:  # the consumer is gone (a closed stream): treat it as a disconnect
            log.warning("text callback failed; cancelling the request", exc_info=True)
            request.cancelled = True


def forget_locals(error: BaseException) -> None:
    """Clear the locals of the finished frames an error (and those it was raised from) went through.

    A failed request keeps its error, and the error's traceback every frame from where it was caught down to where
    it was raised, each with its locals: a fetch's blocks already copied, a stitch's chunk KV, a step's buffers.
    The request itself is among the catching frame's locals, so the cycle lives until a full garbage collection,
    and with it that device memory (after an out-of-memory error: more of them). The catching frame is skipped (it
    may still run, or be a generator suspended at handing the error on); every frame below it has returned. Line
    numbers stay, so the traceback still prints.
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        caught = current.__traceback__
        if caught is not None:
            traceback.clear_frames(caught.tb_next)
        current = current.__cause__ or current.__context__
