"""What one gateway process holds: the runtime, the engine thread, the in-process worker, readiness, metrics.

Start-up runs on a background thread, so `/healthz` answers while the model loads: open the runtime, run the
correctness gate on a small sample (unless turned off), start the in-process ingest worker (embedded mode),
and only then report ready. A failure is kept and shown by `/readyz`.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from service.ask import Asker
from service.engine.engine import StitchEngine
from service.engine.gate import run_gate
from service.metrics import Metrics
from service.retrieval.embedder import Embedder
from service.runner import EngineRunner
from service.settings import Settings
from workers.runtime import Runtime, open_runtime
from workers.worker import IngestWorker

log = logging.getLogger(__name__)

# The start-up gate: a few short chunks, so it costs a second on a 7B model yet still catches a wrong rotation.
GATE_CHUNK_LENGTHS = (24, 40, 17)
GATE_QUESTION_LENGTH = 12


@dataclass
class GateOutcome:
    passed: bool
    max_abs_logit_diff: float | None
    tolerance: float | None
    skipped: bool = False


class Gateway:
    def __init__(
        self, settings: Settings, engine: StitchEngine | None = None, embedder: Embedder | None = None
    ) -> None:
        self.settings = settings
        self.metrics = Metrics()
        self.runner = EngineRunner(settings.max_queue)
        self.metrics.watch_queue_depth(lambda: self.runner.waiting)
        # One forward at a time on the model: answers run on the engine thread, and the in-process worker's
        # precompute batches take the same lock between them.
        self.engine_lock = threading.Lock()
        self.runtime: Runtime | None = None
        self.asker: Asker | None = None
        self.gate: GateOutcome | None = None
        self.startup_error: str | None = None
        self.started = threading.Event()
        self._given = (engine, embedder)
        self._worker: IngestWorker | None = None
        self._worker_thread: threading.Thread | None = None
        self.model_name = _model_name(settings.model)

    # ---- lifecycle ------------------------------------------------------------------------------------------

    def start_in_background(self) -> threading.Thread:
        thread = threading.Thread(target=self.start, name="gateway-start", daemon=True)
        thread.start()
        return thread

    def start(self) -> None:
        try:
            began = time.perf_counter()
            runtime = open_runtime(self.settings, *self._given)
            self.runtime = runtime
            self.metrics.watch_store(runtime.store.stats)
            self.metrics.watch_ingest_backlog(runtime.queue.pending_count)
            self.gate = self._run_gate(runtime.engine)
            if not self.gate.passed:
                raise RuntimeError(f"correctness gate failed: max |logit diff| {self.gate.max_abs_logit_diff:.3e}")
            self._warm_decode_graph(runtime.engine)
            self.asker = Asker(runtime.engine, runtime.store, runtime.embedder, runtime.collection)
            if self.settings.worker_in_process:
                self._start_worker(runtime)
            log.info("kvstitch ready in %.1f s (model %s)", time.perf_counter() - began, self.model_name)
        except Exception as err:
            log.exception("gateway start-up failed")
            self.startup_error = f"{type(err).__name__}: {err}"
        finally:
            self.started.set()

    def _run_gate(self, engine: StitchEngine) -> GateOutcome:
        if not self.settings.gate_on_start:
            return GateOutcome(True, None, None, skipped=True)
        with self.engine_lock:
            result = run_gate(engine, GATE_CHUNK_LENGTHS, GATE_QUESTION_LENGTH, self.settings.gate_tolerance)
        self.metrics.gate_diff.set(result.max_abs_logit_diff)
        log.info("start-up gate: max |logit diff| %.3e (tolerance %.1e)", result.max_abs_logit_diff, result.tolerance)
        return GateOutcome(result.passed, result.max_abs_logit_diff, result.tolerance)

    def _warm_decode_graph(self, engine: StitchEngine) -> None:
        """Capture the CUDA-graph decode step for a typical request now, so the first user does not pay for it
        (30-100 ms on an H200); other sizes are captured on first use."""
        graphs = engine.decode_graphs
        if graphs is None:
            return
        settings = self.settings
        typical = 5 * (settings.chunk_size + 16) + 512 + settings.default_max_new_tokens  # top-5 chunks, a question
        start = time.perf_counter()
        try:
            with self.engine_lock:
                graphs.warm(min(typical, engine.spec.max_context))
        except Exception:  # a warm-up is an optimisation: serving goes on, capturing on first use
            log.exception("decode graph warm-up failed")
            return
        log.info("decode graph captured in %.0f ms", (time.perf_counter() - start) * 1e3)

    def _start_worker(self, runtime: Runtime) -> None:
        worker = runtime.worker(name="in-process", poll_ms=200)
        worker.ingestor.engine_lock = self.engine_lock
        worker.on_job_finished = self.metrics.ingest_finished
        self._worker = worker
        self._worker_thread = threading.Thread(target=worker.run, name="ingest-worker", daemon=True)
        self._worker_thread.start()

    def close(self) -> None:
        if self._worker is not None:
            self._worker.stop()
        if self.runtime is not None:
            self.runtime.queue.close()  # wakes the worker if it waits for a job
        if self._worker_thread is not None:
            self._worker_thread.join(timeout=30)
        self.runner.close()
        if self.runtime is not None:
            self.runtime.close()

    # ---- state ----------------------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.asker is not None and self.startup_error is None

    def readiness(self) -> dict[str, Any]:
        """What `/readyz` reports: each check and why it fails."""
        checks: dict[str, Any] = {}
        if self.startup_error is not None:
            checks["startup"] = self.startup_error
        elif not self.started.is_set():
            checks["startup"] = "loading"
        checks["model"] = "loaded" if self.runtime is not None else "not loaded"
        checks["gate"] = _gate_state(self.gate)
        if self.runtime is not None:
            checks["index"] = _probe(self.runtime.index.total_bytes)
            checks["qdrant"] = "ok" if self.runtime.collection.ping() else "unreachable"
        ok = self.ready and checks.get("index") == "ok" and checks.get("qdrant") == "ok"
        self.metrics.ready.set(1 if ok else 0)
        return {"ready": ok, "checks": checks}


def _gate_state(gate: GateOutcome | None) -> str:
    if gate is None:
        return "pending"
    if gate.skipped:
        return "skipped"
    return f"{'passed' if gate.passed else 'failed'} (max |logit diff| {gate.max_abs_logit_diff:.2e})"


def _probe(check: Any) -> str:
    try:
        check()
    except Exception as err:  # any failure means the index cannot serve requests now
        return f"unreachable: {type(err).__name__}: {err}"
    return "ok"


def _model_name(model: str) -> str:
    """What /v1/models lists: a hub id as given, a folder by its name."""
    return model.rstrip("/").rsplit("/", 1)[-1] if model.startswith(("/", ".")) else model
