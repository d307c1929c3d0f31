"""The ingest use case: chunk → precompute and store KV → embed → upsert → drop the old version → release
blocks; and the removal of a document. The worker loop (`workers/`) and `kvstitch ingest --embedded` run it.

Every step is idempotent, so a job redelivered after its worker died simply runs again:

- KV blocks are content-addressed (`KVStore.key_of`): a block already on disk is reused, never recomputed, so
  the same chunk text ingested twice, or by two documents, is stored once.
- A document's version is a hash of its text, format, metadata and the chunking, and Qdrant point ids come
  from (doc id, chunk index): re-running writes the same points. An unchanged document whose points are all in
  place is skipped after chunking (nothing embedded, nothing computed).
- KV is stored before the points that name it are upserted, so a searchable chunk always has its KV; the old
  version's points are deleted only after the new ones are in, so the document stays searchable throughout.
- KV blocks that no point names any more (the old version's, a deleted document's) are removed from the disk
  tier. A block that another document still names is kept.

Jobs for one document apply in submit order (`service.jobs.ordering`): a document's points are written or
deleted under its lock, and skipped when a later job for it was submitted meanwhile.

Documents are processed in groups of roughly `group_tokens` so that the KV precompute sees batches that fill the
device (`max_precompute_tokens` per forward, blocks of similar length together) while progress is reported,
and the job's lease kept alive, between groups.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from service.engine.kv_layout import TokenIds
from service.engine.prompt import PromptTemplate
from service.jobs.documents import DeleteJob, Document, IngestJob, document_version
from service.jobs.ordering import DocumentOrder, applying
from service.kvcache.precompute import DEFAULT_MAX_PRECOMPUTE_TOKENS, Precompute, precompute_and_store
from service.kvcache.store import KVStore
from service.retrieval.chunker import Chunk, Chunker
from service.retrieval.collection import ChunkCollection
from service.retrieval.embedder import Embedder

log = logging.getLogger(__name__)

GROUP_BATCHES = 4  # a group of documents feeds about this many full precompute batches


@dataclass
class IngestCounts:
    """What a job did so far; `chunks_reused` counts chunks whose KV was already stored."""

    documents_done: int = 0
    chunks: int = 0
    chunks_precomputed: int = 0
    chunks_reused: int = 0
    tokens_precomputed: int = 0
    blocks_released: int = 0
    documents_superseded: int = 0  # skipped: a later job for the document was submitted
    seconds: dict[str, float] = field(default_factory=dict)

    def add_time(self, stage: str, seconds: float) -> None:
        self.seconds[stage] = self.seconds.get(stage, 0.0) + seconds

    def status_fields(self) -> dict[str, int]:
        """The counts a job status carries."""
        return {
            "documents_done": self.documents_done,
            "chunks": self.chunks,
            "chunks_precomputed": self.chunks_precomputed,
            "chunks_reused": self.chunks_reused,
        }


Progress = Callable[[IngestCounts], None]


@dataclass(frozen=True)
class DeleteCounts:
    """What a delete job did; `superseded` when a later job for the document made it moot."""

    chunks_deleted: int = 0
    blocks_released: int = 0
    superseded: bool = False

    def status_fields(self) -> dict[str, int]:
        return {"documents_done": 1, "chunks_deleted": self.chunks_deleted, "blocks_released": self.blocks_released}


@dataclass(frozen=True)
class _Prepared:
    """A chunked document and the KV block (token ids) and key of each chunk."""

    doc: Document
    version: str
    chunks: list[Chunk]
    blocks: list[TokenIds]
    keys: list[str]


@dataclass(frozen=True)
class IngestParts:
    """What ingestion works with. `precompute` computes chunk KV (the runtime binds it to its engine loop, the
    one owner of the device); `template` wraps chunk ids into the blocks the engine stitches."""

    template: PromptTemplate
    precompute: Precompute
    store: KVStore
    embedder: Embedder
    collection: ChunkCollection
    chunker: Chunker
    order: DocumentOrder


class Ingestor:
    """Runs ingest and delete jobs against one KV store, embedder and collection."""

    def __init__(self, parts: IngestParts, max_precompute_tokens: int = DEFAULT_MAX_PRECOMPUTE_TOKENS) -> None:
        if max_precompute_tokens < 1:
            raise ValueError(f"max_precompute_tokens must be positive, got {max_precompute_tokens}")
        self.template = parts.template
        self.precompute = parts.precompute
        self.store = parts.store
        self.embedder = parts.embedder
        self.collection = parts.collection
        self.chunker = parts.chunker
        self.order = parts.order
        self.max_precompute_tokens = max_precompute_tokens
        config = parts.chunker.config
        self._chunking = f"size={config.chunk_size};overlap={config.overlap};template={parts.template.version}"

    def ingest(self, job: IngestJob, progress: Progress | None = None) -> IngestCounts:
        """Ingest every document of the job; `progress` is called after each group of documents."""
        counts = IngestCounts()
        for group in self._groups(job.documents, counts):
            self._store_kv(group, counts)
            for prepared in group:
                with applying(self.order, prepared.doc.id, job.sequence) as current:
                    if current:
                        self._index(prepared, counts)
                    else:
                        counts.documents_superseded += 1
                counts.documents_done += 1
            if progress is not None:
                progress(counts)
        return counts

    def delete(self, job: DeleteJob) -> DeleteCounts:
        """Remove a document's points and release its KV blocks, unless a later job for it was submitted."""
        with applying(self.order, job.doc_id, job.sequence) as current:
            if not current:
                return DeleteCounts(superseded=True)
            keys = self.collection.document_kv_keys(job.doc_id)
            deleted = self.collection.delete_document(job.doc_id)
            return DeleteCounts(deleted, self._release(keys))

    # ---- stages ----------------------------------------------------------------------------------------------

    def _groups(self, documents: Sequence[Document], counts: IngestCounts) -> Iterator[list[_Prepared]]:
        """Chunked documents, gathered until they hold enough tokens for a few full precompute batches."""
        group: list[_Prepared] = []
        tokens = 0
        for doc in documents:
            start = time.perf_counter()
            prepared = self._prepare(doc)
            counts.add_time("chunk", time.perf_counter() - start)
            group.append(prepared)
            tokens += sum(len(b) for b in prepared.blocks)
            if tokens >= GROUP_BATCHES * self.max_precompute_tokens:
                yield group
                group, tokens = [], 0
        if group:
            yield group

    def _prepare(self, doc: Document) -> _Prepared:
        chunks = self.chunker.chunk(doc.id, doc.text, markdown=doc.format == "markdown")
        blocks = [self.template.chunk_block(c.token_ids) for c in chunks]
        keys = [self.store.key_of(b) for b in blocks]
        return _Prepared(doc, document_version(doc, self._chunking), chunks, blocks, keys)

    def _store_kv(self, group: list[_Prepared], counts: IngestCounts) -> None:
        """Compute and store the KV of every block not stored yet, in batches that fill the device."""
        missing: dict[str, TokenIds] = {}
        for prepared in group:
            for key, block in zip(prepared.keys, prepared.blocks, strict=True):
                if key not in missing and not self.store.contains(key):
                    missing[key] = block
        counts.chunks += sum(len(p.keys) for p in group)
        counts.chunks_precomputed += len(missing)  # a block shared by several chunks is computed once
        counts.chunks_reused += sum(len(p.keys) for p in group) - len(missing)
        start = time.perf_counter()
        blocks = list(missing.values())
        precompute_and_store(self.precompute, self.store.put, blocks, self.max_precompute_tokens)
        counts.tokens_precomputed += sum(len(ids) for ids in blocks)
        counts.add_time("precompute", time.perf_counter() - start)

    def _index(self, prepared: _Prepared, counts: IngestCounts) -> None:
        """Embed and upsert the document's points unless they are all in place, then drop other versions.

        One scroll reads what the document has now (embedded Qdrant answers filters by scanning every point, so
        the number of calls per document decides how ingest scales with the corpus)."""
        doc, version = prepared.doc, prepared.version
        # Read before the upsert: new points overwrite old ones at the same chunk index, taking their keys along.
        existing = self.collection.document_points(doc.id)
        previous_keys = {key for v, key in existing if v != version and key}
        if sum(1 for v, _ in existing if v == version) != len(prepared.chunks):
            start = time.perf_counter()
            vectors = self.embedder.embed_documents([c.text for c in prepared.chunks])
            counts.add_time("embed", time.perf_counter() - start)
            start = time.perf_counter()
            self.collection.upsert(prepared.chunks, vectors, version, prepared.keys, doc.metadata)
            counts.add_time("upsert", time.perf_counter() - start)
        if any(v != version for v, _ in existing):
            self.collection.delete_document(doc.id, keep_version=version)
        counts.blocks_released += self._release(previous_keys - set(prepared.keys))

    def _release(self, keys: set[str]) -> int:
        """Remove the blocks no point names any more from the KV store; how many went."""
        if not keys:
            return 0
        unused = keys - self.collection.referenced_kv_keys(sorted(keys))
        for key in unused:
            self.store.remove(key)
        return len(unused)
