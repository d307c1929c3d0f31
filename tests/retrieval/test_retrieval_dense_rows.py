"""Embedded mode's dense search from the collection's own vectors (`DenseRows`) gives Qdrant's own answers: the same
points in the same order with the same cosine scores, unpublished points left out, and an index out of step with
Qdrant rebuilt rather than trusted."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from service.retrieval.chunker import Chunk
from service.retrieval.collection import ChunkCollection, point_id
from service.retrieval.dense_rows import DenseRows

DIM = 8


def chunks(doc_id: str, count: int) -> list[Chunk]:
    return [Chunk(doc_id, i, 0, 10, f"{doc_id} chunk {i}", (i + 1,)) for i in range(count)]


@pytest.fixture
def collection(tmp_path: Path) -> Iterator[ChunkCollection]:
    opened = ChunkCollection("chunks", DIM, path=tmp_path / "qdrant", hybrid=False)
    yield opened
    opened.close()


def fill(collection: ChunkCollection, docs: int, per_doc: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    vectors = rng.standard_normal((docs * per_doc, DIM)).astype(np.float32)
    for d in range(docs):
        rows = vectors[d * per_doc : (d + 1) * per_doc]
        collection.upsert(chunks(f"doc{d}", per_doc), rows.tolist(), version="v1", visible=False)
        collection.publish(f"doc{d}", "v1")
    return vectors


def ranked(hits: list[list[object]]) -> list[list[tuple[str, float]]]:
    return [[(h.id, h.score) for h in row] for row in hits]  # type: ignore[attr-defined]


def assert_same(got: list[list[tuple[str, float]]], expected: list[list[tuple[str, float]]]) -> None:
    assert [[p for p, _ in row] for row in got] == [[p for p, _ in row] for row in expected]
    for row, want in zip(got, expected, strict=True):
        np.testing.assert_allclose([s for _, s in row], [s for _, s in want], atol=1e-5)


def test_a_round_ranks_as_qdrant_does(collection: ChunkCollection) -> None:
    fill(collection, docs=30, per_doc=10)
    questions = np.random.default_rng(1).standard_normal((12, DIM)).tolist()
    top_ks = [1, 5, 12, 300, 3, 7, 5, 5, 5, 5, 9, 2]
    got = ranked(collection.search_many(questions, top_ks))
    assert_same(got, ranked(collection._search_embedded_by_query(questions, top_ks)))
    assert [len(row) for row in got] == top_ks


def test_unpublished_points_are_ranked_only_once_published(collection: ChunkCollection) -> None:
    fill(collection, docs=5, per_doc=4)
    question = [1.0] + [0.0] * (DIM - 1)
    collection.upsert(chunks("new", 3), [question] * 3, version="v1", visible=False)  # the best, unpublished
    before = collection.search(question, top_k=4)
    assert all(hit.doc_id != "new" for hit in before) and len(before) == 4
    collection.publish("new", "v1")
    after = collection.search(question, top_k=4)
    assert [hit.doc_id for hit in after[:3]] == ["new"] * 3
    assert after[0].score == pytest.approx(1.0, abs=1e-6)


def test_a_new_version_replaces_the_old_points_and_a_deleted_document_leaves(collection: ChunkCollection) -> None:
    fill(collection, docs=3, per_doc=2)
    near = [0.0, 1.0] + [0.0] * (DIM - 2)
    collection.upsert(chunks("doc1", 2), [near, near], version="v2", visible=False)
    collection.publish("doc1", "v2")
    hits = collection.search(near, top_k=2)
    assert {(h.doc_id, h.version) for h in hits} == {("doc1", "v2")}
    collection.delete_document("doc1")
    assert all(hit.doc_id != "doc1" for hit in collection.search(near, top_k=10))
    assert collection.count() == 4


def test_the_index_is_built_again_from_disk_on_reopen(tmp_path: Path) -> None:
    first = ChunkCollection("chunks", DIM, path=tmp_path / "qdrant", hybrid=False)
    fill(first, docs=4, per_doc=5)
    question = np.random.default_rng(2).standard_normal((3, DIM)).tolist()
    before = ranked(first.search_many(question, [4, 4, 4]))
    first.close()
    reopened = ChunkCollection("chunks", DIM, path=tmp_path / "qdrant", hybrid=False)
    try:
        assert_same(ranked(reopened.search_many(question, [4, 4, 4])), before)
    finally:
        reopened.close()


def test_an_index_out_of_step_with_qdrant_is_rebuilt_not_trusted(
    collection: ChunkCollection, caplog: pytest.LogCaptureFixture
) -> None:
    vectors = fill(collection, docs=2, per_doc=3)
    collection.search(vectors[0].tolist(), top_k=1)  # the index is built
    collection._client.delete(collection.name, points_selector=[point_id("doc0", 0, "v1")])  # behind its back
    with caplog.at_level(logging.WARNING):
        hits = collection.search(vectors[0].tolist(), top_k=2)
    assert "out of step" in caplog.text
    assert point_id("doc0", 0, "v1") not in [h.id for h in hits] and len(hits) == 2
    assert_same(ranked([collection.search(vectors[0].tolist(), top_k=2)]), ranked([hits]))  # rebuilt: agrees


def test_rows_rank_only_visible_points_and_leave_the_callers_array_alone() -> None:
    rows = DenseRows(2)
    rows.put("a", [1.0, 0.0], visible=True)
    rows.put("b", [0.0, 2.0], visible=False)
    rows.put("c", [1.0, 1.0], visible=True)
    queries = np.array([[3.0, 0.0], [0.0, 0.0]], dtype=np.float32)
    got = rows.nearest(queries, [5, 1])
    assert [p for p, _ in got[0]] == ["a", "c"]
    assert got[0][1][1] == pytest.approx(2**-0.5)
    assert got[1][0][1] == 0.0  # a zero question scores 0 everywhere
    assert queries[0].tolist() == [3.0, 0.0]
    assert rows.has_hidden()
    rows.show("b")
    assert not rows.has_hidden() and [p for p, _ in rows.nearest([[0.0, 1.0]], [1])[0]] == ["b"]
    rows.remove("b")
    assert len(rows) == 2 and [p for p, _ in rows.nearest([[0.0, 1.0]], [1])[0]] == ["c"]
    with pytest.raises(ValueError, match="dimension 2"):
        rows.put("d", [1.0, 0.0, 0.0], visible=True)
