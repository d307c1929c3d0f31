"""The embedder over the bundled all-MiniLM-L6-v2: size, unit vectors, batching and relevance."""

from __future__ import annotations

import math
import threading
from pathlib import Path

import pytest
import torch

from service.retrieval.embedder import Embedder, bundled_model_path

QUESTION = "What is the capital of France?"
RELEVANT = "Paris is the capital and largest city of France."
UNRELATED = "The recipe needs two eggs, flour and a pinch of salt."


def dot(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


def test_default_model_is_the_bundled_minilm(embedder: Embedder) -> None:
    assert embedder.batch_size == 2  # the conftest's instance: batches of two exercise the batching
    assert embedder.model_name == str(bundled_model_path())
    assert (bundled_model_path() / "model.safetensors").is_file()
    assert embedder.dimension == 384
    assert embedder.max_input_tokens == 256


def test_vectors_have_the_dimension_and_unit_norm(embedder: Embedder) -> None:
    vectors = [*embedder.embed_documents([RELEVANT, UNRELATED, "x"]), embedder.embed_query(QUESTION)]
    for vector in vectors:
        assert len(vector) == 384
        assert math.isclose(math.sqrt(dot(vector, vector)), 1.0, abs_tol=1e-4)


def test_a_relevant_passage_scores_higher_than_an_unrelated_one(embedder: Embedder) -> None:
    query = embedder.embed_query(QUESTION)
    relevant, unrelated = embedder.embed_documents([RELEVANT, UNRELATED])
    assert dot(query, relevant) > 0.5
    assert dot(query, relevant) > dot(query, unrelated) + 0.3


def test_batches_give_the_same_vectors_as_single_texts(embedder: Embedder) -> None:
    texts = [RELEVANT, UNRELATED, QUESTION, "A fourth text to make two full batches and one more."]
    batched = embedder.embed_documents(texts)
    assert len(batched) == 4
    for text, vector in zip(texts, batched, strict=True):
        (alone,) = embedder.embed_documents([text])
        assert max(abs(x - y) for x, y in zip(alone, vector, strict=True)) < 1e-4
    assert embedder.embed_documents([]) == []


def test_threads_can_share_one_embedder(embedder: Embedder) -> None:
    expected = embedder.embed_query(QUESTION)
    results: list[list[float]] = []

    def worker() -> None:
        results.extend(embedder.embed_documents([QUESTION] * 3))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 12
    assert all(max(abs(x - y) for x, y in zip(r, expected, strict=True)) < 1e-4 for r in results)


def test_a_model_path_overrides_the_default(embedder: Embedder, tmp_path: Path) -> None:
    explicit = Embedder(str(bundled_model_path()))
    assert explicit.model_name == str(bundled_model_path())
    assert (
        max(abs(x - y) for x, y in zip(explicit.embed_query(QUESTION), embedder.embed_query(QUESTION), strict=True))
        < 1e-5
    )
    with pytest.raises(OSError, match="is not available offline"):
        Embedder(tmp_path / "no-model-here")


def test_a_zero_batch_size_is_refused() -> None:
    with pytest.raises(ValueError, match="batch_size must be positive"):
        Embedder(batch_size=0)


def test_a_half_precision_folder_runs_in_fp32_on_the_cpu_with_the_same_vectors(
    embedder: Embedder, tmp_path: Path
) -> None:
    from sentence_transformers import SentenceTransformer

    SentenceTransformer(str(bundled_model_path()), device="cpu").half().save(str(tmp_path / "half"))
    half = Embedder(tmp_path / "half", device="cpu")

    assert {p.dtype for p in half._model.parameters()} == {torch.float32}
    text = "The capital of France is Paris."
    got, want = half.embed_query(text), embedder.embed_query(text)
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 5e-3  # only the fp16 rounding of the weights
