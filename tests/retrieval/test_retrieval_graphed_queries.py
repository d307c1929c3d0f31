"""Question embeddings from fixed-shape buckets (the CUDA-graph path, run eagerly on the CPU here) equal the model's
own `encode`; on a GPU the graphs' replays do too."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from service.retrieval.embedder import Embedder
from service.retrieval.graphed_queries import (
    BATCH_BUCKETS,
    BucketedQueryEncoder,
    NotBucketableError,
    bucket_of,
    length_buckets,
)

QUESTIONS = [
    "Who wrote it?",
    "What does the enzyme in the second passage do to the protein chain when it is heated past its limit?",
    "rate limits",
]


def _model(embedder: Embedder) -> Any:
    return embedder._model


def _encode(model: Any, texts: list[str]) -> np.ndarray:
    vectors: np.ndarray = model.encode(texts, normalize_embeddings=True, convert_to_numpy=True)
    return vectors


def test_a_size_goes_to_the_smallest_bucket_that_holds_it() -> None:
    assert bucket_of(1, BATCH_BUCKETS) == 1
    assert bucket_of(3, BATCH_BUCKETS) == 4
    assert bucket_of(33, BATCH_BUCKETS) == 64
    with pytest.raises(ValueError, match="largest bucket 64"):
        bucket_of(65, BATCH_BUCKETS)


def test_length_buckets_end_at_the_models_token_limit() -> None:
    assert length_buckets(256) == (16, 32, 64, 128, 256)
    assert length_buckets(100) == (16, 32, 64, 100)
    assert length_buckets(512) == (16, 32, 64, 128, 256, 512)


def test_padded_buckets_give_the_vectors_of_encode(embedder: Embedder) -> None:
    model = _model(embedder)
    bucketed = BucketedQueryEncoder(model, graphs=False)
    got = bucketed.encode(QUESTIONS)  # 3 rows padded to 4, ~25 tokens padded to 32
    np.testing.assert_allclose(got, _encode(model, QUESTIONS), atol=2e-6)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)
    assert bucketed.graphs == 0


def test_a_question_alone_equals_it_in_a_round(embedder: Embedder) -> None:
    bucketed = BucketedQueryEncoder(_model(embedder), graphs=False)
    alone = bucketed.encode([QUESTIONS[0]])  # a 1 x 16 bucket
    in_round = bucketed.encode(QUESTIONS)  # padded to the round's 32 tokens
    np.testing.assert_allclose(alone[0], in_round[0], atol=2e-6)


def test_a_round_past_the_largest_batch_bucket_goes_in_slices(embedder: Embedder) -> None:
    texts = [f"question number {i} about the topic {i % 7}" for i in range(70)]
    got = BucketedQueryEncoder(_model(embedder), graphs=False).encode(texts)
    assert got.shape == (70, embedder.dimension)
    np.testing.assert_allclose(got, _encode(_model(embedder), texts), atol=2e-6)


def test_a_question_past_the_token_limit_is_truncated_as_encode_does(embedder: Embedder) -> None:
    long_question = " ".join(["retrieval"] * 400)  # past MiniLM's 256 word pieces
    got = BucketedQueryEncoder(_model(embedder), graphs=False).encode([long_question])
    np.testing.assert_allclose(got, _encode(_model(embedder), [long_question]), atol=2e-6)


def test_a_tokenizer_with_features_padding_does_not_know_is_not_bucketed(embedder: Embedder) -> None:
    model = _model(embedder)

    class ExtraFeatures:  # a model whose tokenizer adds a feature with no known padding
        device = model.device
        tokenizer = model.tokenizer
        max_seq_length = model.max_seq_length

        def preprocess(self, texts: list[str]) -> dict[str, Any]:
            features: dict[str, Any] = model.preprocess(texts)
            features["pixel_values"] = torch.zeros(len(texts), 3)
            return features

    with pytest.raises(NotBucketableError, match="pixel_values"):
        BucketedQueryEncoder(ExtraFeatures(), graphs=False)


def test_the_cpu_embedder_keeps_encode(embedder: Embedder) -> None:
    assert not embedder.warm_queries()
