"""The Qdrant chunk collection in embedded mode: idempotent upserts, search, versions, deletes and mismatches."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerBase

from service.retrieval.chunker import Chunk, Chunker, ChunkerConfig
from service.retrieval.collection import (
    EMBEDDED_OVERFETCH,
    HYBRID_PREFETCH,
    ChunkCollection,
    CollectionMismatchError,
    SearchOptions,
    pack_token_ids,
    point_id,
    unpack_token_ids,
)
from service.retrieval.embedder import Embedder
from service.search_filter import parse_filter

DIM = 4
AXES = {"x": [1.0, 0.0, 0.0, 0.0], "y": [0.0, 1.0, 0.0, 0.0], "z": [0.0, 0.0, 1.0, 0.0], "w": [0.0, 0.0, 0.0, 1.0]}


def chunk(doc_id: str, index: int, text: str = "") -> Chunk:
    text = text or f"{doc_id} chunk {index}"
    return Chunk(doc_id, index, 10 * index, 10 * index + len(text), text, tuple(range(index + 1, index + 4)))


@pytest.fixture
def collection(tmp_path: Path) -> Iterator[ChunkCollection]:
    opened = ChunkCollection("chunks", DIM, path=tmp_path / "qdrant")
    yield opened
    opened.close()


def test_a_new_collection_is_empty_and_healthy(collection: ChunkCollection) -> None:
    assert collection.count() == 0
    assert collection.ping() is True
    assert collection.search(AXES["x"], top_k=3) == []


def test_upserting_the_same_chunks_twice_keeps_one_point_each(collection: ChunkCollection) -> None:
    chunks = [chunk("a", i) for i in range(3)]
    vectors = [AXES["x"], AXES["y"], AXES["z"]]
    first = collection.upsert(chunks, vectors, version="v1")
    second = collection.upsert(chunks, vectors, version="v1")
    assert first == second == [point_id("a", i, "v1") for i in range(3)]
    assert all(uuid.UUID(p).version == 5 for p in first)
    assert collection.count() == 3


def test_point_ids_are_deterministic_and_distinct() -> None:
    assert point_id("doc", 1, "v") == point_id("doc", 1, "v")
    ids = {point_id("a", 12, "v"), point_id("a1", 2, "v"), point_id("a", 1, "v"), point_id("b", 1, "v")}
    assert len(ids | {point_id("a", 1, "w")}) == 5


def test_search_returns_the_nearest_chunks_with_their_payload(collection: ChunkCollection) -> None:
    chunks = [chunk("a", 0, "about x"), chunk("a", 1, "about y"), chunk("b", 0, "about z")]
    collection.upsert(
        chunks,
        [AXES["x"], AXES["y"], AXES["z"]],
        version="v7",
        kv_keys=["k0", "", "k2"],
        metadata={"source": "unit", "tags": ["t"]},
    )
    hits = collection.search([0.9, 0.3, 0.0, 0.0], top_k=2)
    assert [(h.doc_id, h.index) for h in hits] == [("a", 0), ("a", 1)]
    assert hits[0].score > hits[1].score
    best = hits[0]
    assert best.id == point_id("a", 0, "v7")
    assert (best.text, best.token_ids, best.version, best.kv_key) == ("about x", (1, 2, 3), "v7", "k0")
    assert (best.char_start, best.char_end) == (0, 7)
    assert best.metadata == {"source": "unit", "tags": ["t"]}
    assert hits[1].kv_key == ""
    assert [h.doc_id for h in collection.search(AXES["z"], top_k=1)] == ["b"]


def test_reingest_keeps_only_the_new_version(collection: ChunkCollection) -> None:
    collection.upsert([chunk("a", i) for i in range(3)], [AXES["x"]] * 3, version="v1")
    collection.upsert([chunk("b", 0)], [AXES["y"]], version="v1")
    collection.upsert([chunk("a", i, f"new {i}") for i in range(2)], [AXES["z"]] * 2, version="v2")
    assert collection.document_versions("a") == {"v1", "v2"}  # versions never share a point

    assert collection.delete_document("a", keep_version="v2") == 3

    assert collection.document_versions("a") == {"v2"}
    assert collection.count() == 3
    texts = sorted(h.text for h in collection.search(AXES["z"], top_k=10) if h.doc_id == "a")
    assert texts == ["new 0", "new 1"]


def test_delete_document_removes_every_point_of_it(collection: ChunkCollection) -> None:
    collection.upsert([chunk("a", i) for i in range(4)], [AXES["x"]] * 4, version="v1")
    collection.upsert([chunk("b", 0)], [AXES["y"]], version="v1")
    assert collection.delete_document("a") == 4
    assert collection.delete_document("a") == 0
    assert collection.document_versions("a") == set()
    assert collection.document_versions("b") == {"v1"}
    assert collection.count() == 1


def test_document_versions_pages_through_many_points(collection: ChunkCollection) -> None:
    collection.upsert([chunk("big", i) for i in range(600)], [AXES["w"]] * 600, version="v1")
    collection.upsert([chunk("big", 600)], [AXES["w"]], version="v2")
    assert collection.document_versions("big") == {"v1", "v2"}
    assert collection.count() == 601


def test_points_survive_a_reopen_and_a_different_size_is_refused(tmp_path: Path) -> None:
    first = ChunkCollection("chunks", DIM, path=tmp_path / "q")
    first.upsert([chunk("a", 0)], [AXES["x"]], version="v1")
    first.close()
    assert first.ping() is False

    with pytest.raises(CollectionMismatchError, match=r"holds 4-dimensional Cosine vectors.*makes 384-dimensional"):
        ChunkCollection("chunks", 384, path=tmp_path / "q")
    reopened = ChunkCollection("chunks", DIM, path=tmp_path / "q")
    assert reopened.count() == 1
    reopened.close()


def test_inputs_that_do_not_match_are_refused(collection: ChunkCollection) -> None:
    with pytest.raises(ValueError, match="2 chunks, 1 vectors, 2 KV keys"):
        collection.upsert([chunk("a", 0), chunk("a", 1)], [AXES["x"]], version="v1")
    with pytest.raises(ValueError, match="vector has 3 dimensions"):
        collection.upsert([chunk("a", 0)], [[1.0, 0.0, 0.0]], version="v1")
    with pytest.raises(ValueError, match="vector has 5 dimensions"):
        collection.search([1.0] * 5)
    with pytest.raises(ValueError, match="top_k must be positive"):
        collection.search(AXES["x"], top_k=0)
    assert collection.count() == 0


def test_exactly_one_location_is_required(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="exactly one of path"):
        ChunkCollection("chunks", DIM)
    with pytest.raises(ValueError, match="exactly one of path"):
        ChunkCollection("chunks", DIM, path=tmp_path, url="http://127.0.0.1:6333")


def test_threads_can_share_an_embedded_collection(collection: ChunkCollection) -> None:
    errors: list[BaseException] = []

    def write(doc: str) -> None:
        try:
            for i in range(20):
                collection.upsert([chunk(doc, i)], [AXES["x"]], version="v1")
                collection.search(AXES["x"], top_k=3)
        except BaseException as err:  # collected so the assertion below names it
            errors.append(err)

    threads = [threading.Thread(target=write, args=(f"d{n}",)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert collection.count() == 80


def test_chunks_embedded_and_stored_are_found_by_a_question(
    tmp_path: Path, embedder: Embedder, llm_tokenizer: PreTrainedTokenizerBase
) -> None:
    documents = {
        "france": "Paris is the capital of France.\n\nThe Seine flows through Paris.",
        "baking": "Bread needs flour, water and yeast.\n\nBake it for forty minutes.",
    }
    chunker = Chunker(llm_tokenizer, ChunkerConfig(chunk_size=16, overlap=0))
    store = ChunkCollection("e2e", embedder.dimension, path=tmp_path / "qdrant")
    for doc_id, text in documents.items():
        chunks = chunker.chunk(doc_id, text)
        store.upsert(chunks, embedder.embed_documents([c.text for c in chunks]), version="v1")
    (hit,) = store.search(embedder.embed_query("Which city is the capital of France?"), top_k=1)
    store.close()
    assert (hit.doc_id, hit.text) == ("france", "Paris is the capital of France.")
    assert hit.token_ids == tuple(llm_tokenizer.encode(hit.text, add_special_tokens=False))


# ---- all-or-nothing documents --------------------------------------------------------------------------------


def visible_texts(collection: ChunkCollection, doc_id: str) -> list[str]:
    return sorted(h.text for h in collection.search(AXES["x"], top_k=50) if h.doc_id == doc_id)


def test_invisible_points_are_not_found_until_published(collection: ChunkCollection) -> None:
    collection.upsert([chunk("a", i, f"old {i}") for i in range(3)], [AXES["x"]] * 3, version="v1")
    collection.upsert([chunk("a", i, f"new {i}") for i in range(2)], [AXES["x"]] * 2, version="v2", visible=False)

    assert visible_texts(collection, "a") == ["old 0", "old 1", "old 2"]  # the old version until the switch
    assert [(d.version, d.chunks) for d in collection.documents("a")] == [("v1", 3)]
    (many,) = collection.search_many([AXES["x"]], [50])
    assert sorted(h.text for h in many) == ["old 0", "old 1", "old 2"]
    assert sorted((p.version, p.visible) for p in collection.document_state("a")) == [
        ("v1", True),
        ("v1", True),
        ("v1", True),
        ("v2", False),
        ("v2", False),
    ]

    assert collection.publish("a", "v2") == 3

    assert visible_texts(collection, "a") == ["new 0", "new 1"]
    assert collection.document_versions("a") == {"v2"}
    assert collection.invisible_points() == []


def test_points_without_the_flag_count_as_visible(collection: ChunkCollection) -> None:
    collection.upsert([chunk("old", 0, "legacy")], [AXES["x"]], version="v1")
    collection.publish("old", "v1")
    # A point as written before the flag existed: its payload has no `visible` key.
    collection._client.delete_payload(collection.name, keys=["visible"], points=[point_id("old", 0, "v1")])

    assert visible_texts(collection, "old") == ["legacy"]
    assert [p.visible for p in collection.document_state("old")] == [True]


def test_unpublished_points_are_listed_and_deleted_per_document(collection: ChunkCollection) -> None:
    collection.upsert([chunk("a", 0)], [AXES["x"]], version="v1", kv_keys=["ka"], visible=False)
    collection.upsert([chunk("b", 0)], [AXES["x"]], version="v1", kv_keys=["kb"], visible=False)
    collection.upsert([chunk("c", 0)], [AXES["x"]], version="v1", kv_keys=["kc"])

    assert sorted(collection.invisible_points()) == [("a", "v1", "ka"), ("b", "v1", "kb")]
    assert collection.delete_invisible("a") == 1
    assert collection.delete_invisible("c") == 0
    assert collection.invisible_points() == [("b", "v1", "kb")]
    assert collection.count() == 2


def test_a_publish_that_fails_midway_leaves_nothing_published_on_disk(tmp_path: Path) -> None:
    opened = ChunkCollection("chunks", DIM, path=tmp_path / "q")
    opened.upsert([chunk("a", i) for i in range(4)], [AXES["x"]] * 4, version="v1", visible=False)
    storage = opened._client._client.collections["chunks"].storage  # type: ignore[attr-defined]
    real = storage.persist
    writes: list[object] = []

    def dies_on_the_third_point(point: object) -> None:
        if len(writes) == 2:
            raise OSError("killed")
        writes.append(point)
        real(point)

    storage.persist = dies_on_the_third_point
    with pytest.raises(OSError, match="killed"):
        opened.publish("a", "v1")
    storage.persist = real
    opened.close()

    reopened = ChunkCollection("chunks", DIM, path=tmp_path / "q")
    assert [p.visible for p in reopened.document_state("a")] == [False] * 4  # the two written rolled back
    reopened.publish("a", "v1")
    reopened.close()
    again = ChunkCollection("chunks", DIM, path=tmp_path / "q")
    assert [p.visible for p in again.document_state("a")] == [True] * 4
    again.close()


def test_token_ids_are_stored_packed_and_read_back_exactly(collection: ChunkCollection) -> None:
    ids = (0, 1, 151_643, 2**32 - 1, 7)
    collection.upsert([Chunk("big", 0, 0, 5, "ids", ids)], [AXES["y"]], version="v1")
    collection.publish("big", "v1")

    stored = collection._client.retrieve(collection.name, [point_id("big", 0, "v1")], with_payload=True)[0].payload
    assert stored is not None and isinstance(stored["token_ids"], str)  # one string, not a list of ints
    assert collection.search(AXES["y"], top_k=1)[0].token_ids == ids
    assert pack_token_ids(ids) == stored["token_ids"]


def test_points_with_token_ids_as_a_list_still_read(collection: ChunkCollection) -> None:
    collection.upsert([chunk("old", 0, "legacy")], [AXES["x"]], version="v1")
    collection.publish("old", "v1")
    # A point as written before the ids were packed.
    collection._client.set_payload(collection.name, {"token_ids": [5, 6, 7]}, points=[point_id("old", 0, "v1")])

    assert collection.search(AXES["x"], top_k=1)[0].token_ids == (5, 6, 7)


@pytest.mark.parametrize("bad", ["5,6,7", "u32le:!!", "u32le:AAA"])
def test_token_ids_that_are_not_packed_ids_are_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        unpack_token_ids(bad)


def test_unpublished_points_crowding_the_top_do_not_hide_published_ones(collection: ChunkCollection) -> None:
    # More unpublished points nearest the question than an embedded search fetches beyond top_k: the published
    # ones further away are still the answer, in order (the search asks again with the filter).
    crowd = EMBEDDED_OVERFETCH + 8
    near = [[1.0, 0.01 * i, 0.0, 0.0] for i in range(crowd)]
    collection.upsert([chunk("draft", i) for i in range(crowd)], near, version="v1", visible=False)
    collection.upsert([chunk("pub", 0), chunk("pub", 1)], [[0.5, 0.5, 0.0, 0.0], [0.2, 0.9, 0.0, 0.0]], version="v1")
    collection.publish("pub", "v1")

    assert [(c.doc_id, c.index) for c in collection.search(AXES["x"], top_k=2)] == [("pub", 0), ("pub", 1)]
    # Once the draft is published its points lead, found without the second query.
    collection.publish("draft", "v1")
    assert [(c.doc_id, c.index) for c in collection.search(AXES["x"], top_k=3)] == [("draft", i) for i in range(3)]
    assert all(c.visible for c in collection.search_many([AXES["x"], AXES["y"]], [4, 4])[1])


# ---- hybrid search (dense + sparse, RRF) --------------------------------------------------------------------------


def _with_a_rare_term(collection: ChunkCollection) -> None:
    """Five chunks near the x axis about common words, one far from it (the w axis) holding a rare term."""
    texts = [f"the licence grants the rights of part {n}" for n in range(5)]
    vectors = [[1.0, 0.1 * n, 0.0, 0.0] for n in range(5)]
    collection.upsert(
        [chunk("common", n, t) for n, t in enumerate(texts)] + [chunk("rare", 0, "the zorblax clause")],
        [*vectors, AXES["w"]],
        version="v1",
    )


def test_hybrid_search_finds_a_chunk_by_a_rare_term_dense_search_ranks_last(collection: ChunkCollection) -> None:
    _with_a_rare_term(collection)
    question = "what does the zorblax clause say"

    dense = collection.search(AXES["x"], top_k=3)  # no text: dense only
    hybrid = collection.search(AXES["x"], top_k=3, text=question)

    assert collection.sparse and collection.hybrid
    assert [c.doc_id for c in dense] == ["common"] * 3
    assert "rare" not in [c.doc_id for c in collection.search(AXES["x"], top_k=5)]  # dense ranks it 6th of 6
    # Reciprocal rank: "rare" is 1st by its terms and 6th by its vector; "common" 0 is 1st by its vector and 2nd by
    # its terms ("the"), so it stays ahead.
    assert [(c.doc_id, c.index) for c in hybrid] == [("common", 0), ("rare", 0), ("common", 1)]
    assert hybrid[1].text == "the zorblax clause" and hybrid[1].token_ids == (1, 2, 3)
    # A question sharing no word with the common chunks: only "rare" is in the sparse ranking, and it leads.
    assert [c.doc_id for c in collection.search(AXES["x"], top_k=2, text="zorblax clause?")] == ["rare", "common"]
    # search_many: each question with its own text; a question of no words ranks by its vector alone.
    many = collection.search_many([AXES["x"], AXES["x"]], [2, 2], ["zorblax", "?!"])
    assert [c.doc_id for c in many[0]] == ["rare", "common"]
    assert [(c.doc_id, c.index) for c in many[1]] == [("common", 0), ("common", 1)]


def test_hybrid_search_off_searches_dense_only(tmp_path: Path) -> None:
    collection = ChunkCollection("chunks", DIM, path=tmp_path / "qdrant", hybrid=False)
    try:
        _with_a_rare_term(collection)
        assert collection.sparse and not collection.hybrid  # points still get their sparse vectors
        hits = collection.search(AXES["x"], top_k=3, text="the zorblax clause")
        assert [c.doc_id for c in hits] == ["common"] * 3
    finally:
        collection.close()


def test_a_collection_made_before_hybrid_search_still_searches_dense_only(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from qdrant_client import QdrantClient, models

    old = QdrantClient(path=str(tmp_path / "qdrant"))  # the layout of earlier versions: one unnamed dense vector
    old.create_collection("chunks", vectors_config=models.VectorParams(size=DIM, distance=models.Distance.COSINE))
    old.upsert("chunks", [models.PointStruct(id=point_id("old", 0, "v0"), vector=AXES["y"], payload=_payload())])
    old.close()

    with caplog.at_level("WARNING", logger="service.retrieval.collection"):
        collection = ChunkCollection("chunks", DIM, path=tmp_path / "qdrant")
    try:
        assert (collection.sparse, collection.hybrid) == (False, False)
        assert [r.message for r in caplog.records if "no sparse vector" in r.message] != []
        _with_a_rare_term(collection)  # new points are written dense only
        hits = collection.search(AXES["y"], top_k=2, text="the zorblax clause")
        assert [(c.doc_id, c.index) for c in hits] == [("old", 0), ("common", 4)]
        assert collection.count() == 7
    finally:
        collection.close()


def _payload() -> dict[str, object]:
    return {"doc_id": "old", "version": "v0", "index": 0, "text": "written before", "token_ids": [7, 8]}


def test_hybrid_search_never_returns_unpublished_points(collection: ChunkCollection) -> None:
    # Drafts hold the question's rare term and its exact vector, and more of them than either ranking fetches: both
    # rankings still see only the published points.
    crowd = HYBRID_PREFETCH * 2 + EMBEDDED_OVERFETCH
    drafts = [chunk("draft", i, f"zorblax zorblax draft {i}") for i in range(crowd)]
    collection.upsert(drafts, [AXES["x"]] * crowd, version="v1", visible=False)
    collection.upsert(
        [chunk("pub", 0, "a zorblax clause"), chunk("pub", 1, "unrelated words")],
        [AXES["y"], AXES["z"]],
        version="v1",
    )
    collection.publish("pub", "v1")

    hits = collection.search(AXES["x"], top_k=2, text="zorblax")
    assert [(c.doc_id, c.index) for c in hits] == [("pub", 0), ("pub", 1)]
    assert all(c.visible for c in hits)
    many = collection.search_many([AXES["x"], AXES["z"]], [5, 1], ["zorblax draft", "draft"])
    assert [[c.doc_id for c in found] for found in many] == [["pub", "pub"], ["pub"]]

    collection.publish("draft", "v1")
    assert [c.doc_id for c in collection.search(AXES["x"], top_k=2, text="zorblax")] == ["draft", "draft"]


def test_a_chunk_without_ascii_words_gets_an_empty_sparse_vector_and_is_found_by_its_vector(
    collection: ChunkCollection,
) -> None:
    collection.upsert(
        [chunk("ja", 0, "日本語の文"), chunk("en", 0, "alpha beta")], [AXES["x"], AXES["y"]], version="v1"
    )

    assert [c.doc_id for c in collection.search(AXES["x"], top_k=2, text="日本語")] == ["ja", "en"]
    assert [c.doc_id for c in collection.search(AXES["x"], top_k=2, text="alpha")] == ["en", "ja"]


def test_a_filtered_search_finds_the_best_matching_published_chunks_beyond_the_top(collection: ChunkCollection) -> None:
    # The filter runs inside Qdrant: the matching chunk far from the question is found even though more than
    # top_k + the over-fetch non-matching ones are nearer, and an unpublished match stays hidden.
    crowd = EMBEDDED_OVERFETCH + 8
    near = [[1.0, 0.01 * i, 0.0, 0.0] for i in range(crowd)]
    collection.upsert([chunk("en", i) for i in range(crowd)], near, version="v1", metadata={"lang": "en"})
    collection.upsert([chunk("fr", 0)], [AXES["y"]], version="v1", metadata={"lang": "fr", "year": 2024})
    collection.upsert([chunk("fr-draft", 0)], [AXES["x"]], version="v1", metadata={"lang": "fr"}, visible=False)
    french = SearchOptions(filter=parse_filter({"must": [{"key": "lang", "match": "fr"}]}))

    assert [c.doc_id for c in collection.search(AXES["x"], top_k=3, options=french)] == ["fr"]
    assert [c.doc_id for c in collection.search(AXES["x"], top_k=3, text="fr chunk", options=french)] == ["fr"]
    recent = SearchOptions(filter=parse_filter({"must_not": [{"key": "year", "range": {"lt": 2024}}]}), hybrid=False)
    found = collection.search_many([AXES["x"], AXES["x"]], [2, 2], None, [recent, SearchOptions()])
    assert [c.doc_id for c in found[0]] == ["en", "en"]  # a point without `year` is not excluded by must_not
    assert [(c.doc_id, c.index) for c in found[1]] == [("en", 0), ("en", 1)]
    assert found[0][0].metadata == {"lang": "en"}
