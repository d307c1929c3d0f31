"""One admitted question on its way through the engine loop: generation, cancellation, metrics.

`AnswerSession.start` queues the answer on the engine loop (the one owner of the device) and hands each event to
the listener as it is made; the HTTP layer turns them into SSE or JSON. When the client goes away `cancel` sets
a flag the generation checks between tokens; the engine loop then stops, gives up the place in line, and the
request's buffers go with its generator.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from service.answer import Answerer, DoneEvent, Question, Retrieval
from service.engine_loop import Admission, EngineLoop
from service.facade import AnswerItem
from service.metrics import Metrics


@dataclass
class AnswerSession:
    loop: EngineLoop
    answerer: Answerer
    metrics: Metrics
    question: Question
    retrieval: Retrieval
    admission: Admission
    started: float  # perf_counter at the request's arrival (TTFT counts from here)
    cancelled: threading.Event = field(default_factory=threading.Event)
    done: DoneEvent | None = None

    def sources(self) -> list[dict[str, Any]]:
        return [
            {"id": c.id, "doc_id": c.doc_id, "score": round(c.score, 6), "tokens": len(c.token_ids), "text": c.text}
            for c in self.retrieval.chunks
        ]

    def start(self, listener: Callable[[AnswerItem], None]) -> None:
        self.loop.submit(lambda: self._generate(listener))

    def cancel(self) -> None:
        if self.done is None and not self.cancelled.is_set():
            self.metrics.disconnects.inc()
        self.cancelled.set()

    def _generate(self, listener: Callable[[AnswerItem], None]) -> None:
        """Runs on the engine loop; the place in line is released however it ends."""
        queued_ms = (time.perf_counter() - self.started) * 1e3 - self.retrieval.retrieve_ms
        try:
            if not self.cancelled.is_set():
                for event in self.answerer.answer(self.question, self.retrieval, self.started, self.cancelled):
                    if isinstance(event, DoneEvent):
                        event.timings_ms["queue"] = max(0.0, queued_ms)
                        self._record(event)
                    listener(event)
        except BaseException as err:
            listener(err)
        finally:
            self.admission.release()
            listener(None)

    def _record(self, done: DoneEvent) -> None:
        self.done = done
        self.metrics.observe_answer(
            done.mode, done.positions, done.ttft_ms, done.timings_ms, done.kv, done.kv_bytes, done.output_tokens
        )
