"""Embedded Qdrant checks a filter in Python on every point: the per-document calls of an ingest must go by point
id there, so that a document's cost does not grow with the collection (a 1,000-document ingest was quadratic)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from qdrant_client.local import local_collection
from threadpoolctl import threadpool_info, threadpool_limits

from service.retrieval import collection as collection_module
from service.retrieval.chunker import Chunk
from service.retrieval.collection import ChunkCollection
from service.retrieval.dense_rows import DenseRows

DIM = 4
VECTOR = [1.0, 0.0, 0.0, 0.0]


def chunks(doc_id: str, count: int, version: str = "v1") -> list[Chunk]:
    return [Chunk(doc_id, i, 0, 10, f"{doc_id} {version} chunk {i}", (i + 1, i + 2)) for i in range(count)]


def keys(doc_id: str, count: int, version: str = "v1") -> list[str]:
    return [f"{doc_id}-{version}-{i}" for i in range(count)]


def ingest(collection: ChunkCollection, doc_id: str, count: int = 3, version: str = "v1") -> None:
    """What `Ingestor._index` does for one document."""
    collection.document_state(doc_id)
    collection.upsert(
        chunks(doc_id, count, version), [VECTOR] * count, version, keys(doc_id, count, version), visible=False
    )
    collection.publish(doc_id, version)


@pytest.fixture
def collection(tmp_path: Path) -> Iterator[ChunkCollection]:
    opened = ChunkCollection("chunks", DIM, path=tmp_path / "qdrant")
    yield opened
    opened.close()


@pytest.fixture
def filtered_points(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many points each filter evaluation of embedded Qdrant checked (its whole collection, every time)."""
    checked: list[int] = []
    real = local_collection.calculate_payload_mask

    def counting(payloads: list[Any], payload_filter: Any, *args: Any, **kwargs: Any) -> Any:
        if payload_filter is not None:
            checked.append(len(payloads))
        return real(payloads, payload_filter, *args, **kwargs)

    monkeypatch.setattr(local_collection, "calculate_payload_mask", counting)
    return checked


def test_ingesting_a_document_checks_no_filter_over_the_collection(
    collection: ChunkCollection, filtered_points: list[int]
) -> None:
    for d in range(50):
        ingest(collection, f"doc-{d}")
    filtered_points.clear()

    ingest(collection, "new")
    ingest(collection, "doc-7", count=2, version="v2")  # a re-ingest: the old version goes, its blocks are free
    released = {"doc-7-v1-0", "doc-7-v1-1", "doc-7-v1-2"}

    assert collection.referenced_kv_keys(sorted(released | {"doc-8-v1-0", "new-v1-2"})) == {"doc-8-v1-0", "new-v1-2"}
    assert collection.document_kv_keys("doc-7") == {"doc-7-v2-0", "doc-7-v2-1"}
    assert collection.delete_invisible("doc-9") == 0
    assert collection.delete_document("doc-10") == 3
    assert filtered_points == []
    assert collection.count() == 50 * 3 + 3 - 1 - 3


def test_the_per_document_calls_answer_as_the_filters_did(collection: ChunkCollection) -> None:
    collection.upsert(chunks("a", 3), [VECTOR] * 3, "v1", keys("a", 3))
    collection.upsert(chunks("a", 2, "v2"), [VECTOR] * 2, "v2", keys("a", 2, "v2"), visible=False)
    collection.upsert(chunks("b", 2), [VECTOR] * 2, "v1", ["shared", "b-only"], visible=False)
    collection.upsert(chunks("c", 1), [VECTOR], "v1", ["shared"])

    assert sorted((p.version, p.visible) for p in collection.document_state("a")) == [
        ("v1", True),
        ("v1", True),
        ("v1", True),
        ("v2", False),
        ("v2", False),
    ]
    assert collection.document_versions("a") == {"v1", "v2"}
    assert collection.document_kv_keys("a", exclude_version="v2") == set(keys("a", 3))
    assert collection.publish("a", "v2") == 3
    assert [(p.version, p.visible) for p in collection.document_state("a")] == [("v2", True)] * 2
    assert collection.referenced_kv_keys(keys("a", 3) + keys("a", 2, "v2")) == set(keys("a", 2, "v2"))

    assert collection.delete_invisible("b") == 2
    assert collection.referenced_kv_keys(["shared", "b-only"]) == {"shared"}  # c still names it
    assert collection.delete_document("c") == 1
    assert collection.referenced_kv_keys(["shared"]) == set()
    assert collection.delete_document("a", keep_version="v2") == 0
    assert collection.delete_document("missing") == 0 and collection.publish("missing", "v1") == 0
    assert collection.count() == 2


def test_a_reopened_collection_finds_the_points_written_before(tmp_path: Path) -> None:
    first = ChunkCollection("chunks", DIM, path=tmp_path / "q")
    ingest(first, "a")
    first.upsert(chunks("a", 2, "v2"), [VECTOR] * 2, "v2", keys("a", 2, "v2"), visible=False)
    first.close()

    again = ChunkCollection("chunks", DIM, path=tmp_path / "q")
    assert sorted((p.version, p.visible) for p in again.document_state("a")) == [("v1", True)] * 3 + [("v2", False)] * 2
    assert again.referenced_kv_keys(keys("a", 3)) == set(keys("a", 3))
    assert again.publish("a", "v2") == 3
    assert again.referenced_kv_keys(keys("a", 3)) == set()
    again.close()


def test_a_write_that_fails_leaves_the_collection_answering_from_what_qdrant_holds(
    collection: ChunkCollection, monkeypatch: pytest.MonkeyPatch
) -> None:
    ingest(collection, "a")
    collection.upsert(chunks("a", 2, "v2"), [VECTOR] * 2, "v2", keys("a", 2, "v2"), visible=False)
    local = collection._client._client.collections["chunks"]  # type: ignore[attr-defined]
    real = local._delete_ids

    def deletes_one_then_dies(ids: list[Any]) -> None:
        real(ids[:1])
        raise OSError("killed")

    monkeypatch.setattr(local, "_delete_ids", deletes_one_then_dies)
    with pytest.raises(OSError, match="killed"):
        collection.publish("a", "v2")
    monkeypatch.setattr(local, "_delete_ids", real)

    assert len(collection.document_state("a")) == 4  # one old point went before the failure
    assert collection.publish("a", "v2") == 2
    assert [(p.version, p.visible) for p in collection.document_state("a")] == [("v2", True)] * 2
    assert collection.referenced_kv_keys(keys("a", 3)) == set()


def test_an_embedded_collection_keeps_numpy_blas_on_one_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each embedded search is a numpy product over every point: with a thread per core, the threads it wakes spin
    after it on the cores the gateway serves with. Limiting BLAS only around each search woke the pool again when
    the count was set back, so the first embedded collection sets one thread for the process, and it stays."""
    seen: list[int] = []
    ranking = DenseRows.nearest

    def counting(*args: Any, **kwargs: Any) -> Any:
        seen.append(_blas_threads())
        return ranking(*args, **kwargs)

    monkeypatch.setattr(DenseRows, "nearest", counting)
    with threadpool_limits(limits=2, user_api="blas"):  # what a 2-core machine has by default, set for the test
        collection_module._numpy_blas_on_one_thread.cache_clear()  # another test's collection may have set it
        opened = ChunkCollection("chunks", DIM, path=tmp_path / "qdrant")
        try:
            ingest(opened, "doc")
            hits = opened.search_many([VECTOR, VECTOR], [2, 2])
            after = _blas_threads()
        finally:
            opened.close()
    assert [len(h) for h in hits] == [2, 2]
    assert seen == [1]
    assert after == 1  # not set back when the search ends: setting it back is what woke the spinning pool


def _blas_threads() -> int:
    return max(lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas")
