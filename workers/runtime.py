"""The composition root: from `Settings` to the open engine, stores and queue one process needs.

Entry points (the gateway's app factory, `kvstitch worker`, `kvstitch ingest` in embedded mode) call
`open_runtime`; nothing below them reads settings. Redis configured means the distributed form (Redis KV index,
Redis Streams queue, job statuses in Redis); unset means the embedded form (SQLite index, in-process queue and
statuses). Qdrant is embedded under the data dir unless a URL is set.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from types import TracebackType
from typing import Self

import torch

from service.engine.engine import StitchEngine
from service.engine.model import load_model
from service.kvcache.index import KVIndex, open_index, repair
from service.kvcache.store import KVStore, TierBudgets
from service.retrieval.chunker import Chunker, ChunkerConfig
from service.retrieval.collection import ChunkCollection
from service.retrieval.embedder import Embedder
from service.settings import MIB, Settings
from workers.documents import DocumentLimits
from workers.ingest import Ingestor
from workers.job_status import InMemoryJobStatusStore, JobStatusStore, RedisJobStatusStore
from workers.queue import InProcessQueue, JobQueue, RedisStreamQueue
from workers.worker import IngestWorker, WorkerConfig, default_consumer_name

log = logging.getLogger(__name__)


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
    """On a CPU host the "GPU" tier would be RAM beside the host tier; only the host tier is kept there."""
    gpu = settings.gpu_cache_mb * MIB if device.type == "cuda" else 0
    return TierBudgets(gpu_bytes=gpu, host_bytes=settings.host_cache_mb * MIB, disk_bytes=settings.disk_cache_mb * MIB)


@dataclass
class Runtime:
    """Everything a gateway or worker process works with; `close` releases it in reverse order."""

    settings: Settings
    engine: StitchEngine
    index: KVIndex
    store: KVStore
    embedder: Embedder
    collection: ChunkCollection
    chunker: Chunker
    queue: JobQueue
    jobs: JobStatusStore
    closed: bool = field(default=False, init=False)

    @property
    def limits(self) -> DocumentLimits:
        return DocumentLimits(self.settings.max_document_chars, self.settings.max_documents_per_job)

    def ingestor(self) -> Ingestor:
        return Ingestor(
            self.engine, self.store, self.embedder, self.collection, self.chunker, self.settings.max_precompute_tokens
        )

    def worker(self, name: str | None = None, poll_ms: int = 1000) -> IngestWorker:
        config = WorkerConfig(
            name=name or default_consumer_name(),
            claim_idle_ms=self.settings.job_claim_idle_ms,
            poll_ms=poll_ms,
            limits=self.limits,
        )
        return IngestWorker(self.ingestor(), self.queue, self.jobs, config)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for close in (self.queue.close, self.jobs.close, self.store.close, self.index.close, self.collection.close):
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


def open_engine(settings: Settings) -> StitchEngine:
    if not settings.model:
        raise ValueError("no model configured: pass --model or set KVSTITCH_MODEL")
    device = resolve_device(settings.device)
    model = load_model(settings.model, device, resolve_dtype(settings.dtype, device))
    return StitchEngine(model)


def open_store(settings: Settings, engine: StitchEngine, index: KVIndex) -> KVStore:
    kv_dir = settings.kv_dir
    kv_dir.mkdir(parents=True, exist_ok=True)
    report = repair(index, kv_dir)
    if report.reindexed or report.entries_removed or report.corrupt_removed or report.temp_removed:
        log.info("KV cache repaired at start: %s", report)
    budgets = tier_budgets(settings, engine.spec.device)
    return KVStore.for_engine(
        engine,
        kv_dir,
        index,
        budgets,
        max_precompute_tokens=settings.max_precompute_tokens,
        direct_io=settings.direct_io,
        disk_format=settings.kv_disk_format,
    )


def open_queue(settings: Settings) -> tuple[JobQueue, JobStatusStore]:
    if settings.redis_url:
        prefix = settings.redis_prefix
        queue = RedisStreamQueue(
            settings.redis_url,
            stream=f"{prefix}:ingest",
            group=f"{prefix}-workers",
            dead_letter=f"{prefix}:ingest:dead",
            max_attempts=settings.job_max_attempts,
        )
        return queue, RedisJobStatusStore(settings.redis_url, prefix=f"{prefix}:job")
    return InProcessQueue(max_attempts=settings.job_max_attempts), InMemoryJobStatusStore()


def open_collection(settings: Settings, dimension: int) -> ChunkCollection:
    if settings.qdrant_url:
        return ChunkCollection(settings.collection, dimension, url=settings.qdrant_url, api_key=settings.qdrant_api_key)
    return ChunkCollection(settings.collection, dimension, path=settings.qdrant_path)


def open_runtime(settings: Settings, engine: StitchEngine | None = None, embedder: Embedder | None = None) -> Runtime:
    """Open every component (the engine and embedder too unless given, e.g. shared by tests)."""
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    engine = engine or open_engine(settings)
    index = open_index(settings.redis_url, settings.data_dir, f"{settings.redis_prefix}:kv")
    store = open_store(settings, engine, index)
    embedder = embedder or Embedder(settings.embedding_model, device=settings.embedding_device)
    collection = open_collection(settings, embedder.dimension)
    config = ChunkerConfig(settings.chunk_size, settings.chunk_overlap, settings.max_document_chars)
    queue, jobs = open_queue(settings)
    return Runtime(settings, engine, index, store, embedder, collection, Chunker(engine.tokenizer, config), queue, jobs)
