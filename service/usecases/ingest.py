"""The ingest use case: chunk → precompute and store KV → embed → upsert → drop the old version → release
blocks; and the removal of a document. The worker loop (`workers/`) and `kvstitch ingest --embedded` run it.

Every step is idempotent, so a job redelivered after its worker died simply runs again:

- KV blocks are content-addressed (`KVStore.key_of`): a block already on disk is reused, never recomputed, so
  the same chunk text ingested twice, or by two documents, is stored once.
- A document's version is a hash of its text, format, metadata and the chunking, and Qdrant point ids come
  from (doc id, version, chunk index): re-running writes the same points. An unchanged document whose points are all in
  place is skipped after chunking (nothing embedded, nothing computed).
- A document is all or nothing: KV is stored first, then the points are written invisible, then `publish` makes
  the version visible and drops the old one in one step. A searchable chunk always has its KV; a document stays
  searchable throughout a re-ingest (the old version until the switch); a job killed midway leaves no document
  partly visible.
- KV blocks that no point names any more (the old version's, a deleted document's, a superseded document's) are
  removed from the disk tier. A block that another document still names is kept.
- What a job gives up on is cleaned: `abandon` (a job failed for good) and `sweep_unpublished` (at start, what a
  dead process left) delete unpublished points and release the blocks no point names.

Jobs for one document apply in submit order (`service.jobs.ordering`): a document's points are written or
deleted under its lock, and skipped when a later job for it was submitted meanwhile.

Documents are processed in groups of roughly `group_tokens` so that the KV precompute sees batches that fill the
device (`max_precompute_tokens` per forward, blocks of similar length together) while progress is reported,
and the job's lease kept alive, between groups.

A worker steers a running job through `JobControl`: between groups the job stops (its worker is stopping) or
gives other waiting jobs a turn (the rest of it is queued again, carrying its counts), and a cancelled job stops
before the next document is published; its documents not finished are withdrawn (`withdraw`: unpublished points
deleted, blocks no point names released), those finished stay (each document is all or nothing).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from service.engine.kv_layout import TokenIds
from service.engine.prompt import PromptTemplate
from service.jobs.documents import DeleteJob, Document, IngestJob, Job, document_version
from service.jobs.ordering import DocumentOrder, applying
from service.kvcache.precompute import DEFAULT_MAX_PRECOMPUTE_TOKENS, Precompute, precompute_and_store
from service.kvcache.store import KVStore
from service.retrieval.chunker import Chunk, Chunker
from service.retrieval.collection import ChunkCollection
from service.retrieval.embedder import Embedder
from service.retrieval.outline import ChunkContext, Outline, document_title, embedding_text

log = logging.getLogger(__name__)

GROUP_BATCHES = 4  # a group of documents feeds about this many full precompute batches
SWEEP_PAGE = 1024  # block keys looked up in Qdrant at once by the sweep
# A gateway's ingestion: the chunks' KV made where questions will read it (the engines), not here. Called with
# the blocks' keys, their chunks' token ids and `on_batch(indices)` as each batch is done.
KVPlacer = Callable[[Sequence[str], Sequence[TokenIds], Callable[[Sequence[int]], None]], None]
EMBED_FORM = "title+heading:1"  # the document title and the innermost heading go before each chunk's text


@dataclass
class IngestCounts:
    """What a job did so far; `chunks_reused` counts chunks whose KV was already stored."""

    documents_done: int = 0
    chunks: int = 0
    chunks_done: int = 0  # KV stored: reused chunks at once, computed ones as their batches finish
    chunks_precomputed: int = 0
    chunks_reused: int = 0
    tokens_precomputed: int = 0
    blocks_released: int = 0
    documents_superseded: int = 0  # skipped: a later job for the document was submitted
    seconds: dict[str, float] = field(default_factory=dict)

    def add_time(self, stage: str, seconds: float) -> None:
        self.seconds[stage] = self.seconds.get(stage, 0.0) + seconds

    def status_fields(self) -> dict[str, int]:
        """The counts a job status carries (and the rest of a job carries to its next turn)."""
        return {
            "documents_done": self.documents_done,
            "chunks": self.chunks,
            "chunks_done": self.chunks_done,
            "chunks_precomputed": self.chunks_precomputed,
            "chunks_reused": self.chunks_reused,
        }

    @classmethod
    def carried(cls, progress: Mapping[str, int]) -> IngestCounts:
        """Counts starting from what a job's earlier turns did."""
        return cls(
            documents_done=progress.get("documents_done", 0),
            chunks=progress.get("chunks", 0),
            chunks_done=progress.get("chunks_done", 0),
            chunks_precomputed=progress.get("chunks_precomputed", 0),
            chunks_reused=progress.get("chunks_reused", 0),
        )


Progress = Callable[[IngestCounts], None]
ShouldStop = Callable[[], bool]


def _never() -> bool:
    return False


@dataclass(frozen=True)
class JobControl:
    """How a worker steers a running ingest: `should_stop` (the worker is stopping) and `should_yield` (other
    jobs wait for a turn) are asked between document groups, `cancelled` also before each document is published."""

    should_stop: ShouldStop = _never
    should_yield: ShouldStop = _never
    cancelled: ShouldStop = _never


class IngestInterruptedError(Exception):
    """The job stopped between two document groups because its worker is stopping; it is safe to run again.
    `done`: documents of this run finished (the rest of the job is `job.rest(done, counts.status_fields())`)."""

    def __init__(self, counts: IngestCounts, done: int = 0) -> None:
        super().__init__(f"stopped after {counts.documents_done} documents")
        self.counts = counts
        self.done = done


class IngestYieldedError(IngestInterruptedError):
    """The job paused between two document groups to let waiting jobs run; its rest goes to the queue's end."""


class IngestCancelledError(Exception):
    """The job was cancelled; its documents not finished were withdrawn (counted in `counts.blocks_released`)."""

    def __init__(self, counts: IngestCounts) -> None:
        super().__init__(f"cancelled after {counts.documents_done} documents")
        self.counts = counts


@dataclass(frozen=True)
class SweepReport:
    """What a start-up sweep removed: unpublished points of jobs that will not run again, and their blocks."""

    points_deleted: int = 0
    blocks_released: int = 0
    documents: tuple[str, ...] = ()


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
    contexts: list[ChunkContext]


@dataclass(frozen=True)
class IngestParts:
    """What ingestion works with. `precompute` computes chunk KV (the runtime binds it to its engine loop, the
    one owner of the device); `template` wraps chunk ids into the blocks the engine stitches. `place_kv`, where
    set (a gateway in front of engines), takes the missing blocks instead: nothing is computed or stored here."""

    template: PromptTemplate
    precompute: Precompute
    store: KVStore
    embedder: Embedder
    collection: ChunkCollection
    chunker: Chunker
    order: DocumentOrder
    place_kv: KVPlacer | None = None


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
        self.place_kv = parts.place_kv
        self.max_precompute_tokens = max_precompute_tokens
        config = parts.chunker.config
        # `embed=`: what is embedded besides the chunk text; a change re-embeds a re-ingested document (its KV is
        # content-addressed and reused).
        self._chunking = (
            f"size={config.chunk_size};overlap={config.overlap};template={parts.template.version};embed={EMBED_FORM}"
        )

    def ingest(
        self, job: IngestJob, progress: Progress | None = None, control: JobControl | None = None
    ) -> IngestCounts:
        """Ingest every document of the job; `progress` is called after each group of documents. `control`
        may stop the job between groups (`IngestInterruptedError`, or `IngestYieldedError` when others wait: the
        groups done stay done) or cancel it (`IngestCancelledError`, after withdrawing the unfinished documents)."""
        control = control or JobControl()
        counts = IngestCounts.carried(job.progress)
        done = 0  # documents of this run finished
        for group in self._groups(job.documents, counts):
            if control.should_stop():
                raise IngestInterruptedError(counts, done)
            if control.cancelled():
                raise self._cancel(job, done, set(), counts)
            self._store_kv(group, counts, progress)
            superseded: set[str] = set()
            for i, prepared in enumerate(group):
                if control.cancelled():  # the blocks stored for this group and not yet named go too
                    raise self._cancel(job, done, superseded | {k for p in group[i:] for k in p.keys}, counts)
                with applying(self.order, prepared.doc.id, job.sequence) as current:
                    if current:
                        self._index(prepared, counts)
                    else:
                        counts.documents_superseded += 1
                        superseded.update(prepared.keys)
                counts.documents_done += 1
                done += 1
            # KV computed above for documents a later job made moot: released unless some point names it.
            counts.blocks_released += self._release(superseded)
            if progress is not None:
                progress(counts)
            if done < len(job.documents) and control.should_yield():
                raise IngestYieldedError(counts, done)
        return counts

    def withdraw(self, job: Job, stored: Collection[str] = ()) -> int:
        """A cancelled job's documents (those of `job`, the rest not finished) are left as they were before it:
        their unpublished points go and the blocks it `stored`, those points named, or its documents' chunks have
        are released unless some point names them; how many blocks. Each document is then counted as applied (it
        is no longer pending). A document a later job was submitted for is left to that job.

        The documents' own blocks count because a run killed between storing a group's KV and writing its points
        (SIGKILL, a crash) left blocks that no point and no `stored` names: only the chunk keys find them."""
        if isinstance(job, DeleteJob):
            with applying(self.order, job.doc_id, job.sequence):
                return 0
        ids = {doc.id for doc in job.documents}
        unpublished: dict[str, set[str]] = {}
        for doc_id, _, key in self.collection.invisible_points():  # one scan, not one per document
            if doc_id in ids:
                unpublished.setdefault(doc_id, set()).add(key)
        keys = set(stored)
        for doc in job.documents:
            with applying(self.order, doc.id, job.sequence) as current:
                if not current:
                    continue
                if doc.id in unpublished:
                    self.collection.delete_invisible(doc.id)
                    keys |= unpublished[doc.id]
                keys |= self._keys_of(doc)
        keys.discard("")
        return self._release(keys)

    def _cancel(self, job: IngestJob, done: int, stored: set[str], counts: IngestCounts) -> IngestCancelledError:
        rest = IngestJob(job.job_id, job.documents[done:], job.sequence)
        counts.blocks_released += self.withdraw(rest, stored)
        return IngestCancelledError(counts)

    def abandon(self, job: IngestJob) -> int:
        """Clean up after a job given up on: its documents' unpublished points go, and the KV blocks it stored
        that no point names are released; how many blocks. Published documents are left as they are."""
        keys: set[str] = set()
        for doc in job.documents:
            with self.order.hold(doc.id):
                keys |= {p.kv_key for p in self.collection.document_state(doc.id) if not p.visible and p.kv_key}
                self.collection.delete_invisible(doc.id)
            keys |= self._keys_of(doc)
        return self._release(keys)

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

    def _keys_of(self, doc: Document) -> set[str]:
        """The block keys a document's chunks have; none when it cannot be chunked (why its job failed, maybe)."""
        try:
            return set(self._prepare(doc).keys)
        except Exception:
            log.warning("cannot chunk document %r of an abandoned job; only its points' blocks are released", doc.id)
            return set()

    def _prepare(self, doc: Document) -> _Prepared:
        markdown = doc.format == "markdown"
        chunks = self.chunker.chunk(doc.id, doc.text, markdown=markdown)
        blocks = [self.template.chunk_block(c.token_ids) for c in chunks]
        keys = [self.store.key_of(b) for b in blocks]
        outline = Outline(doc.text, markdown, document_title(doc.metadata, doc.text, markdown))
        contexts = [outline.context(c.char_start, c.char_end) for c in chunks]
        return _Prepared(doc, document_version(doc, self._chunking), chunks, blocks, keys, contexts)

    def _store_kv(self, group: list[_Prepared], counts: IngestCounts, progress: Progress | None = None) -> None:
        """Compute and store the KV of every block not stored yet, in batches that fill the device; `progress`
        hears of the group's chunks once counted and after each batch (`chunks_done`)."""
        missing: dict[str, TokenIds] = {}
        chunk_ids: dict[str, TokenIds] = {}
        for prepared in group:
            for key, block, chunk in zip(prepared.keys, prepared.blocks, prepared.chunks, strict=True):
                if key not in missing and not self.store.contains(key):
                    missing[key] = block
                    chunk_ids[key] = tuple(chunk.token_ids)
        counts.chunks += sum(len(p.keys) for p in group)
        counts.chunks_precomputed += len(missing)  # a block shared by several chunks is computed once
        counts.chunks_reused += sum(len(p.keys) for p in group) - len(missing)
        # A block shared by several chunks of the group finishes them all: the chunks wait per distinct block.
        waiting = Counter(key for p in group for key in p.keys if key in missing)
        counts.chunks_done += sum(len(p.keys) for p in group) - sum(waiting.values())
        if progress is not None:
            progress(counts)
        keys = list(missing)

        def batch_done(indices: Sequence[int]) -> None:
            counts.chunks_done += sum(waiting[keys[i]] for i in indices)
            if progress is not None:
                progress(counts)

        start = time.perf_counter()
        blocks = list(missing.values())
        if self.place_kv is not None:
            self.place_kv(keys, [chunk_ids[k] for k in keys], batch_done)
        else:
            precompute_and_store(
                self.precompute, self.store.put, blocks, self.max_precompute_tokens, on_batch=batch_done
            )
        counts.tokens_precomputed += sum(len(ids) for ids in blocks)
        counts.add_time("precompute", time.perf_counter() - start)

    def _index(self, prepared: _Prepared, counts: IngestCounts) -> None:
        """Embed and write the document's points unpublished unless they are all in place, then publish the
        version (which drops the others) unless it is the only one and visible already.

        One read finds what the document has now. Each call here is per document: against embedded Qdrant, which
        answers a filter by checking every point, one by filter would make ingest quadratic in the corpus; the
        collection answers these by point id there (`ChunkCollection`'s per-document index)."""
        doc, version = prepared.doc, prepared.version
        existing = self.collection.document_state(doc.id)
        mine = [p for p in existing if p.version == version]
        written = len(mine) == len(prepared.chunks)
        if not written:
            start = time.perf_counter()
            texts = [embedding_text(x, c.text) for c, x in zip(prepared.chunks, prepared.contexts, strict=True)]
            vectors = self.embedder.embed_documents(texts)
            counts.add_time("embed", time.perf_counter() - start)
            start = time.perf_counter()
            contexts = [x.payload() for x in prepared.contexts]
            self.collection.upsert(
                prepared.chunks,
                vectors,
                version,
                prepared.keys,
                doc.metadata,
                visible=False,
                contexts=contexts,
                texts=texts,
            )
            counts.add_time("upsert", time.perf_counter() - start)
        if not written or len(mine) != len(existing) or not all(p.visible for p in mine):
            self.collection.publish(doc.id, version)
        previous_keys = {p.kv_key for p in existing if p.version != version and p.kv_key}
        counts.blocks_released += self._release(previous_keys - set(prepared.keys))

    def _release(self, keys: set[str]) -> int:
        """Remove the blocks no point names any more from the KV store; how many went."""
        if not keys:
            return 0
        unused = keys - self.collection.referenced_kv_keys(sorted(keys))
        for key in unused:
            self.store.remove(key)
        return len(unused)


def sweep_unpublished(collection: ChunkCollection, store: KVStore, keep: Collection[str]) -> SweepReport:
    """At start, with no other process on the data: unpublished points belong to jobs that died. Delete those of
    documents no queued job names (`keep`: a queued job redoes its own) and release their KV blocks that no point
    names any more."""
    left = [(doc_id, key) for doc_id, _, key in collection.invisible_points() if doc_id not in keep]
    documents = sorted({doc_id for doc_id, _ in left})
    deleted = sum(collection.delete_invisible(doc_id) for doc_id in documents)
    keys = sorted({key for _, key in left if key})
    unused = set(keys) - collection.referenced_kv_keys(keys)
    for key in unused:
        store.remove(key)
    return SweepReport(deleted, len(unused), tuple(documents))


def sweep_unnamed_blocks(collection: ChunkCollection, store: KVStore, stored_before: float) -> int:
    """Release the stored blocks that no point names, among those stored before `stored_before` (a Unix time);
    how many. A job killed between storing a group's KV and writing its points leaves such blocks, and when that
    job never runs again (cancelled, failed, its queue lost) nothing else would find them. Blocks stored later may
    belong to a job under way in another process, about to write the points that name them: they are left."""
    keys = store.stored_before(stored_before)
    released = 0
    for start in range(0, len(keys), SWEEP_PAGE):
        page = keys[start : start + SWEEP_PAGE]
        for key in set(page) - collection.referenced_kv_keys(page):
            store.remove(key)
            released += 1
    return released
