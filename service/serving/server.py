"""The service in this process, as the HTTP layer sees it (`Facade`): start-up, readiness, answers, jobs, metrics.

Start-up runs on a background thread, so `/healthz` answers while the model loads: open the runtime (the
composition root), run the correctness gate on a small sample (unless turned off), warm the CUDA graphs, start
the in-process ingest worker when the settings ask for one, and only then report ready. A failure is kept and
shown by `readiness`. The worker loop itself is handed in by the entry point (`worker_factory`): the core never
imports `workers/`.

A question arrives checked against every bound but one (the HTTP boundary's `AnswerRequest`); that one, its
tokens within the model's context, needs the tokenizer and is checked here (`Answerer.prepare`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import anyio

from service.engine.engine import GenerationMode, StitchEngine
from service.engine.recompute_spec import NO_RECOMPUTE, RecomputeSpec
from service.engine.sampling import SamplingParams
from service.engine.stitch import PositionMode
from service.errors import (
    BusyError,
    InvalidRequestError,
    JobFinishedError,
    NotReadyError,
    TooLargeError,
    UnavailableError,
    UnknownDocumentError,
    UnknownJobError,
)
from service.facade import AnswerStream
from service.facade.engine import EngineAnswerRequest, WireChunk, out_of_vocabulary
from service.facade.types import (
    AnswerLimits,
    AnswerRequest,
    Document,
    DocumentPage,
    DocumentSummary,
    JobStatus,
    RequestLimits,
    RetrieveRequest,
    Source,
)
from service.fleet.routing import ChunkRef
from service.formats import ExtractError
from service.formats.isolated import ExtractCancelledError, ExtractTimeoutError, IsolatedExtractor
from service.jobs.documents import IngestJob, JobError, parse_job
from service.jobs.submit import new_job_id, submit_delete, submit_ingest
from service.metrics import Metrics
from service.quality.measured import DefaultRecompute, default_recompute
from service.retrieval.collection import SearchOptions
from service.retrieval.embedder import Embedder
from service.retrieval.fusion import conversation_queries
from service.serving.answer_session import AnswerSession, source
from service.serving.answer_stream import EventStream
from service.serving.engine_loop import EngineBusyError
from service.serving.fleet_gateway import Fleet
from service.serving.gc_pauses import GcPauses, freeze_startup_heap, set_young_threshold
from service.serving.readiness import startup_checks
from service.serving.remote_answer import RemoteAnswer
from service.serving.runtime import GateOutcome, Runtime, WorkerFactory, arena_residency, open_runtime
from service.serving.shadow import ShadowPolicy, Shadows
from service.settings import MIB, Settings
from service.usecases.answer import Answerer, Question, Retrieval

log = logging.getLogger(__name__)


class Server:
    """Implements `service.facade.Facade` over one runtime."""

    def __init__(
        self,
        settings: Settings,
        engine: StitchEngine | None = None,
        embedder: Embedder | None = None,
        worker_factory: WorkerFactory | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = Metrics()
        self._gc_pauses = GcPauses()
        self.metrics.watch_gc(self._gc_pauses)
        self.runtime: Runtime | None = None
        self.answerer: Answerer | None = None
        self.shadows: Shadows | None = None
        self.gate: GateOutcome | None = None
        self.fleet: Fleet | None = None  # gateway mode: the engine processes questions go to
        self.recompute_default = DefaultRecompute(NO_RECOMPUTE, "not resolved yet: the model is loading")
        self.startup_error: str | None = None
        self.started = threading.Event()
        self._given = (engine, embedder)
        self._worker_factory = worker_factory
        self._model_name = _model_name(settings.model)
        self._limits = _request_limits(settings)
        self._extractor = IsolatedExtractor(settings.extract_timeout_s, settings.extract_processes)

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def model_aliases(self) -> tuple[str, ...]:
        return self.settings.model_alias_names

    @property
    def limits(self) -> RequestLimits:
        return self._limits

    # ---- lifecycle ------------------------------------------------------------------------------------------

    def start(self) -> None:
        threading.Thread(target=self.start_now, name="server-start", daemon=True).start()

    def start_now(self) -> None:
        """Open, check and warm everything (on the calling thread); errors are kept for `readiness`."""
        try:
            began = time.perf_counter()
            self._gc_pauses.install()
            runtime = self.runtime = open_runtime(self.settings, *self._given)
            self._resolve_recompute_default(runtime)
            self.metrics.kv_blocks_swept.inc(runtime.blocks_swept)
            self.metrics.watch_store(runtime.store.stats)
            self.metrics.watch_ingest_backlog(runtime.queue.pending_count)
            self.metrics.watch_queue_depth(lambda: runtime.loop.waiting)
            self.metrics.watch_engine(runtime.loop.seconds, runtime.loop.question_prefills, runtime.loop.rider_tokens)
            self.metrics.watch_retrieval(runtime.retrieval.stats)
            if self.settings.gateway:
                self._start_fleet(runtime)
            else:
                self._serve_here(runtime)
            resident = arena_residency(runtime.loop.scheduler, runtime.engine)
            self.answerer = Answerer(runtime.engine, runtime.store, runtime.search_many, resident)
            self._start_worker(runtime)
            if self.settings.gc_freeze:
                log.info("froze %d start-up objects out of the garbage collector's walks", freeze_startup_heap())
            set_young_threshold(self.settings.gc_gen0_threshold)
            log.info("kvstitch ready in %.1f s (model %s)", time.perf_counter() - began, self.model_name)
        except Exception as err:
            log.exception("start-up failed")
            self.startup_error = f"{type(err).__name__}: {err}"
        finally:
            self.started.set()

    def _resolve_recompute_default(self, runtime: Runtime) -> None:
        """KVSTITCH_RECOMPUTE as it serves (`measured`: the model folder's measurement, where it fits), said once
        at start: a measurement not applied is a warning, never a silent `none`."""
        settings = self.settings
        fingerprint = runtime.store.key_space.fingerprint
        default = default_recompute(settings.recompute, settings.model, fingerprint, settings.chunk_context)
        self.recompute_default = default
        level = logging.WARNING if default.unapplied else logging.INFO
        log.log(level, "turbo answers naming no recompute get %s (%s)", default.spec, default.source)

    def _serve_here(self, runtime: Runtime) -> None:
        """The embedded engine: gate, warm-up, scheduler, shadows (this process answers)."""
        self.gate = runtime.run_gate()
        if self.gate.max_abs_logit_diff is not None:
            self.metrics.gate_diff.set(self.gate.max_abs_logit_diff)
        if self.gate.shared_max_abs_logit_diff is not None:
            self.metrics.gate_zero_copy_diff.set(self.gate.shared_max_abs_logit_diff)
        if not self.gate.passed:
            raise RuntimeError(f"correctness gate failed: max |logit diff| {self.gate.max_abs_logit_diff:.3e}")
        runtime.warm_up()
        scheduler = runtime.serve_answers()
        pool = scheduler.pool
        self.metrics.watch_batching(lambda: len(scheduler.running), lambda: pool.used_bytes, pool.capacity_bytes)
        self.metrics.set_kv_path(runtime.kv_path.mode.value, runtime.kv_path.reason.value)
        if scheduler.shared is not None:
            self.metrics.watch_arena(scheduler.shared.stats)
        runtime.loop.on_step = self.metrics.batch_size.observe
        policy = ShadowPolicy(self.settings.shadow_share, self.settings.shadow_queue)
        self.shadows = Shadows(policy, runtime.loop.add_answer, self.metrics)

    def _start_fleet(self, runtime: Runtime) -> None:
        """Gateway mode: questions go to the engine processes (`KVSTITCH_ENGINES`); this process retrieves,
        ingests and routes. Its model (a shell without weights, `open_gateway_model`, unless the caller gave one)
        gives the tokenizer, the template and the key space engines must share."""
        self.gate = GateOutcome(True, None, None, skipped=True)  # each engine runs its own gate
        fleet = self.fleet = Fleet(self.settings, runtime.store.key_space)
        fleet.start()
        runtime.place_kv = fleet.place_kv  # ingestion's chunk KV is computed on the engines (before the worker starts)
        self.metrics.watch_fleet(fleet.figures)
        if fleet.view is not None:
            self.metrics.watch_placement(fleet.view.stats)
        log.info("gateway mode: routing questions to the engines of KVSTITCH_ENGINES=%s", self.settings.engines)

    def _start_worker(self, runtime: Runtime) -> None:
        if not self.settings.worker_in_process:
            return
        if self._worker_factory is None:
            raise RuntimeError("this form needs the in-process ingest worker, but the entry point gave none")
        runtime.start_worker(self._worker_factory, self.metrics.ingest_finished)

    def close(self) -> None:
        self._gc_pauses.uninstall()
        self._extractor.close()
        if self.fleet is not None:
            self.fleet.close()
        if self.runtime is not None:
            self.runtime.close()

    # ---- state ----------------------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.answerer is not None and self.startup_error is None

    def readiness(self) -> dict[str, Any]:
        """Each check and why it fails (what `/readyz` reports)."""
        index = self.runtime.index if self.runtime is not None else None
        checks = startup_checks(self.started, self.startup_error, index, self.gate)
        if self.runtime is not None:
            checks["qdrant"] = "ok" if self.runtime.collection.ping() else "unreachable"
        ok = self.ready and checks.get("index") == "ok" and checks.get("qdrant") == "ok"
        if self.fleet is not None:
            engines_ok, checks["engines"] = self.fleet.readiness()
            ok = ok and engines_ok
        self.metrics.ready.set(1 if ok else 0)
        report: dict[str, Any] = {"ready": ok, "checks": checks, "recompute_default": self.recompute_default.as_json()}
        if self.runtime is not None and not self.settings.gateway:  # a gateway's engines answer, and report theirs
            report["kv_path"] = self.runtime.kv_path.as_json()
            scheduler = self.runtime.loop.scheduler  # read once: a closing runtime sets it to None
            shared = scheduler.shared if scheduler is not None else None
            if shared is not None:
                report["arena"] = shared.stats().as_json()
        if self.shadows is not None:
            report["shadow"] = self.shadows.figures()
        return report

    def metrics_text(self) -> bytes:
        return self.metrics.render()

    def count_request(self, route: str, status: int) -> None:
        self.metrics.requests.labels(route, str(status)).inc()

    def _ready_runtime(self) -> Runtime:
        if self.runtime is None or not self.ready:
            raise NotReadyError(self.startup_error or "the model is still loading")
        return self.runtime

    # ---- answers --------------------------------------------------------------------------------------------

    async def answer(self, request: AnswerRequest) -> AnswerStream:
        """`open_answer` on a worker thread (retrieval blocks), then its events as an async iterator; in gateway
        mode the retrieved question is routed to an engine and its answer streamed from there."""
        arrived = time.perf_counter()  # TTFT counts from here: a wait for a worker thread is the answer's too
        if self.fleet is not None:
            remote = await anyio.to_thread.run_sync(self.open_remote, request, self.fleet, arrived)
            try:
                await remote.open()
            except BusyError:
                self.metrics.rejected.labels("busy").inc()
                raise
            except UnavailableError:
                self.metrics.rejected.labels("dependency").inc()
                raise
            return remote
        session = await anyio.to_thread.run_sync(self.open_answer, request, arrived)
        return EventStream(session)

    def open_remote(self, request: AnswerRequest, fleet: Fleet, started: float) -> RemoteAnswer:
        """Retrieve (blocking) and prepare the question for an engine; the refusals of `Facade.answer` but those of
        the engines (`RemoteAnswer.open`). `started`: when the request reached the server (TTFT counts from it)."""
        runtime = self._ready_runtime()
        assert self.answerer is not None
        question = self._prepared(self.answerer, request)
        try:
            retrieval = self.answerer.retrieve(question)
        except UnavailableError:
            self.metrics.rejected.labels("dependency").inc()
            raise
        template, store = runtime.engine.template, runtime.store
        blocks = [template.chunk_block(c.token_ids) for c in retrieval.chunks]
        refs = [ChunkRef(store.key_of(b), len(b)) for b in blocks]
        wire = engine_request(question, retrieval, request)
        sources = [source(c) for c in retrieval.chunks]
        return RemoteAnswer(fleet, self.metrics, wire, refs, sources, started, retrieval.retrieve_ms)

    def open_answer(self, request: AnswerRequest, started: float) -> AnswerSession:
        """Admit and retrieve (blocking); the refusals of `Facade.answer`. `started`: when the request reached the
        server (TTFT counts from it)."""
        runtime = self._ready_runtime()
        assert self.answerer is not None
        question = self._prepared(self.answerer, request)
        try:
            admission = runtime.loop.admit()
        except EngineBusyError as err:
            self.metrics.rejected.labels("busy").inc()
            raise BusyError(f"server busy: {err}; retry shortly") from err
        try:
            retrieval = self.answerer.retrieve(question)
            _check_vocabulary(retrieval, runtime.engine.spec.vocab_size)
        except BaseException as err:
            admission.release()
            if isinstance(err, UnavailableError):
                self.metrics.rejected.labels("dependency").inc()
            raise
        return AnswerSession(
            runtime.loop, self.answerer, self.metrics, question, retrieval, admission, started, self.shadows
        )

    async def retrieve(self, request: RetrieveRequest) -> list[Source]:
        """The ranked chunks for a question, on a worker thread (retrieval blocks); nothing is generated, so no
        place on the engine is taken."""
        return await anyio.to_thread.run_sync(self.retrieve_now, request)

    def retrieve_now(self, request: RetrieveRequest) -> list[Source]:
        runtime = self._ready_runtime()
        options = SearchOptions(filter=request.filter, hybrid=request.hybrid)
        try:
            hits = runtime.search(request.question, request.top_k, options)
        except UnavailableError:
            self.metrics.rejected.labels("dependency").inc()
            raise
        return [source(c) for c in hits]

    def _prepared(self, answerer: Answerer, request: AnswerRequest) -> Question:
        """The request as a `Question` with its token ids: the one check left after the HTTP boundary's, that
        the tokens fit the model's context (`Answerer.prepare`)."""
        try:
            return answerer.prepare(self._question(request))
        except InvalidRequestError:
            raise
        except ValueError as err:
            raise InvalidRequestError("max_new_tokens", str(err)) from err

    def _question(self, request: AnswerRequest) -> Question:
        """The request in the engine's terms, the deployment's defaults applied."""
        try:
            sampling = SamplingParams(
                max_new_tokens=request.max_new_tokens,
                temperature=request.temperature,
                top_p=request.top_p,
                seed=request.seed,
                stop=request.stop,
                logprobs=request.logprobs,
            )
        except ValueError as err:  # the engine's own bounds, should the deployment's limits pass them
            raise InvalidRequestError("sampling", str(err)) from err
        mode = GenerationMode(request.mode)
        return Question(
            text=request.question,
            history=request.history,
            search_texts=self._search_texts(request),
            search=SearchOptions(filter=request.filter),
            top_k=request.top_k,
            mode=mode,
            positions=PositionMode(request.positions),
            sampling=sampling,
            recompute=self._recompute(request) if mode is GenerationMode.TURBO else NO_RECOMPUTE,
        )

    def _search_texts(self, request: AnswerRequest) -> tuple[str, ...]:
        """What retrieval searches: the question alone and, in a conversation, the question after the last
        `retrieval_history_turns` earlier user turns (a follow-up such as "and who holds its copyright?" names its
        subject only in the turn before; one that changes topic must not be pulled back to it): two searches,
        fused."""
        turns = self.settings.retrieval_history_turns
        earlier = [m.text for m in request.history if m.role == "user"][-turns:] if turns else []
        return conversation_queries(request.question, earlier)

    def _recompute(self, request: AnswerRequest) -> RecomputeSpec:
        """The request's recompute spec, or the deployment's default (`KVSTITCH_RECOMPUTE`, checked at start-up);
        naive answers compute every token anyway, so they carry none. A composite request asking for one was
        refused at validation; the default does not apply to it (composite positions cannot be recomputed)."""
        if request.recompute is not None:
            return request.recompute
        if request.positions == PositionMode.COMPOSITE.value:
            return NO_RECOMPUTE
        return self.recompute_default.spec

    # ---- files ----------------------------------------------------------------------------------------------

    def read_file(self, name: str, data: bytes, stop: Callable[[], bool] | None = None) -> Document:
        try:
            extracted = self._extractor.extract(name, data, stop or _never)
        except ExtractTimeoutError as err:
            raise InvalidRequestError("files", f"{err} (KVSTITCH_EXTRACT_TIMEOUT_S)") from err
        except ExtractCancelledError as err:
            raise InvalidRequestError("files", f"{name}: reading it was stopped (the client left)") from err
        except ExtractError as err:
            raise InvalidRequestError("files", str(err)) from err
        return Document(name, extracted.text, extracted.metadata(source="upload", filename=name), extracted.format)

    # ---- jobs -----------------------------------------------------------------------------------------------

    def submit_ingest(self, documents: Sequence[Document]) -> str:
        runtime = self._ready_runtime()
        job_id = new_job_id()
        try:  # the worker's own checks, answered now instead of as a failed job
            parse_job(IngestJob(job_id, tuple(documents)).to_payload(), runtime.limits)
        except JobError as err:
            raise InvalidRequestError("documents", str(err)) from err
        self._check_job_tokens(runtime, documents)
        try:
            submit_ingest(runtime.queue, runtime.jobs, runtime.order, documents, job_id)
        except Exception as err:  # Redis away: the job was not queued, say so
            raise UnavailableError("the job queue", err) from err
        self.metrics.ingest_jobs.labels("submitted").inc()
        return job_id

    def submit_delete(self, doc_id: str) -> str:
        runtime = self._ready_runtime()
        try:
            stored = bool(runtime.collection.document_points(doc_id))
        except Exception as err:  # qdrant-client raises transport-specific errors; all mean "unreachable" here
            raise UnavailableError("Qdrant", err) from err
        try:
            # Known: stored now, or a job for it still to run (an ingest just sent must be deletable at once).
            if not stored and not runtime.order.pending(doc_id):
                raise UnknownDocumentError(f"no document {doc_id!r}")
            job_id = submit_delete(runtime.queue, runtime.jobs, runtime.order, doc_id)
        except UnknownDocumentError:
            raise
        except Exception as err:
            raise UnavailableError("the job queue", err) from err
        self.metrics.ingest_jobs.labels("submitted").inc()
        return job_id

    def _check_job_tokens(self, runtime: Runtime, documents: Sequence[Document]) -> None:
        """A job holding more tokens than the bound would hold the worker for its whole run: refused up front."""
        bound = self.settings.max_job_tokens
        tokens = runtime.chunker.count_tokens([d.text for d in documents], stop_above=bound)
        if tokens > bound:
            message = (
                f"the job's documents hold more than {bound:,} tokens (KVSTITCH_MAX_JOB_TOKENS; counted "
                f"{tokens:,} before stopping); send them in smaller jobs"
            )
            raise TooLargeError("documents", message)

    def cancel_job(self, job_id: str) -> JobStatus:
        runtime = self._ready_runtime()
        try:
            cancelled = runtime.jobs.cancel(job_id)
            job = runtime.jobs.get(job_id)
        except Exception as err:
            raise UnavailableError("the job status store", err) from err
        if cancelled is None or job is None:
            raise UnknownJobError(f"no ingest job {job_id!r} (unknown or expired)")
        if not cancelled:
            raise JobFinishedError(f"job {job_id!r} already finished ({job.status}): nothing to cancel")
        return job

    def job_status(self, job_id: str) -> JobStatus | None:
        runtime = self._ready_runtime()
        try:
            return runtime.jobs.get(job_id)
        except Exception as err:
            raise UnavailableError("the job status store", err) from err

    # ---- documents ------------------------------------------------------------------------------------------

    def list_documents(self, offset: int, limit: int) -> DocumentPage:
        documents = self._documents(None)
        return DocumentPage(len(documents), offset, documents[offset : offset + limit])

    def get_document(self, doc_id: str) -> DocumentSummary:
        found = self._documents(doc_id)
        if not found:
            raise UnknownDocumentError(f"no document {doc_id!r}")
        return found[0]

    def _documents(self, doc_id: str | None) -> list[DocumentSummary]:
        runtime = self._ready_runtime()
        try:
            return runtime.collection.documents(doc_id)
        except Exception as err:  # qdrant-client raises transport-specific errors; all mean "unreachable" here
            raise UnavailableError("Qdrant", err) from err


def engine_request(question: Question, retrieval: Retrieval, request: AnswerRequest) -> EngineAnswerRequest:
    """The retrieved question as an engine receives it (the deployment's defaults already applied)."""
    sampling = question.sampling
    chunks = tuple(
        WireChunk(c.id, c.doc_id, c.score, c.text, tuple(c.token_ids), dict(c.metadata), dict(c.context))
        for c in retrieval.chunks
    )
    return EngineAnswerRequest(
        question=question.text,
        chunks=chunks,
        mode=question.mode.value,
        positions=question.positions.value,
        max_new_tokens=sampling.max_new_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        seed=sampling.seed,
        stop=tuple(sampling.stop),
        logprobs=sampling.logprobs,
        recompute=str(question.recompute),
        history=question.history,
        dropped=retrieval.dropped,
    )


def _request_limits(settings: Settings) -> RequestLimits:
    answer = AnswerLimits(
        max_question_chars=settings.max_question_chars,
        max_top_k=settings.max_top_k,
        max_new_tokens=settings.max_new_tokens_limit,
        default_max_new_tokens=settings.default_max_new_tokens,
        max_history_messages=settings.max_history_messages,
        max_history_chars=settings.max_history_chars,
    )
    return RequestLimits(
        settings.max_request_mb * MIB,
        settings.api_key,
        answer,
        max_upload_files=settings.max_upload_files,
        max_upload_file_bytes=settings.max_upload_file_mb * MIB,
    )


def _model_name(model: str) -> str:
    """What /v1/models lists: a hub id as given, a folder by its name."""
    return model.rstrip("/").rsplit("/", 1)[-1] if model.startswith(("/", ".")) else model


def _never() -> bool:
    return False


class ForeignVocabularyError(RuntimeError):
    """A retrieved chunk holds ids outside the model's vocabulary: its collection was ingested with another
    tokenizer (a data dir kept across a model change). Answered 500 with what to do, never sent to the device."""


def _check_vocabulary(retrieval: Retrieval, vocab_size: int) -> None:
    found = out_of_vocabulary([c.token_ids for c in retrieval.chunks], vocab_size)
    if found is not None:
        chunk = retrieval.chunks[found[0]]
        raise ForeignVocabularyError(
            f"chunk {chunk.id} of document {chunk.doc_id!r} holds token id {found[1]}, outside this model's "
            f"vocabulary of {vocab_size}: the collection was ingested with another tokenizer; ingest it again"
        )
