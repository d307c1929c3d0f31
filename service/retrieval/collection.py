"""The chunk collection in Qdrant: one collection per deployment, one point per chunk.

Point ids are uuid5 of (doc_id, version, chunk index), so ingesting the same document twice writes the same points
and a retried job cannot duplicate them, while two versions of a document never share a point.

A document version becomes visible all at once: its points are written with `visible: false`, and `publish`
then marks them visible and deletes every other version of the document in one step. Searches and the listing
skip points marked invisible (points written before the flag existed have none, and count as visible). So a
re-ingested document is searchable throughout (the old version until the switch), and a job killed midway
leaves invisible points only (swept at the next start, or taken over by the job's retry).

Embedded Qdrant commits every point on its own; `publish` gathers its writes into one SQLite transaction there,
so a process killed mid-publish leaves either the old version or the new one on disk, never a mix (and `upsert`
its batch, one commit instead of one per point).

Embedded Qdrant has no payload index: it answers a filter (a scroll, a count, a delete or set-payload by filter) by
checking it in Python on every point ever written, ~10 µs a point. Ingest asks about one document at a time, so by
filter each document would cost time linear in the collection (four such calls a document made a 1,000-document
ingest quadratic). So in embedded mode, the one client of its folder, the collection keeps `_PointIndex`: which
points each document has and which points name each KV key (facts a point id fixes), and the per-document reads
and writes go by point id (`retrieve`, id lists) instead: their cost is the document's points, not the collection's.
The same index holds each point's unit vector and visibility (`DenseRows`), so a round of questions' dense search
there is one matrix product and a read of the winners by id, where embedded Qdrant would score every point again
for each question.

Each payload carries the chunk's token ids, so the gateway builds KV blocks from them and never re-tokenizes. They
are packed into one string (`service.packed_ids`): a search copies and decodes each hit's payload
(embedded Qdrant deep-copies it, a server sends it as JSON), and a list of ~500 ints per hit made that the largest
cost of retrieval under load (16 hits x 32 concurrent questions). Points written as a plain list still read.

Search is hybrid by default: each point holds its dense vector (the unnamed default vector) and a BM25-style
sparse vector ("bm25", `service.retrieval.sparse`; Qdrant weighs its terms by IDF), and a question runs both and
fuses the two rankings by reciprocal rank (RRF). A collection created before the sparse vector existed has none: it
keeps working with dense search only (said once at open; re-create it and ingest again to get hybrid search).

Qdrant runs embedded (a folder under the data dir; one client per folder per process) or as a server (a URL).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qdrant_client import QdrantClient, models
from threadpoolctl import ThreadpoolController

from service.engine.kv_layout import TokenIds
from service.packed_ids import pack_token_ids, unpack_token_ids
from service.retrieval import sparse
from service.retrieval.chunker import Chunk
from service.retrieval.dense_rows import DenseRows
from service.retrieval.document_summary import DocumentSummary
from service.search_filter import (
    DOC_ID_KEY,
    INGESTED_AT_KEY,
    AnyOf,
    Condition,
    Match,
    Range,
    SearchFilter,
    epoch_seconds,
)

log = logging.getLogger(__name__)

# Fixed forever: changing it would re-key every stored point.
POINT_ID_NAMESPACE = uuid.UUID("5b0c3f3e-6f1d-4d0a-9a51-3c1b8f0e7a42")
DEFAULT_COLLECTION = "kvstitch_chunks"
UPSERT_BATCH = 256
SCROLL_PAGE = 512


class CollectionMismatchError(ValueError):
    """The collection exists with vectors the embedder does not make (another size or distance)."""


VISIBLE = "visible"
# Extra hits an embedded search asks for so that unpublished points among the best can be dropped afterwards.
EMBEDDED_OVERFETCH = 16
SPARSE_VECTOR = "bm25"
# Each ranking a hybrid search fuses holds this many times top_k hits, so a chunk that only one of the two ranks
# near the top still reaches the fusion.
HYBRID_PREFETCH = 4


def point_id(doc_id: str, index: int, version: str) -> str:
    """The point id of a chunk of one version of a document; JSON keeps ("a:1", 2) and ("a", 12)-like tuples
    apart."""
    return str(uuid.uuid5(POINT_ID_NAMESPACE, json.dumps([doc_id, version, index])))


@dataclass(frozen=True)
class SearchOptions:
    """How one question searches beyond its vector and text: a metadata filter, and hybrid on or off (None: the
    collection's default; on needs the sparse vector, without it the search is dense)."""

    filter: SearchFilter | None = None
    hybrid: bool | None = None


PLAIN_SEARCH = SearchOptions()


@dataclass(frozen=True)
class StoredPoint:
    """What an ingest needs to know of one of a document's points."""

    version: str
    kv_key: str
    visible: bool


@dataclass(frozen=True)
class RetrievedChunk:
    """A search hit: the chunk, its score (cosine similarity; with hybrid search the fused reciprocal-rank score)
    and what the KV plan needs."""

    id: str
    doc_id: str
    index: int
    score: float
    text: str
    token_ids: TokenIds
    version: str
    kv_key: str
    char_start: int
    char_end: int
    metadata: Mapping[str, Any] = field(default_factory=dict)
    visible: bool = True  # published (searches return published chunks only)
    context: Mapping[str, Any] = field(default_factory=dict)  # title, headings, page, last_page (those known)


class _PointIndex:
    """Embedded mode: the points of each document and the points naming each KV key. A point's document and KV key
    never change (its id is made of the document, the version and the index; the key of the chunk's content), so
    only which points exist is tracked, as this collection writes and deletes them; the version's other fields are
    read from Qdrant by id. `dense` also keeps each point's unit vector and visibility, which only this collection's
    upserts and publishes change, for the dense search."""

    def __init__(self, dimension: int) -> None:
        self.by_doc: dict[str, set[str]] = {}
        self.by_key: dict[str, set[str]] = {}
        self.of_point: dict[str, tuple[str, str]] = {}  # point id -> (doc id, KV key)
        self.dense = DenseRows(dimension)  # the dense search's vectors and visibility

    def add(self, point: str, doc_id: str, kv_key: str) -> None:
        self.remove(point)
        self.of_point[point] = (doc_id, kv_key)
        self.by_doc.setdefault(doc_id, set()).add(point)
        if kv_key:
            self.by_key.setdefault(kv_key, set()).add(point)

    def remove(self, point: str) -> None:
        self.dense.remove(point)
        known = self.of_point.pop(point, None)
        if known is None:
            return
        doc_id, kv_key = known
        _discard(self.by_doc, doc_id, point)
        if kv_key:
            _discard(self.by_key, kv_key, point)

    def points_of(self, doc_id: str) -> list[str]:
        return sorted(self.by_doc.get(doc_id, ()))


def _discard(sets: dict[str, set[str]], name: str, point: str) -> None:
    members = sets.get(name)
    if members is not None:
        members.discard(point)
        if not members:
            del sets[name]


@functools.cache
def _numpy_blas_on_one_thread() -> None:
    """Embedded mode's searches are numpy products over every point (Qdrant's own and `DenseRows`'). OpenBLAS
    would run each on a thread per core, and its threads spin after the product, taking the cores of the gateway's
    request path and of any replica beside it. Limiting BLAS around each search did not hold: setting the count
    back after it woke the pool, which then spun on all 16 cores of a GPU machine for every search. So the first
    embedded collection keeps the process's numpy BLAS on one thread for good; nothing else in a gateway uses
    numpy's BLAS (the models run on torch), and one thread does a round's product in about a millisecond."""
    ThreadpoolController().limit(limits=1, user_api="blas")


class ChunkCollection:
    """Chunks and their vectors in one Qdrant collection; `path` for embedded mode, `url` for a server. `hybrid`:
    search with the sparse vector too (when the collection has one; points get it whenever it does)."""

    def __init__(
        self,
        name: str,
        dimension: int,
        *,
        path: str | Path | None = None,
        url: str | None = None,
        api_key: str | None = None,
        timeout_s: int = 10,
        hybrid: bool = True,
        filter_indexes: Mapping[str, str] | None = None,
    ) -> None:
        if (path is None) == (url is None):
            raise ValueError("give exactly one of path (embedded Qdrant) or url (Qdrant server)")
        if dimension < 1:
            raise ValueError(f"dimension must be positive, got {dimension}")
        self.name = name
        self.dimension = dimension
        self.embedded = path is not None
        if path is not None:
            Path(path).mkdir(parents=True, exist_ok=True)
            self._client = QdrantClient(path=str(path))
        else:
            self._client = QdrantClient(url=url, api_key=api_key, timeout=timeout_s)
        # Embedded Qdrant is plain Python state over SQLite, not made for concurrent callers; a server is.
        self._lock: contextlib.AbstractContextManager[Any] = (
            threading.RLock() if self.embedded else contextlib.nullcontext()
        )
        if self.embedded:
            _numpy_blas_on_one_thread()
        self.sparse = self._ensure_collection()
        self._index: _PointIndex | None = None  # embedded mode: built at the first per-document call
        if not self.embedded:  # payload indexes do nothing in embedded mode
            self._index_metadata(filter_indexes or {})
        self.hybrid = hybrid and self.sparse
        if hybrid and not self.sparse:
            log.warning(
                "collection %r has no sparse vector %r (created before hybrid search): searching dense only; "
                "re-create it and ingest again for hybrid search",
                name,
                SPARSE_VECTOR,
            )

    # ---- writes ----------------------------------------------------------------------------------------------

    def upsert(
        self,
        chunks: Sequence[Chunk],
        vectors: Sequence[Sequence[float]],
        version: str,
        kv_keys: Sequence[str] | None = None,
        metadata: Mapping[str, Any] | None = None,
        visible: bool = True,
        contexts: Sequence[Mapping[str, Any]] | None = None,
        texts: Sequence[str] | None = None,
    ) -> list[str]:
        """Write one point per chunk (same ids for the same doc, version and index: re-running is harmless); their
        ids. Ingestion writes them invisible and `publish`es the version once every chunk is in. `contexts`: per
        chunk, where it sits (title, heading path, pages; `outline.ChunkContext.payload`). `texts`: per chunk, what
        its sparse vector is made of (what was embedded for it; the chunk's text if not given)."""
        keys = list(kv_keys) if kv_keys is not None else [""] * len(chunks)
        where = list(contexts) if contexts is not None else [{}] * len(chunks)
        terms = list(texts) if texts is not None else [c.text for c in chunks]
        if not len(chunks) == len(vectors) == len(keys) == len(where) == len(terms):
            raise ValueError(
                f"got {len(chunks)} chunks, {len(vectors)} vectors, {len(keys)} KV keys, {len(where)} contexts, "
                f"{len(terms)} texts"
            )
        points = [
            self._point(chunk, vector, version, key, metadata or {}, visible, context, text)
            for chunk, vector, key, context, text in zip(chunks, vectors, keys, where, terms, strict=True)
        ]
        with self._lock, self._indexed_writes() as index:
            for start in range(0, len(points), UPSERT_BATCH):
                with _one_local_transaction(self._client, self.name):
                    self._client.upsert(self.name, points=points[start : start + UPSERT_BATCH], wait=True)
            if index is not None:
                for point, chunk, key, vector in zip(points, chunks, keys, vectors, strict=True):
                    index.add(str(point.id), chunk.doc_id, key)
                    index.dense.put(str(point.id), vector, visible)
        return [str(p.id) for p in points]

    def delete_document(self, doc_id: str, keep_version: str | None = None) -> int:
        """Delete a document's points, or all but those of `keep_version`; how many were deleted."""
        if self.embedded:
            with self._lock:
                records = self._document_records(doc_id, ["version"])
                kept = {
                    p for p, payload in records if keep_version is not None and payload.get("version") == keep_version
                }
                return self._delete_points([p for p, _ in records if p not in kept])
        selector = _document_filter(doc_id, keep_version)
        with self._lock:
            matching = self._client.count(self.name, count_filter=selector, exact=True).count
            if matching:
                self._client.delete(self.name, points_selector=models.FilterSelector(filter=selector), wait=True)
        return matching

    def publish(self, doc_id: str, version: str) -> int:
        """Make one version of a document the visible one: its points visible, every other version's deleted, in
        one step (one transaction in embedded Qdrant); how many points of other versions were deleted."""
        if self.embedded:
            return self._publish_by_id(doc_id, version)
        shown = _version_filter(doc_id, version)
        others = _document_filter(doc_id, keep_version=version)
        operations: list[Any] = [
            models.SetPayloadOperation(set_payload=models.SetPayload(payload={VISIBLE: True}, filter=shown)),
            models.DeleteOperation(delete=models.FilterSelector(filter=others)),
        ]
        with self._lock:
            deleted = self._client.count(self.name, count_filter=others, exact=True).count
            with _one_local_transaction(self._client, self.name):
                self._client.batch_update_points(self.name, operations, wait=True)
        return deleted

    def _publish_by_id(self, doc_id: str, version: str) -> int:
        """`publish` in embedded mode: the document's points by id, not by filter (see the module's note)."""
        with self._lock:
            records = self._document_records(doc_id, ["version"])
            shown = [p for p, payload in records if payload.get("version") == version]
            others = [p for p, payload in records if payload.get("version") != version]
            operations: list[Any] = []
            if shown:
                payload = models.SetPayload(payload={VISIBLE: True}, points=shown)
                operations.append(models.SetPayloadOperation(set_payload=payload))
            if others:
                operations.append(models.DeleteOperation(delete=models.PointIdsList(points=others)))
            if operations:
                with self._indexed_writes() as index, _one_local_transaction(self._client, self.name):
                    self._client.batch_update_points(self.name, operations, wait=True)
                    if index is not None:
                        for point in others:
                            index.remove(point)
                        for point in shown:
                            index.dense.show(point)
        return len(others)

    def delete_invisible(self, doc_id: str) -> int:
        """Delete a document's points not published (left by a job that failed or died); how many."""
        if self.embedded:
            with self._lock:
                records = self._document_records(doc_id, [VISIBLE])
                return self._delete_points([p for p, payload in records if payload.get(VISIBLE) is False])
        selector = models.Filter(must=[_match("doc_id", doc_id), _invisible()])
        with self._lock:
            matching = self._client.count(self.name, count_filter=selector, exact=True).count
            if matching:
                self._client.delete(self.name, points_selector=models.FilterSelector(filter=selector), wait=True)
        return matching

    def invisible_points(self) -> list[tuple[str, str, str]]:
        """(doc id, version, KV key) of every point not published (what a start-up sweep looks at)."""
        payloads = self._scroll(models.Filter(must=_invisible()), ["doc_id", "version", "kv_key"])
        return [(str(p.get("doc_id", "")), str(p.get("version", "")), str(p.get("kv_key", ""))) for p in payloads]

    # ---- reads -----------------------------------------------------------------------------------------------

    def search(
        self,
        vector: Sequence[float],
        top_k: int = 5,
        text: str | None = None,
        options: SearchOptions = PLAIN_SEARCH,
    ) -> list[RetrievedChunk]:
        """The `top_k` chunks nearest to the vector, best first; with the question's `text`, hybrid (when on)."""
        return self.search_many([vector], [top_k], None if text is None else [text], [options])[0]

    def documents(self, doc_id: str | None = None) -> list[DocumentSummary]:
        """Every stored document (or the one named), sorted by id. One scroll over the points' small payload
        fields: linear in the corpus, fine for the listing API at thousands of documents."""
        selector = _shown(_document_filter(doc_id, None) if doc_id is not None else None)
        fields = ["doc_id", "version", "token_count", "metadata", "ingested_at"]
        grouped: dict[str, list[Mapping[str, Any]]] = {}
        for payload in self._scroll(selector, fields):
            grouped.setdefault(str(payload.get("doc_id", "")), []).append(payload)
        return [_summary(name, grouped[name]) for name in sorted(grouped)]

    def search_many(
        self,
        vectors: Sequence[Sequence[float]],
        top_ks: Sequence[int],
        texts: Sequence[str] | None = None,
        options: Sequence[SearchOptions] | None = None,
    ) -> list[list[RetrievedChunk]]:
        """`search` for several vectors (and their questions' texts) in one call (one round trip to a server).
        `options`: per question, a filter and hybrid on/off; such questions are searched one by one."""
        if len(vectors) != len(top_ks) or (texts is not None and len(texts) != len(vectors)):
            raise ValueError(f"{len(vectors)} vectors for {len(top_ks)} top_k values and {len(texts or [])} texts")
        if options is not None and len(options) != len(vectors):
            raise ValueError(f"{len(vectors)} vectors for {len(options)} search options")
        if any(k < 1 for k in top_ks):
            raise ValueError("top_k must be positive")
        for vector in vectors:
            self._check_vector(vector)
        if options is not None and any(o != PLAIN_SEARCH for o in options):
            return [
                self._search_with(v, k, None if texts is None else texts[i], options[i])
                for i, (v, k) in enumerate(zip(vectors, top_ks, strict=True))
            ]
        if self.hybrid and texts is not None:
            return self._search_hybrid(vectors, texts, top_ks)
        if not self.embedded:  # a server filters through its payload index
            return self._query(vectors, _SHOWN, top_ks)
        return self._search_embedded(vectors, top_ks)

    def _search_with(
        self, vector: Sequence[float], top_k: int, text: str | None, options: SearchOptions
    ) -> list[RetrievedChunk]:
        """One question with its options. A filter is always sent to Qdrant with the published-only condition (an
        over-fetch and a drop afterwards cannot know how deep to look for the filter's matches)."""
        selector = _shown(to_qdrant(options.filter) if options.filter is not None else None)
        hybrid = self.hybrid if options.hybrid is None else options.hybrid and self.sparse
        if hybrid and text is not None:
            request = models.QueryRequest(
                prefetch=self._prefetches(vector, text, HYBRID_PREFETCH * top_k, selector),
                query=models.FusionQuery(fusion=models.Fusion.RRF),
                limit=top_k,
                with_payload=True,
            )
            with self._lock:
                (response,) = self._client.query_batch_points(self.name, requests=[request])
            return [_retrieved(h) for h in response.points]
        return self._query([vector], selector, [top_k])[0]

    def _search_embedded(self, vectors: Sequence[Sequence[float]], top_ks: Sequence[int]) -> list[list[RetrievedChunk]]:
        """A round's dense search from the collection's own vectors (`DenseRows`): one product for the round, the
        winners' payloads read by id. Should a winner be gone from Qdrant (the index out of step), the index is
        dropped, to be built again, and the round asked of Qdrant."""
        with self._lock:
            ranked = self._point_index().dense.nearest(vectors, top_ks)
            winners = sorted({point for hits in ranked for point, _ in hits})
            records = self._client.retrieve(self.name, winners, with_payload=True) if winners else []
            payloads = {str(record.id): record.payload or {} for record in records}
            if len(payloads) == len(winners):
                return [[_retrieved_from(p, score, payloads[p]) for p, score in hits] for hits in ranked]
            log.warning("embedded collection %r: the search index was out of step with Qdrant; rebuilt", self.name)
            self._index = None
        return self._search_embedded_by_query(vectors, top_ks)

    def _search_embedded_by_query(
        self, vectors: Sequence[Sequence[float]], top_ks: Sequence[int]
    ) -> list[list[RetrievedChunk]]:
        """Embedded Qdrant checks a filter in Python on every point for every query: at 400 points and 32 queries
        that was most of a retrieval round. So query unfiltered for a few more hits than asked and drop the
        unpublished ones here. The result is exact: when the deeper list holds `k` published hits they are the `k`
        best published ones; when it was cut short of them (unpublished points crowd the top, mid-ingest), that
        question is asked again with the filter."""
        limits = [k + EMBEDDED_OVERFETCH for k in top_ks]
        results: list[list[RetrievedChunk] | None] = []
        for hits, k, limit in zip(self._points(vectors, None, limits), top_ks, limits, strict=True):
            shown = [h for h in hits if (h.payload or {}).get(VISIBLE) is not False]
            exact = len(shown) >= k or len(hits) < limit
            results.append([_retrieved(h) for h in shown[:k]] if exact else None)
        again = [i for i, r in enumerate(results) if r is None]
        if again:
            redo = self._query([vectors[i] for i in again], _SHOWN, [top_ks[i] for i in again])
            for i, found in zip(again, redo, strict=True):
                results[i] = found
        return [r or [] for r in results]

    def _search_hybrid(
        self, vectors: Sequence[Sequence[float]], texts: Sequence[str], top_ks: Sequence[int]
    ) -> list[list[RetrievedChunk]]:
        """Dense and sparse rankings of published points fused by reciprocal rank. Both rankings take the filter:
        dropping unpublished hits after fusion (as `_search_embedded_by_query` does) would leave the ranks they held
        in the fused scores, so the order would differ from the filtered one. Embedded Qdrant checks a filter in
        Python on every point for each ranking, so there the filter is left out while no point is unpublished (the
        usual case between ingests, known from the collection's own index), under the same lock as the query."""
        with self._lock:
            selector = _SHOWN if not self.embedded or self._has_invisible() else None
            requests = [
                models.QueryRequest(
                    prefetch=self._prefetches(vector, text, HYBRID_PREFETCH * k, selector),
                    query=models.FusionQuery(fusion=models.Fusion.RRF),
                    limit=k,
                    with_payload=True,
                )
                for vector, text, k in zip(vectors, texts, top_ks, strict=True)
            ]
            responses = self._client.query_batch_points(self.name, requests=requests)
        return [[_retrieved(h) for h in r.points] for r in responses]

    def _has_invisible(self) -> bool:
        if self.embedded:
            return self._point_index().dense.has_hidden()
        return self._client.count(self.name, count_filter=models.Filter(must=_invisible()), exact=True).count > 0

    def _prefetches(
        self, vector: Sequence[float], text: str, limit: int, selector: models.Filter | None
    ) -> list[models.Prefetch]:
        prefetches = [models.Prefetch(query=list(vector), filter=selector, limit=limit)]
        question = sparse.query_vector(text)
        if question.indices:  # a question with no word (only punctuation) ranks by the dense vector alone
            query = models.SparseVector(indices=question.indices, values=question.values)
            prefetches.append(models.Prefetch(query=query, using=SPARSE_VECTOR, filter=selector, limit=limit))
        return prefetches

    def _query(
        self, vectors: Sequence[Sequence[float]], selector: models.Filter | None, limits: Sequence[int]
    ) -> list[list[RetrievedChunk]]:
        return [[_retrieved(h) for h in hits] for hits in self._points(vectors, selector, limits)]

    def _points(
        self, vectors: Sequence[Sequence[float]], selector: models.Filter | None, limits: Sequence[int]
    ) -> list[list[models.ScoredPoint]]:
        if self.embedded:
            # Embedded Qdrant answers a batch by deep-copying every request (its query vector float by float)
            # and then querying them one by one: asking one by one skips the copies, half of a search's time.
            with self._lock:
                return [
                    self._client.query_points(
                        self.name, query=list(v), query_filter=selector, limit=limit, with_payload=True
                    ).points
                    for v, limit in zip(vectors, limits, strict=True)
                ]
        requests = [
            models.QueryRequest(query=list(v), filter=selector, limit=limit, with_payload=True)
            for v, limit in zip(vectors, limits, strict=True)
        ]
        responses = self._client.query_batch_points(self.name, requests=requests)
        return [list(r.points) for r in responses]

    def chunk_texts(self) -> Iterator[tuple[str, int, str]]:
        """(doc_id, index, text) of every published chunk, in Qdrant's scroll order: what an offline job reads
        to make questions from the corpus (`kvstitch finetune --data-dir`)."""
        for payload in self._scroll(_SHOWN, ["doc_id", "index", "text"]):
            yield str(payload.get("doc_id", "")), int(payload.get("index", 0)), str(payload.get("text", ""))

    def document_versions(self, doc_id: str) -> set[str]:
        """The versions a document has points of (more than one only while a re-ingest is under way or failed)."""
        return {str(p.get("version", "")) for p in self._document_payloads(doc_id, ["version"])}

    def count(self) -> int:
        with self._lock:
            return self._client.count(self.name, exact=True).count

    def document_points(self, doc_id: str) -> list[tuple[str, str]]:
        """(version, KV key) of each of a document's points, in one read (what an ingest needs to decide)."""
        payloads = self._document_payloads(doc_id, ["version", "kv_key"])
        return [(str(p.get("version", "")), str(p.get("kv_key", ""))) for p in payloads]

    def document_state(self, doc_id: str) -> list[StoredPoint]:
        """Version, KV key and visibility of each of a document's points, in one read (by id in embedded mode)."""
        payloads = self._document_payloads(doc_id, ["version", "kv_key", VISIBLE])
        return [
            StoredPoint(str(p.get("version", "")), str(p.get("kv_key", "")), p.get(VISIBLE) is not False)
            for p in payloads
        ]

    def document_kv_keys(self, doc_id: str, exclude_version: str | None = None) -> set[str]:
        """The KV keys a document's points name (of every version but `exclude_version`)."""
        if self.embedded:
            payloads = self._document_payloads(doc_id, ["version", "kv_key"])
            keys = {
                str(p.get("kv_key", ""))
                for p in payloads
                if exclude_version is None or p.get("version") != exclude_version
            }
            keys.discard("")
            return keys
        return self._scroll_kv_keys(_document_filter(doc_id, exclude_version))

    def referenced_kv_keys(self, kv_keys: Sequence[str]) -> set[str]:
        """Which of these KV keys some point still names (the rest can be released)."""
        if self.embedded:
            with self._lock:
                index = self._point_index()
                return {key for key in kv_keys if key and key in index.by_key}
        found: set[str] = set()
        for start in range(0, len(kv_keys), SCROLL_PAGE):
            page = list(kv_keys[start : start + SCROLL_PAGE])
            selector = models.Filter(must=models.FieldCondition(key="kv_key", match=models.MatchAny(any=page)))
            found |= self._scroll_kv_keys(selector)
        return found

    def _document_payloads(self, doc_id: str, fields: list[str]) -> list[Mapping[str, Any]]:
        """The chosen payload fields of each of a document's points: by id in embedded mode, else one scroll."""
        if self.embedded:
            with self._lock:
                return [payload for _, payload in self._document_records(doc_id, fields)]
        return list(self._scroll(_document_filter(doc_id, None), fields))

    def _document_records(self, doc_id: str, fields: list[str]) -> list[tuple[str, Mapping[str, Any]]]:
        """Embedded mode, under the lock: (point id, chosen payload fields) of each of a document's points."""
        points = self._point_index().points_of(doc_id)
        if not points:
            return []
        records = self._client.retrieve(self.name, points, with_payload=fields)
        return [(str(r.id), r.payload or {}) for r in records]

    def _delete_points(self, points: list[str]) -> int:
        """Embedded mode, under the lock: delete these points by id; how many."""
        if points:
            with self._indexed_writes() as index:
                self._client.delete(self.name, points_selector=models.PointIdsList(points=points), wait=True)
                if index is not None:
                    for point in points:
                        index.remove(point)
        return len(points)

    def _point_index(self) -> _PointIndex:
        """Embedded mode, under the lock: the index of the points by document and KV key, built by one scroll
        over the collection the first time it is needed."""
        if self._index is None:
            index = _PointIndex(self.dimension)
            total = self._client.count(self.name, exact=True).count
            offset: Any = None
            while True:  # one page in practice: each page of an embedded scroll sorts every point id
                records, offset = self._client.scroll(
                    self.name,
                    limit=max(total, 1),
                    offset=offset,
                    with_payload=["doc_id", "kv_key", VISIBLE],
                    with_vectors=True,
                )
                for record in records:
                    payload = record.payload or {}
                    index.add(str(record.id), str(payload.get("doc_id", "")), str(payload.get("kv_key", "")))
                    index.dense.put(str(record.id), _dense_vector(record.vector), payload.get(VISIBLE) is not False)
                if offset is None:
                    break
            self._index = index
        return self._index

    @contextlib.contextmanager
    def _indexed_writes(self) -> Iterator[_PointIndex | None]:
        """Embedded mode, under the lock: the index to update along with a write (None elsewhere). A write that
        fails may have applied part of its points: the index is dropped, and built again when next needed."""
        if not self.embedded:
            yield None
            return
        index = self._point_index()
        try:
            yield index
        except BaseException:
            self._index = None
            raise

    def _scroll_kv_keys(self, selector: models.Filter) -> set[str]:
        keys = {str(p.get("kv_key", "")) for p in self._scroll(selector, ["kv_key"])}
        keys.discard("")
        return keys

    def _scroll(self, selector: models.Filter | None, fields: list[str]) -> Iterator[Mapping[str, Any]]:
        """The chosen payload fields of every point the filter matches, page by page."""
        offset: Any = None
        while True:
            with self._lock:
                records, offset = self._client.scroll(
                    self.name, scroll_filter=selector, limit=SCROLL_PAGE, offset=offset, with_payload=fields
                )
            for record in records:
                yield record.payload or {}
            if offset is None:
                return

    def ping(self) -> bool:
        """Whether Qdrant answers and holds the collection (for health checks; never raises)."""
        try:
            with self._lock:
                return self._client.collection_exists(self.name)
        except Exception:  # connection, HTTP and closed-client errors all mean "not healthy" here
            return False

    def close(self) -> None:
        with self._lock:
            self._client.close()

    # ---- internals -------------------------------------------------------------------------------------------

    def _ensure_collection(self) -> bool:
        """Create the collection unless it exists, check its dense vector; whether it has the sparse one."""
        with self._lock:
            if not self._client.collection_exists(self.name):
                params = models.VectorParams(size=self.dimension, distance=models.Distance.COSINE)
                bm25 = {SPARSE_VECTOR: models.SparseVectorParams(modifier=models.Modifier.IDF)}
                try:
                    self._client.create_collection(self.name, vectors_config=params, sparse_vectors_config=bm25)
                except Exception:  # another process created it first; the check below decides
                    if not self._client.collection_exists(self.name):
                        raise
                if not self.embedded:  # payload indexes do nothing in embedded mode
                    for key in ("doc_id", "version", "kv_key"):
                        self._client.create_payload_index(self.name, key, models.PayloadSchemaType.KEYWORD)
                    self._client.create_payload_index(self.name, VISIBLE, models.PayloadSchemaType.BOOL)
                    # what metadata filters reach besides doc_id (`service.search_filter`)
                    self._client.create_payload_index(self.name, "ingested_at", models.PayloadSchemaType.FLOAT)
            config = self._client.get_collection(self.name).config.params
            self._check_vector_params(config.vectors)
            return SPARSE_VECTOR in (config.sparse_vectors or {})

    def _index_metadata(self, indexes: Mapping[str, str]) -> None:
        """Payload indexes for the metadata keys that filters use most (KVSTITCH_FILTER_INDEXES), at every open:
        Qdrant keeps an index that exists, so a key added later is indexed over the points already stored."""
        for key, kind in indexes.items():
            with self._lock:
                self._client.create_payload_index(self.name, f"metadata.{key}", models.PayloadSchemaType(kind))

    def _check_vector_params(self, vectors: Any) -> None:
        if not isinstance(vectors, models.VectorParams):
            raise CollectionMismatchError(f"collection {self.name!r} uses named vectors; kvstitch needs one vector")
        if vectors.size != self.dimension or vectors.distance != models.Distance.COSINE:
            raise CollectionMismatchError(
                f"collection {self.name!r} holds {vectors.size}-dimensional {vectors.distance.value} vectors, but the "
                f"embedder makes {self.dimension}-dimensional cosine ones; use another collection name for this "
                f"embedding model (and ingest again), or delete the old collection"
            )

    def _check_vector(self, vector: Sequence[float]) -> None:
        if len(vector) != self.dimension:
            raise ValueError(f"vector has {len(vector)} dimensions; collection {self.name!r} has {self.dimension}")

    def _point(
        self,
        chunk: Chunk,
        vector: Sequence[float],
        version: str,
        kv_key: str,
        metadata: Mapping[str, Any],
        visible: bool,
        context: Mapping[str, Any],
        text: str,
    ) -> models.PointStruct:
        self._check_vector(vector)
        payload = {
            "doc_id": chunk.doc_id,
            "version": version,
            "index": chunk.index,
            "text": chunk.text,
            "char_start": chunk.char_start,
            "char_end": chunk.char_end,
            "metadata": dict(metadata),
            "context": dict(context),
            "kv_key": kv_key,
            "token_count": chunk.token_count,
            "token_ids": pack_token_ids(chunk.token_ids),
            "ingested_at": time.time(),
            VISIBLE: visible,
        }
        point = point_id(chunk.doc_id, chunk.index, version)
        if not self.sparse:
            return models.PointStruct(id=point, vector=list(vector), payload=payload)
        terms = sparse.document_vector(text)
        vectors: dict[str, Any] = {
            "": list(vector),
            SPARSE_VECTOR: models.SparseVector(indices=terms.indices, values=terms.values),
        }
        return models.PointStruct(id=point, vector=vectors, payload=payload)


def _match(key: str, value: str) -> models.FieldCondition:
    return models.FieldCondition(key=key, match=models.MatchValue(value=value))


def _invisible() -> models.FieldCondition:
    return models.FieldCondition(key=VISIBLE, match=models.MatchValue(value=False))


# `must_not visible == false`: a point without the flag (written before it existed) is shown.
_SHOWN = models.Filter(must_not=_invisible())


def _shown(selector: models.Filter | None) -> models.Filter:
    if selector is None:
        return _SHOWN
    return models.Filter(
        must=selector.must, should=selector.should, must_not=[*_conditions(selector.must_not), _invisible()]
    )


def _conditions(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]


def to_qdrant(spec: SearchFilter) -> models.Filter:
    """A client's metadata filter as Qdrant's: metadata keys live under `metadata.` in the payload; `doc_id` and
    `ingested_at` (seconds since the epoch) are top-level fields."""
    clauses = {name: [_qdrant_condition(c) for c in conditions] for name, conditions in spec.clauses().items()}
    return models.Filter(**{name: conditions or None for name, conditions in clauses.items()})


def _qdrant_condition(condition: Condition) -> Any:
    if isinstance(condition, SearchFilter):
        return to_qdrant(condition)
    key = _payload_key(condition.key)
    if isinstance(condition, Match):
        return models.FieldCondition(key=key, match=models.MatchValue(value=condition.value))
    if isinstance(condition, AnyOf):
        return models.FieldCondition(key=key, match=models.MatchAny(any=list(condition.values)))
    return models.FieldCondition(key=key, **_qdrant_range(condition))


def _qdrant_range(condition: Range) -> dict[str, Any]:
    if condition.key == INGESTED_AT_KEY:  # stored as epoch seconds: dates become numbers
        return {"range": models.Range(**{name: epoch_seconds(b) for name, b in condition.bounds})}
    bounds = dict(condition.bounds)
    return {"range": models.DatetimeRange(**bounds) if condition.dates else models.Range(**bounds)}


def _payload_key(key: str) -> str:
    return key if key in (DOC_ID_KEY, INGESTED_AT_KEY) else f"metadata.{key}"


def _version_filter(doc_id: str, version: str) -> models.Filter:
    return models.Filter(must=[_match("doc_id", doc_id), _match("version", version)])


def _document_filter(doc_id: str, keep_version: str | None) -> models.Filter:
    if keep_version is None:
        return models.Filter(must=_match("doc_id", doc_id))
    return models.Filter(must=_match("doc_id", doc_id), must_not=_match("version", keep_version))


def _summary(doc_id: str, payloads: list[Mapping[str, Any]]) -> DocumentSummary:
    """A document from its points' payloads; mid re-ingest two versions may coexist: the newest one is shown."""
    newest = max(payloads, key=lambda p: float(p.get("ingested_at") or 0.0))
    version = str(newest.get("version", ""))
    current = [p for p in payloads if str(p.get("version", "")) == version]
    when = newest.get("ingested_at")
    return DocumentSummary(
        id=doc_id,
        version=version,
        chunks=len(current),
        tokens=sum(int(p.get("token_count") or 0) for p in current),
        ingested_at=float(when) if when is not None else None,
        metadata=dict(newest.get("metadata") or {}),
    )


def _retrieved(hit: models.ScoredPoint) -> RetrievedChunk:
    return _retrieved_from(str(hit.id), float(hit.score), hit.payload or {})


def _dense_vector(stored: Any) -> list[float]:
    """A record's dense vector: the vector itself, or the unnamed one beside the sparse vector."""
    vector = stored.get("") if isinstance(stored, dict) else stored
    if not isinstance(vector, list):
        raise ValueError(f"a point without a dense vector ({type(stored).__name__})")
    return vector


def _retrieved_from(point: str, score: float, payload: Mapping[str, Any]) -> RetrievedChunk:
    return RetrievedChunk(
        id=point,
        doc_id=str(payload["doc_id"]),
        index=int(payload["index"]),
        score=score,
        text=str(payload["text"]),
        token_ids=unpack_token_ids(payload.get("token_ids", ())),
        version=str(payload.get("version", "")),
        kv_key=str(payload.get("kv_key", "")),
        char_start=int(payload.get("char_start", 0)),
        char_end=int(payload.get("char_end", 0)),
        metadata=dict(payload.get("metadata") or {}),
        visible=payload.get(VISIBLE) is not False,  # missing: written before the flag existed, shown
        context=dict(payload.get("context") or {}),
    )


# ---- one transaction in embedded Qdrant ----------------------------------------------------------------------


class _DeferredCommits:
    """Stands in for the SQLite connection of embedded Qdrant's point storage: each point write runs as usual,
    but its own commit (`with connection:`) is skipped, so the writes of one operation commit together."""

    def __init__(self, connection: sqlite3.Connection) -> None:
        self._connection = connection

    def execute(self, sql: str, parameters: Sequence[Any] = ()) -> sqlite3.Cursor:
        return self._connection.execute(sql, parameters)

    def __enter__(self) -> _DeferredCommits:
        return self

    def __exit__(self, *exc: object) -> None:
        return None  # the surrounding `_one_local_transaction` commits or rolls back


@contextlib.contextmanager
def _one_local_transaction(client: QdrantClient, name: str) -> Iterator[None]:
    """Make the point writes of the block one SQLite transaction in embedded Qdrant (which otherwise commits each
    point alone, so a kill mid-way would leave half a document visible); a no-op with a server, which applies
    each operation whole. This reaches into qdrant-client's local storage; if that changes shape, the writes
    fall back to one commit per point and a warning says so."""
    persistence = _local_persistence(client, name)
    if persistence is None:
        yield
        return
    connection: sqlite3.Connection = persistence.storage
    persistence.storage = _DeferredCommits(connection)
    try:
        yield
    except BaseException:
        connection.rollback()
        raise
    else:
        connection.commit()
    finally:
        persistence.storage = connection


def _local_persistence(client: QdrantClient, name: str) -> Any | None:
    local = getattr(client, "_client", None)
    collections = getattr(local, "collections", None)
    if not isinstance(collections, dict):
        return None  # a Qdrant server
    persistence = getattr(collections.get(name), "storage", None)
    if persistence is None:
        return None  # in memory: nothing on disk to keep consistent
    if not isinstance(getattr(persistence, "storage", None), sqlite3.Connection):
        _warn_no_transaction()
        return None
    return persistence


@functools.cache
def _warn_no_transaction() -> None:
    log.warning("embedded Qdrant's storage changed shape: a publish is committed point by point")
