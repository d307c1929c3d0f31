"""The composition root: from `Settings` to everything one process works with, and its lifecycle.

Entry points open it — `kvstitch serve` (through the server behind the HTTP facade), `kvstitch worker` and
`kvstitch ingest --embedded` — and nothing below them reads settings. Redis configured means the distributed
form (Redis KV index, Redis Streams queue, job statuses and document order in Redis); unset means the embedded
form (SQLite index; queue, statuses and order in `DATA_DIR/jobs.sqlite3`, so jobs survive a restart). Qdrant
is embedded under the data dir unless a URL is set. Every use of the model goes through the runtime's one
`EngineLoop`: answers, the KV store's miss precompute, ingestion's precompute, the gate and the warm-up.

The in-process ingest worker is started here but built by the entry point (`start_worker(factory)`): the
worker loop lives in `workers/`, which the core never imports.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Protocol, Self

import torch

from service.engine.chunk_arena import ChunkArena
from service.engine.engine import StitchEngine
from service.engine.gate import run_gate
from service.engine.kv_layout import TokenIds
from service.engine.kv_path import COPY_PATH, KVPath, KVPathReason, choose_kv_path
from service.engine.kv_pool import KVPool
from service.engine.model import WEIGHTLESS, LoadedModel, load_model, load_model_shell
from service.engine.scheduler import Scheduler
from service.engine.scheduler_config import BatchingOptions, build_scheduler
from service.engine.shared_chunks import SharedChunks
from service.engine.slot_attention import slot_kernel_usable
from service.fleet.tier_events import TierPublisher
from service.jobs.documents import DocumentLimits, job_documents
from service.jobs.ordering import DocumentOrder, RedisDocumentOrder
from service.jobs.queue import JobQueue, RedisStreamQueue
from service.jobs.sqlite import SqliteDocumentOrder, SqliteJobQueue, SqliteJobStatusStore, jobs_path
from service.jobs.status import JobStatusStore, RedisJobStatusStore
from service.kvcache.index import KVIndex, open_index, repair
from service.kvcache.keys import model_fingerprint, safetensors_files
from service.kvcache.precompute import Precompute
from service.kvcache.shared import SharedTier
from service.kvcache.store import KVStore, TierBudgets
from service.retrieval.batcher import RetrievalBatcher
from service.retrieval.chunker import Chunker, ChunkerConfig
from service.retrieval.collection import PLAIN_SEARCH, ChunkCollection, RetrievedChunk, SearchOptions
from service.retrieval.embed_pool import QueryEmbedPool
from service.retrieval.embedder import Embedder
from service.retrieval.reranker import RerankedSearch, Reranker
from service.serving.data_dir_lock import DataDirLock, claim_data_dir
from service.serving.engine_loop import EngineLoop
from service.serving.kv_source import StoreChunks, kv_store_for
from service.serving.step_profile import StepProfile, StepProfileConfig
from service.settings import MIB, Settings
from service.usecases.ingest import (
    IngestCounts,
    Ingestor,
    IngestParts,
    KVPlacer,
    sweep_unnamed_blocks,
    sweep_unpublished,
)

log = logging.getLogger(__name__)

# The start-up gate: a few short chunks, so it costs a second on a 7B model yet still catches a wrong rotation.
GATE_CHUNK_LENGTHS = (24, 40, 17)
GATE_QUESTION_LENGTH = 12
# The KV pool of running answers when no size is set: room for 32 answers at ~9K context of a 7B model on a GPU
# (57 KB per token in bf16); on a CPU (small models only) 64 MiB, allocated and zeroed at every start.
DEFAULT_POOL_MB = {"cuda": 16384, "cpu": 64}
# Chunks a row reads that the shared path's graphs are captured for at start: the default top_k (5) and the
# benchmarks' 16 fall in the 4, 8 and 16 buckets; a row reading more captures its bucket on first use.
SHARED_WARM_READS = 16


@dataclass(frozen=True)
class GateOutcome:
    passed: bool
    max_abs_logit_diff: float | None
    tolerance: float | None
    skipped: bool = False
    shared_max_abs_logit_diff: float | None = None  # the zero-copy path's, where it was checked
    shared_passed: bool | None = None  # None where it was not checked


class BackgroundWorker(Protocol):
    """An ingest worker loop the runtime runs on a thread (the in-process worker of the embedded form)."""

    def run(self) -> None: ...

    def stop(self) -> None: ...


# Called with ("done" | "failed" | "retry", the job's counts or None) as each delivery ends (metrics).
JobFinished = Callable[[str, IngestCounts | None], None]
WorkerFactory = Callable[["Runtime", JobFinished | None], BackgroundWorker]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("KVSTITCH_DEVICE=cuda but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype = getattr(torch, name)
    assert isinstance(dtype, torch.dtype)
    return dtype


def tier_budgets(settings: Settings, device: torch.device) -> TierBudgets:
    """On a CPU host the "GPU" tier would be RAM beside the host tier; only the host tier is kept there. A model
    without weights (a gateway's shell) computes and serves no KV: no memory tier at all."""
    gpu = settings.gpu_cache_mb * MIB if device.type == "cuda" else 0
    host = 0 if device == WEIGHTLESS else settings.host_cache_mb * MIB
    return TierBudgets(gpu_bytes=gpu, host_bytes=host, disk_bytes=settings.disk_cache_mb * MIB)


@dataclass
class Runtime:
    """Everything a gateway or worker process works with; `close` releases it in reverse order."""

    settings: Settings
    engine: StitchEngine
    loop: EngineLoop
    index: KVIndex
    store: KVStore
    embedder: Embedder
    collection: ChunkCollection
    chunker: Chunker
    queue: JobQueue
    jobs: JobStatusStore
    order: DocumentOrder
    precompute: Precompute  # the engine's precompute, run on the engine loop (the store's misses, ingestion)
    retrieval: RetrievalBatcher  # questions' embeddings and searches, batched across concurrent requests
    question_embedder: QueryEmbedPool | None = None  # the child processes that embed questions, where they run
    reranker: Reranker | None = None  # the cross-encoder that reorders retrieved candidates, where one is set
    data_dir_lock: DataDirLock | None = None  # held while embedded Qdrant or the SQLite stores are open
    tier_publisher: TierPublisher | None = None  # the store's tier changes to Redis, where `engine_id` is set
    blocks_swept: int = 0  # KV blocks the start-up sweep released (`sweep_dead_jobs`)
    kv_path: KVPath = COPY_PATH  # shared chunk arena or copy path, chosen at start (`kv_path.py`)
    place_kv: KVPlacer | None = None  # a gateway's: ingestion's chunk KV made on its engines, not here
    closed: bool = field(default=False, init=False)
    _worker: BackgroundWorker | None = field(default=None, init=False, repr=False)
    _worker_thread: threading.Thread | None = field(default=None, init=False, repr=False)

    def search(self, text: str, top_k: int, options: SearchOptions = PLAIN_SEARCH) -> list[RetrievedChunk]:
        """A question's top-k chunks: the batched search, reordered by the reranker where one is set (blocks: call
        it from a worker thread)."""
        return self.search_many([text], top_k, options)[0]

    def search_many(
        self, texts: Sequence[str], top_k: int, options: SearchOptions = PLAIN_SEARCH
    ) -> list[list[RetrievedChunk]]:
        """`search` for each text, in one batched round; the reranker reorders each ranking by its own text."""
        if self.reranker is None:
            return self.retrieval.retrieve_many(texts, top_k, options)
        reranked = RerankedSearch(self.retrieval.retrieve_many, self.reranker, self.settings.rerank_candidates)
        return reranked.many(texts, top_k, options)

    @property
    def limits(self) -> DocumentLimits:
        return DocumentLimits(self.settings.max_document_chars, self.settings.max_documents_per_job)

    def ingestor(self) -> Ingestor:
        parts = IngestParts(
            self.engine.template,
            self.precompute,
            self.store,
            self.embedder,
            self.collection,
            self.chunker,
            self.order,
            self.place_kv,
        )
        return Ingestor(parts, self.settings.max_precompute_tokens)

    # ---- start-up -------------------------------------------------------------------------------------------

    def run_gate(self) -> GateOutcome:
        """The correctness gate on a small sample, on the engine loop (skipped when the settings say so)."""
        gate = gate_on_loop(self.settings, self.engine, self.loop, self.kv_path.shared)
        self.kv_path = kv_path_after_gate(self.kv_path, gate)
        return gate

    def warm_up(self) -> None:
        """Capture the question-prefill graphs of a typical request's stitch buffer now, so the first user does not
        pay for them; other sizes are captured on first use (the batched decode steps are warmed by
        `serve_answers`)."""
        warm_prefill_graphs(self.settings, self.engine, self.loop)
        warm_slot_attention(self.engine, self.loop)

    def serve_answers(self) -> Scheduler:
        """Give the engine loop its scheduler and KV pool (a serving process only: workers need neither)."""
        return serve_answers(self.settings, self.engine, self.store, self.loop, self.kv_path)

    def start_worker(self, factory: WorkerFactory, on_job_finished: JobFinished | None = None) -> None:
        """Run an ingest worker built by `factory` on a thread of this process until `close`."""
        if self._worker is not None:
            raise RuntimeError("the in-process worker is already running")
        self._worker = factory(self, on_job_finished)
        self._worker_thread = threading.Thread(target=self._worker.run, name="ingest-worker", daemon=True)
        self._worker_thread.start()

    # ---- shutdown -------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the worker (it hands its job back between two document groups), then close everything; waits
        for the worker at most `shutdown_timeout_s`."""
        if self.closed:
            return
        self.closed = True
        self._stop_worker()
        self._safely(self.queue.close)  # after the worker: it still hands its job back through the queue
        for close in (self.loop.close, self._release_pool, self.retrieval.close, self._close_question_embedder):
            self._safely(close)
        if self.tier_publisher is not None:  # before the store: its last moves are flushed, the engine retired
            self._safely(self.tier_publisher.close)
        for close in (self.jobs.close, self.order.close, self.store.close):
            self._safely(close)
        for close in (self.index.close, self.collection.close):
            self._safely(close)
        if self.data_dir_lock is not None:
            self.data_dir_lock.release()  # last: every store in the data dir is closed

    def _stop_worker(self) -> None:
        if self._worker is None or self._worker_thread is None:
            return
        self._worker.stop()
        self._worker_thread.join(timeout=self.settings.shutdown_timeout_s)
        if self._worker_thread.is_alive():
            # Its job is neither acked nor handed back: it stays pending, and is resumed at the next start (or
            # claimed by another worker) like the job of a killed process.
            log.warning("ingest worker still busy after %.0f s; closing anyway", self.settings.shutdown_timeout_s)

    def _close_question_embedder(self) -> None:
        """After the retrieval batcher: its thread may still be waiting on the child for a last round."""
        if self.question_embedder is not None:
            self.question_embedder.close()

    def _release_pool(self) -> None:
        """Give the KV pool's memory back now (a closed runtime may stay referenced, by metrics say)."""
        scheduler, self.loop.scheduler = self.loop.scheduler, None
        if scheduler is not None:
            if scheduler.shared is not None:
                scheduler.shared.close()
                scheduler.shared.arena.close()
            scheduler.pool.release()

    @staticmethod
    def _safely(close: Callable[[], Any]) -> None:
        try:
            close()
        except Exception:  # closing the rest matters more than one failed close
            log.exception("error while closing %s", close)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()


def gate_on_loop(settings: Settings, engine: StitchEngine, loop: EngineLoop, shared: bool = False) -> GateOutcome:
    """The correctness gate on a small sample, on the engine loop (skipped when the settings say so); `shared`: the
    zero-copy path's cases too (the KV path chosen at start is the shared one)."""
    if not settings.gate_on_start:
        return GateOutcome(True, None, None, skipped=True)
    tolerance = settings.gate_tolerance
    result = loop.call(lambda: run_gate(engine, GATE_CHUNK_LENGTHS, GATE_QUESTION_LENGTH, tolerance, shared=shared))
    log.info("start-up gate: max |logit diff| %.3e (tolerance %.1e)", result.max_abs_logit_diff, result.tolerance)
    zero_copy = result.shared_max_abs_logit_diff
    if zero_copy is not None:
        log.info("start-up gate, zero-copy path: max |logit diff| %.3e", zero_copy)
    return GateOutcome(
        result.passed, result.max_abs_logit_diff, result.tolerance, False, zero_copy, result.shared_passed
    )


def kv_path_after_gate(path: KVPath, gate: GateOutcome) -> KVPath:
    """`path`, or the copy path where the gate found the zero-copy path off the reference (logged): the copy path
    passed its own cases and serves correctly, so the server falls back to it rather than refuse to serve."""
    if gate.shared_passed is not False:
        return path
    detail = (
        f"start-up gate: zero-copy max |logit diff| {gate.shared_max_abs_logit_diff:.3e} "
        f"over tolerance {gate.tolerance:.1e}"
    )
    log.warning("shared chunks asked for, copy path serving: %s", detail)
    return path.fallback(KVPathReason.GATE, detail)


def warm_prefill_graphs(settings: Settings, engine: StitchEngine, loop: EngineLoop) -> None:
    """Capture the question-prefill graphs of a typical request's stitch buffer (`Runtime.warm_up`)."""
    graphs = engine.stitch_graphs
    if graphs is None:
        return
    start = time.perf_counter()
    try:
        loop.call(lambda: graphs.warm(typical_tokens(settings, engine)))
    except Exception:  # a warm-up is an optimisation: serving goes on, capturing on first use
        log.exception("prefill graph warm-up failed")
        return
    log.info("prefill graphs captured in %.0f ms", (time.perf_counter() - start) * 1e3)


def warm_slot_attention(engine: StitchEngine, loop: EngineLoop) -> bool:
    """Compile and probe the recompute's slot-attention kernel now (CUDA with triton), so that the first answer
    recomputing part of its context does not wait for it; whether the recompute will use it."""
    spec = engine.spec
    try:
        usable = loop.call(
            lambda: slot_kernel_usable(spec.device, spec.dtype, spec.num_heads, spec.num_kv_heads, spec.head_dim)
        )
    except Exception:  # a warm-up is an optimisation: the recompute probes again on first use
        log.exception("slot-attention warm-up failed")
        return False
    log.info("recompute attention over scattered slots: %s", "the slot kernel" if usable else "masked SDPA")
    return usable


def serve_answers(
    settings: Settings, engine: StitchEngine, store: KVStore, loop: EngineLoop, kv_path: KVPath
) -> Scheduler:
    """Give the engine loop its scheduler and KV pool (a serving process only: workers need neither), with the
    chunk arena where `kv_path` (chosen at start, `open_kv_path`, then `kv_path_after_gate`) is the shared one."""
    device = engine.spec.device
    mib = settings.kv_pool_mb or DEFAULT_POOL_MB.get(device.type, DEFAULT_POOL_MB["cpu"])
    mib, arena = open_arena(settings, engine, mib) if kv_path.shared else (mib, None)
    pool = KVPool.from_mib(engine.spec, mib)
    scheduler = build_scheduler(engine, pool, batching_options(settings), kv_source=StoreChunks(store), arena=arena)
    loop.serve_answers(scheduler)
    loop.call(lambda: _warm_batch_graphs(settings, engine, scheduler))
    log.info("answers batched: up to %d at once in a %d MiB KV pool (%d slots)", scheduler.max_batch, mib, pool.slots)
    if arena is not None:
        graphed = scheduler.shared is not None and scheduler.shared.graphs is not None
        steps = "steps through CUDA graphs" if graphed else "eager steps"
        log.info("shared chunks on (%s): a chunk arena of %d slots", steps, arena.slots)
    return scheduler


def _warm_batch_graphs(settings: Settings, engine: StitchEngine, scheduler: Scheduler) -> None:
    """Capture each batch size's decode step for every context bucket now (on the engine loop), so no capture
    happens while answers are served; in shared-chunk mode its own graphs."""
    if scheduler.shared is not None:
        _warm_shared_graphs(settings, engine, scheduler.shared, scheduler.max_batch)
    if scheduler.graphs is None:
        return
    # Every capacity bucket from the typical answer's up to what the pool can hold for one answer.
    tokens, largest = typical_tokens(settings, engine), min(engine.spec.max_context, scheduler.pool.slots)
    while True:
        scheduler.warm(min(tokens, largest))
        if tokens >= largest:
            break
        tokens *= 2


def _warm_shared_graphs(settings: Settings, engine: StitchEngine, shared: SharedChunks, max_batch: int) -> None:
    """The shared path's graphs for answers reading up to `SHARED_WARM_READS` chunks (the default top_k and the
    benchmarks' 16; more are captured on first use), questions of the template's wrapper and a few words at
    least."""
    start = time.perf_counter()
    most_reads = min(settings.max_top_k, SHARED_WARM_READS)
    shared.warm(most_reads, max_batch, len(engine.encode_question("a b c d")))
    log.info("shared-chunk graphs captured in %.0f ms", (time.perf_counter() - start) * 1e3)


def typical_tokens(settings: Settings, engine: StitchEngine) -> int:
    """Slots of a typical answer: top-5 chunks, a question, the default answer budget."""
    typical = 5 * (settings.chunk_size + 16) + 512 + settings.default_max_new_tokens
    return min(typical, engine.spec.max_context)


def open_engine(settings: Settings, gateway: bool = False) -> StitchEngine:
    """The engine of the settings' model; with `gateway` (a gateway in front of engines: it computes nothing) over
    the model's shell where that keys chunks as the engines do (`open_gateway_model`)."""
    if not settings.model:
        raise ValueError("no model configured: pass --model or set KVSTITCH_MODEL")
    if gateway:
        model = open_gateway_model(settings)
    else:
        device = resolve_device(settings.device)
        model = load_model(settings.model, device, resolve_dtype(settings.dtype, device))
    return StitchEngine(
        model,
        chunk_context=settings.chunk_context,
        recompute_full_below=settings.recompute_full_below,
        context_temperature=settings.context_temperature,
    )


def engines_dtype(settings: Settings) -> torch.dtype:
    """The dtype engines of these settings run in (part of every KV key), found without a GPU: `cuda` (or `auto`
    where this host has one) means bfloat16 unless `dtype` names another."""
    cuda = settings.device == "cuda" or (settings.device == "auto" and torch.cuda.is_available())
    return resolve_dtype(settings.dtype, torch.device("cuda" if cuda else "cpu"))


def open_gateway_model(settings: Settings) -> LoadedModel:
    """What a gateway keeps of the model: config, tokenizer and key space. A local folder with safetensors files
    loads as a shell (parameters on the meta device: no weights in memory, no GPU), its fingerprint read from the
    files as the engines read it. A hub id's fingerprint is computed from the weights themselves, so there the
    weights are loaded, on the CPU."""
    dtype = engines_dtype(settings)
    if safetensors_files(settings.model):
        return load_model_shell(settings.model, dtype)
    log.warning("gateway: %s is no local folder of safetensors files: its weights load on the CPU", settings.model)
    return load_model(settings.model, torch.device("cpu"), dtype)


def open_shared_tier(settings: Settings, engine: StitchEngine) -> SharedTier | None:
    """With `s3_url` set: the shared KV tier on that S3 bucket (made when missing), behind the disk tier."""
    if settings.s3_url is None:
        return None
    from service.kvcache.s3 import S3Config, S3Objects  # boto3: the `s3` extra

    config = S3Config(
        endpoint_url=settings.s3_url,
        bucket=settings.s3_bucket,
        region=settings.s3_region,
        addressing=settings.s3_addressing,
        timeout_s=settings.s3_timeout_s,
    )
    objects = S3Objects(config)
    objects.ensure_bucket()
    log.info("shared KV tier: %s", objects.url(settings.s3_prefix))
    return SharedTier(
        objects,
        settings.s3_prefix,
        model_fingerprint(engine.model),
        engine.spec,
        settings.kv_disk_format,
        retry_after_s=settings.s3_retry_after_s,
    )


def open_store(settings: Settings, engine: StitchEngine, index: KVIndex, precompute: Precompute) -> KVStore:
    kv_dir = settings.kv_dir
    kv_dir.mkdir(parents=True, exist_ok=True)
    report = repair(index, kv_dir)
    if report.reindexed or report.entries_removed or report.corrupt_removed or report.temp_removed:
        log.info("KV cache repaired at start: %s", report)
    store = kv_store_for(
        engine,
        kv_dir,
        index,
        tier_budgets(settings, engine.spec.device),
        precompute=precompute,
        max_precompute_tokens=settings.max_precompute_tokens,
        direct_io=settings.direct_io,
        disk_format=settings.kv_disk_format,
        shared=open_shared_tier(settings, engine),
    )
    trimmed = store.disk.trim()  # a budget lowered since the last run applies now, not after the next write
    if trimmed:
        log.info("KV disk tier trimmed to its %d MiB budget at start: %d blocks gone", settings.disk_cache_mb, trimmed)
    return store


def open_tier_publisher(
    settings: Settings, store: KVStore, engine_id: str | None = None, url: str | None = None
) -> TierPublisher | None:
    """With an engine id (`engine_id`, else the setting) and Redis: the store's tier changes published to Redis
    (started), for a gateway's routing, with `url` where this engine serves its internal API; None otherwise, and
    then nothing of the fleet touches Redis."""
    engine_id = engine_id or settings.engine_id
    if engine_id is None or settings.redis_url is None:
        return None
    publisher = TierPublisher(
        settings.redis_url,
        settings.redis_prefix,
        engine_id,
        store.key_space,
        store.tier_contents,
        ttl_s=settings.fleet_ttl_s,
        api_url=url,
    )
    store.set_tier_listener(publisher)
    publisher.start()
    log.info("publishing KV tier changes to Redis as engine %s", engine_id)
    return publisher


def open_jobs(settings: Settings) -> tuple[JobQueue, JobStatusStore, DocumentOrder]:
    """The job queue, statuses and document order: in Redis when configured, in `DATA_DIR/jobs.sqlite3`
    otherwise."""
    if settings.redis_url:
        prefix = settings.redis_prefix
        queue = RedisStreamQueue(
            settings.redis_url,
            stream=f"{prefix}:ingest",
            group=f"{prefix}-workers",
            dead_letter=f"{prefix}:ingest:dead",
            max_attempts=settings.job_max_attempts,
        )
        jobs = RedisJobStatusStore(settings.redis_url, prefix=f"{prefix}:job")
        order = RedisDocumentOrder(settings.redis_url, prefix=f"{prefix}:doc", lock_ttl_ms=settings.doc_lock_ttl)
        return queue, jobs, order
    path = jobs_path(settings.data_dir)
    durable = SqliteJobQueue(path, max_attempts=settings.job_max_attempts)
    return durable, SqliteJobStatusStore(path), SqliteDocumentOrder(path)


def sweep_dead_jobs(queue: JobQueue, collection: ChunkCollection, store: KVStore, grace_s: float) -> int:
    """At start: what dead processes left. Embedded form (this process is the only one on the data dir):
    unpublished points no queued job will redo are deleted and their blocks released. Both forms: stored blocks
    that no point names, older than `grace_s` (a job in another process may be about to name newer ones), are
    released. How many blocks went."""
    released = 0
    if isinstance(queue, SqliteJobQueue):  # with Redis, other workers' jobs may be under way: none is dead here
        if queue.resumed:
            log.info("%d jobs interrupted by the last stop are resumed", queue.resumed)
        keep = {doc_id for payload in queue.pending_payloads() for doc_id in job_documents(payload)}
        report = sweep_unpublished(collection, store, keep)
        if report.points_deleted or report.blocks_released:
            log.info("start-up sweep: %s", report)
        released += report.blocks_released
    unnamed = sweep_unnamed_blocks(collection, store, time.time() - grace_s)
    if unnamed:
        log.info("start-up sweep: %d KV blocks no point names released (stored over %g s ago)", unnamed, grace_s)
    return released + unnamed


def open_collection(settings: Settings, dimension: int) -> ChunkCollection:
    # Unset: hybrid where Qdrant ranks sparse vectors through an inverted index (a server). Embedded Qdrant scores
    # them in Python against every point, an order of magnitude slower than dense retrieval: opt in there.
    hybrid = settings.hybrid_search if settings.hybrid_search is not None else bool(settings.qdrant_url)
    if settings.qdrant_url:
        return ChunkCollection(
            settings.collection,
            dimension,
            url=settings.qdrant_url,
            api_key=settings.qdrant_api_key,
            hybrid=hybrid,
            filter_indexes=settings.filter_index_types,
        )
    return ChunkCollection(settings.collection, dimension, path=settings.qdrant_path, hybrid=hybrid)


def needs_data_dir_to_itself(settings: Settings) -> bool:
    """Embedded Qdrant or the SQLite stores (no Redis) in the data dir: no other process may open them."""
    return settings.redis_url is None or settings.qdrant_url is None


def hold_data_dir(settings: Settings) -> DataDirLock | None:
    """Claim the data dir for this process when the settings need it to themselves (DataDirInUseError when
    another process has it); None when they do not. Entry points call it before anything slow, to fail fast."""
    return claim_data_dir(settings.data_dir) if needs_data_dir_to_itself(settings) else None


def open_runtime(
    settings: Settings, engine: StitchEngine | None = None, embedder: Embedder | None = None, answers: bool = True
) -> Runtime:
    """Open every component (the engine and embedder too unless given, e.g. shared by tests); the data dir is
    claimed first, before the model loads and before embedded Qdrant or SQLite opens. `answers=False` (a worker,
    `ingest --embedded`): no question is asked here, so no question embedder process is started."""
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    lock = hold_data_dir(settings)
    try:
        runtime = _open_components(settings, engine, embedder, answers)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    runtime.data_dir_lock = lock
    return runtime


def question_embedder_in_child(mode: str, engine_device: torch.device) -> bool:
    """Whether questions are embedded in a child process (`KVSTITCH_EMBEDDING_PROCESS`). Auto: with the LLM on
    CUDA, where the engine thread holds the GIL between kernel launches and a CPU forward here would wait for it;
    on the CPU (development, the tests) in-process, where a spawned child would cost seconds at every start."""
    if mode == "auto":
        return engine_device.type == "cuda"
    return mode == "on"


def open_question_embedder(settings: Settings, engine: StitchEngine, embedder: Embedder) -> QueryEmbedPool | None:
    """The child processes for questions' embeddings when the settings call for them (the in-process `embedder`
    keeps the documents' and the collection's dimension); None = questions embedded in this process."""
    if not question_embedder_in_child(settings.embedding_process, engine.spec.device):
        return None
    pool = QueryEmbedPool(settings.embedding_processes, settings.embedding_model, device=settings.embedding_device)
    if pool.dimension != embedder.dimension:  # two models: its vectors would not fit the collection
        pool.close()
        raise RuntimeError(f"question embedder dimension {pool.dimension} != embedder's {embedder.dimension}")
    return pool


def open_retrieval(
    question_embedder: QueryEmbedPool | None, embedder: Embedder, collection: ChunkCollection
) -> RetrievalBatcher:
    """The retrieval batcher: a round in flight per question-embedder child (in this process one: the embedder
    serves one batch at a time)."""
    if question_embedder is None:
        if embedder.device.startswith("cuda"):
            embedder.warm_queries()  # its question graphs captured at start, not at the first question
        return RetrievalBatcher(embedder.embed_queries, collection.search_many)
    rounds = len(question_embedder.children)
    return RetrievalBatcher(question_embedder.embed_queries, collection.search_many, rounds=rounds)


def open_reranker(settings: Settings, embedder: Embedder) -> Reranker | None:
    """The cross-encoder of `rerank_model` on the embedder's device; None when no model is set. A folder that
    does not load raises here, so the service does not start without the ranking it was configured for."""
    if settings.rerank_model is None:
        return None
    return Reranker(settings.rerank_model, device=embedder.device)


def open_engine_loop(settings: Settings, engine: StitchEngine) -> EngineLoop:
    """The engine thread, profiling its steps once where `step_profile_path` asks for it."""
    loop = EngineLoop(settings.max_queue)
    if settings.step_profile_path is not None:
        config = StepProfileConfig(
            settings.step_profile_path,
            settings.step_profile_after_s,
            settings.step_profile_min_batch,
            settings.step_profile_steps,
        )
        loop.step_profile = StepProfile(config, engine.spec.device)
    return loop


def _open_components(
    settings: Settings, engine: StitchEngine | None, embedder: Embedder | None, answers: bool = True
) -> Runtime:
    # A gateway in front of engines keeps a shell; a worker or `kvstitch ingest` (no answers) computes KV itself.
    engine = engine or open_engine(settings, gateway=answers and settings.gateway)
    loop = open_engine_loop(settings, engine)
    precompute = loop.bind(engine.precompute)
    index = open_index(settings.redis_url, settings.data_dir, f"{settings.redis_prefix}:kv")
    store = open_store(settings, engine, index, precompute)
    tier_publisher = open_tier_publisher(settings, store)
    embedder = embedder or Embedder(settings.embedding_model, device=settings.embedding_device)
    reranker = open_reranker(settings, embedder) if answers else None  # a bad folder fails before Qdrant opens
    collection = open_collection(settings, embedder.dimension)
    config = ChunkerConfig(settings.chunk_size, settings.chunk_overlap, settings.max_document_chars)
    queue, jobs, order = open_jobs(settings)
    blocks_swept = sweep_dead_jobs(queue, collection, store, settings.kv_sweep_grace_s)
    question_embedder = open_question_embedder(settings, engine, embedder) if answers else None
    retrieval = open_retrieval(question_embedder, embedder, collection)
    return Runtime(
        settings,
        engine,
        loop,
        index,
        store,
        embedder,
        collection,
        Chunker(engine.tokenizer, config),
        queue,
        jobs,
        order,
        precompute,
        retrieval,
        question_embedder,
        reranker,
        blocks_swept=blocks_swept,
        tier_publisher=tier_publisher,
        kv_path=open_kv_path(settings, engine) if answers else COPY_PATH,  # a worker answers nothing
    )


def open_kv_path(settings: Settings, engine: StitchEngine) -> KVPath:
    """The KV path the settings ask for, or the copy path where the engine cannot serve the shared one (logged)."""
    path = choose_kv_path(settings.shared_chunks, engine.spec)
    if settings.shared_chunks == "on" and not path.shared:
        log.warning("shared chunks asked for, copy path serving: %s", path.detail)
    return path


def arena_residency(scheduler: Scheduler | None, engine: StitchEngine) -> Callable[[TokenIds], bool] | None:
    """Whether the scheduler's chunk arena holds a chunk block (None without one): what an answer's KV read ahead
    skips, since its admission reads such a chunk in the arena without a fetch."""
    if scheduler is None or scheduler.shared is None:
        return None
    return functools.partial(scheduler.shared.arena.holds, engine.kv_version)


def open_arena(settings: Settings, engine: StitchEngine, pool_mib: int) -> tuple[int, ChunkArena | None]:
    """The KV pool's MiB and, unless `shared_chunks` is off, the chunk arena (the caller asks only where the shared
    path serves): `shared_arena_mb`, or else half of the pool's budget (the pool keeping the other half, so the
    shared path asks for no more memory than the copy path)."""
    if settings.shared_chunks == "off":
        return pool_mib, None
    arena_mib = settings.shared_arena_mb or pool_mib // 2
    if settings.shared_arena_mb is None:
        pool_mib -= arena_mib
    arena = ChunkArena(engine.spec, engine.forward.rotary, arena_mib * MIB, base=engine.chunk_start)
    return pool_mib, arena


def batching_options(settings: Settings) -> BatchingOptions:
    """The scheduler's batching settings (`build_scheduler` picks what they leave to the device)."""
    return BatchingOptions(
        settings.max_batch,
        settings.prefill_chunk,
        settings.batch_prefill_min,
        settings.prefill_with_decode,
        settings.overlap_decode,
        settings.late_launch,
        settings.early_prefill_below,
    )
