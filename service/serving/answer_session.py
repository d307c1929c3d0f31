"""One admitted question on its way through the engine loop: its batched request, events, cancellation, metrics.

`AnswerSession.start` hands the question to the engine loop's scheduler as a `BatchRequest`: at admission the
chunks' KV is fetched (the scheduler's KV source, the store), then the request is stitched and prefilled into
its slab of the KV pool and decoded together with the other running answers. Each text delta reaches the
listener as a `TokenEvent`, then a `DoneEvent` and None (the end), or the error and None. When the client goes
away `cancel` marks the request; the scheduler drops it at its next step, frees its slab, and the place in line
is released. A turbo answer picked for a shadow (`shadow.py`) hands its request to the shadows once its `done`
went out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from service.engine.batch_request import BatchRequest
from service.facade.types import DoneEvent, Source, TokenEvent
from service.kvcache.store import FetchResult
from service.metrics import Metrics
from service.retrieval.collection import RetrievedChunk
from service.serving.engine_loop import Admission, EngineLoop
from service.serving.shadow import Shadows
from service.usecases.answer import Answerer, Question, Retrieval

# What an answer session hands its listener: events, then None at the end; an exception instead when it failed.
AnswerItem = TokenEvent | DoneEvent | BaseException | None


@dataclass
class AnswerSession:
    loop: EngineLoop
    answerer: Answerer
    metrics: Metrics
    question: Question
    retrieval: Retrieval
    admission: Admission
    started: float  # perf_counter at the request's arrival (TTFT counts from here)
    shadows: Shadows | None = None  # None: no answer of this server is shadowed
    done: DoneEvent | None = None
    request: BatchRequest | None = field(default=None, repr=False)
    _listener: Callable[[AnswerItem], None] | None = field(default=None, repr=False)
    _cancelled: bool = False
    _logprobs_sent: int = 0
    _shadowed: bool = False

    def sources(self) -> list[Source]:
        return [source(c) for c in self.retrieval.chunks]

    def start(self, listener: Callable[[AnswerItem], None]) -> None:
        question = self.question
        self._listener = listener
        self.request = BatchRequest(
            self.answerer.prompt(question, self.retrieval),
            question.sampling,
            question.mode,
            question.positions,
            on_text=self._text,
            on_finish=self._finished,
            recompute=question.recompute,
        )
        self._shadowed = self.shadows is not None and self.shadows.pick(self.request)
        self.answerer.read_ahead(self.request.prompt, question.mode)  # disk reads overlap the wait in line
        try:
            self.loop.add_answer(self.request)
        except BaseException:
            self.admission.release()
            raise

    def cancel(self) -> None:
        if self.done is None and not self._cancelled:
            self.metrics.disconnects.inc()
        self._cancelled = True
        if self.request is not None and self.done is None:
            self.loop.cancel_answer(self.request)
        elif self.request is None:
            self.admission.release()  # never started: nothing on the engine holds the place

    # ---- on the engine loop ---------------------------------------------------------------------------------

    def _text(self, delta: str) -> None:
        """A text delta, with the log-probabilities of the tokens generated since the last one."""
        assert self._listener is not None and self.request is not None
        entries = self.request.result.logprobs[self._logprobs_sent :]
        self._logprobs_sent += len(entries)
        self._listener(TokenEvent(delta, self.answerer.named(entries)))

    def _finished(self, request: BatchRequest) -> None:
        """The request ended (done, stopped, cancelled or failed): report it and give up the place in line."""
        listener = self._listener
        assert listener is not None
        try:
            if request.error is not None:
                listener(request.error)
            elif request.result.finish_reason != "cancelled":
                listener(self._done_event(request))
        finally:
            self.admission.release()
            listener(None)
            # The listener is called no more; it usually holds this session (to cancel it), a cycle that would keep
            # the session, its request and whatever they hold until a full garbage collection.
            self._listener = None
        if self._shadowed and self.done is not None and self.shadows is not None:
            self.shadows.follow(request)  # after the client's answer: its shadow runs off the critical path

    def _done_event(self, request: BatchRequest) -> DoneEvent:
        ttft_ms = (request.first_token_at - self.started) * 1e3
        fetch = request.fetch
        assert fetch is None or isinstance(fetch, FetchResult), "the server's KV source is the KV store"
        resident = [len(request.prompt.blocks[i]) for i in request.resident_chunks]
        done = self.answerer.done_event(self.question, self.retrieval, fetch, request.result, ttft_ms, resident)
        admitted_at = request.added_at + request.queue_ms / 1e3
        done.timings_ms["queue"] = max(0.0, (admitted_at - self.started) * 1e3 - self.retrieval.retrieve_ms)
        # The part of it spent with the engine loop: its running step, then the line (the rest is the hand-over).
        done.timings_ms["engine_wait"] = max(0.0, (admitted_at - request.handed_at) * 1e3)
        self.done = done
        observe_done(self.metrics, done)
        return done


def observe_done(metrics: Metrics, done: DoneEvent) -> None:
    """An answer's figures into the metrics, from its done event (local or an engine's, as the gateway saw it)."""
    metrics.observe_answer(
        done.mode,
        done.positions,
        done.ttft_ms,
        done.timings_ms,
        done.kv,
        done.kv_bytes,
        done.output_tokens,
        done.recompute,
        done.recomputed_tokens,
    )


def source(chunk: RetrievedChunk) -> Source:
    """A retrieved chunk as answers and `/retrieve` report it."""
    return {
        "id": chunk.id,
        "doc_id": chunk.doc_id,
        "score": round(chunk.score, 6),
        "tokens": len(chunk.token_ids),
        "text": chunk.text,
        "metadata": dict(chunk.metadata),  # the document's, bounded at ingest (MAX_METADATA_BYTES)
        **chunk.context,  # title, headings, page, last_page: where they are known
    }
