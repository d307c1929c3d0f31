"""From an HTTP request to a stream of answer events, shared by `/ask` and `/v1/chat/completions`.

`open_answer` does what must succeed before any byte is sent (a place in the engine's line, the context check,
retrieval), so its failures become proper HTTP statuses (503, 422). `Answer.events` then runs generation on the
engine thread and hands each event to the event loop as it is made. When the client goes away the consumer
stops iterating; `Answer.close` sets the cancel flag, the engine thread stops at the next token and gives up its
place in line, and the request's buffers go with its generator.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import HTTPException
from fastapi.concurrency import run_in_threadpool

from service.api.deps import field_error, unavailable
from service.api.gateway import Gateway
from service.ask import Asker, DependencyError, DoneEvent, Question, Retrieval, TokenEvent
from service.engine.engine import GenerationMode
from service.engine.sampling import SamplingParams
from service.engine.stitch import PositionMode
from service.runner import Admission, EngineBusyError

_END = object()


@dataclass
class AskOptions:
    """A question with everything the HTTP layer validated, before settings-dependent checks."""

    question: str
    top_k: int
    mode: str
    positions: str
    max_new_tokens: int | None
    temperature: float
    top_p: float
    seed: int | None


@dataclass
class Answer:
    gateway: Gateway
    asker: Asker
    question: Question
    retrieval: Retrieval
    admission: Admission
    started: float
    cancelled: threading.Event = field(default_factory=threading.Event)
    done: DoneEvent | None = None

    def sources(self) -> list[dict[str, Any]]:
        return [
            {"id": c.id, "doc_id": c.doc_id, "score": round(c.score, 6), "tokens": len(c.token_ids), "text": c.text}
            for c in self.retrieval.chunks
        ]

    async def events(self) -> AsyncIterator[TokenEvent | DoneEvent]:
        """Token events, then the done event; errors raised inside the engine are raised here."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self.gateway.runner.submit(lambda: self._generate(loop, queue))
        while True:
            item = await queue.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, DoneEvent):
                self.done = item
                self._record(item)
            yield item

    def close(self) -> None:
        """Stop generation (if still running); the engine thread releases the admission when it stops."""
        if self.done is None and not self.cancelled.is_set():
            self.gateway.metrics.disconnects.inc()
        self.cancelled.set()

    def _generate(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[Any]) -> None:
        def post(item: Any) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the event loop is gone (shutdown): nobody is listening any more
                self.cancelled.set()

        queued_ms = (time.perf_counter() - self.started) * 1e3 - self.retrieval.retrieve_ms
        try:
            if not self.cancelled.is_set():
                with self.gateway.engine_lock:
                    for event in self.asker.answer(self.question, self.retrieval, self.started, self.cancelled):
                        if isinstance(event, DoneEvent):
                            event.timings_ms["queue"] = max(0.0, queued_ms)
                        post(event)
        except BaseException as err:
            post(err)
        finally:
            self.admission.release()
            post(_END)

    def _record(self, done: DoneEvent) -> None:
        self.gateway.metrics.observe_answer(
            done.mode, done.positions, done.ttft_ms, done.timings_ms, done.kv, done.kv_bytes, done.output_tokens
        )


async def open_answer(gateway: Gateway, asker: Asker, options: AskOptions) -> Answer:
    """Admission, bounds from settings, retrieval; raises HTTPException (422/503) before streaming starts."""
    started = time.perf_counter()
    question = _question(gateway, options)
    try:
        question = await run_in_threadpool(asker.prepare, question)
    except ValueError as err:
        raise field_error("max_new_tokens", str(err)) from err
    try:
        admission = gateway.runner.admit()
    except EngineBusyError as err:
        gateway.metrics.rejected.labels("busy").inc()
        raise unavailable(f"server busy: {err}; retry shortly", retry_after_s=2) from err
    try:
        retrieval = await run_in_threadpool(asker.retrieve, question)
    except DependencyError as err:
        admission.release()
        gateway.metrics.rejected.labels("dependency").inc()
        raise unavailable(str(err)) from err
    except BaseException:
        admission.release()
        raise
    return Answer(gateway, asker, question, retrieval, admission, started)


def _question(gateway: Gateway, options: AskOptions) -> Question:
    settings = gateway.settings
    if len(options.question) > settings.max_question_chars:
        raise field_error("question", f"at most {settings.max_question_chars} characters (got {len(options.question)})")
    if not options.question.strip():
        raise field_error("question", "must not be blank")
    if options.top_k > settings.max_top_k:
        raise field_error("top_k", f"at most {settings.max_top_k}")
    max_new = options.max_new_tokens or settings.default_max_new_tokens
    if max_new > settings.max_new_tokens_limit:
        raise field_error("max_new_tokens", f"at most {settings.max_new_tokens_limit} (got {max_new})")
    try:
        sampling = SamplingParams(
            max_new_tokens=max_new, temperature=options.temperature, top_p=options.top_p, seed=options.seed
        )
    except ValueError as err:
        raise field_error("sampling", str(err)) from err
    return Question(
        text=options.question,
        top_k=options.top_k,
        mode=GenerationMode(options.mode),
        positions=PositionMode(options.positions),
        sampling=sampling,
    )


async def collect_text(answer: Answer) -> str:
    """The whole answer, for the non-streaming forms; engine errors become HTTP errors (nothing was sent yet)."""
    parts: list[str] = []
    try:
        async for event in answer.events():
            if not isinstance(event, DoneEvent):
                parts.append(event.text)
    except Exception as err:
        raise raise_for_engine_error(err) from err
    finally:
        answer.close()
    return "".join(parts)


def raise_for_engine_error(err: BaseException) -> HTTPException:
    """Errors raised from the engine thread, as the status the client should see."""
    if isinstance(err, DependencyError):
        return unavailable(str(err))
    return HTTPException(500, detail=f"generation failed: {type(err).__name__}: {err}")
