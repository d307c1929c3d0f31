"""On a GPU, question embeddings from CUDA graph replays equal the model's own `encode` (the CPU tests check the
padded buckets eagerly: tests/retrieval/test_retrieval_graphed_queries.py)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from service.retrieval.embedder import Embedder

# The device machine has no bundled-model package: there the test is given a saved copy of it.
MODEL = os.environ.get("KVSTITCH_EMBEDDING_MODEL")


@pytest.mark.gpu
def test_graph_replays_give_the_vectors_of_encode_on_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    embedder = Embedder(MODEL, device="cuda")
    assert embedder.warm_queries()
    model = embedder._model
    rounds = [
        ["Who wrote it?"],
        ["rate limits", "What does the enzyme in the second passage do when heated?"],
        [f"q {i} of the round" for i in range(40)],
    ]
    for texts in rounds:
        got = np.asarray(embedder.embed_queries(texts))
        expected = model.encode(texts, normalize_embeddings=True, convert_to_numpy=True)
        assert got.shape == expected.shape
        cosine = np.sum(got * expected, axis=1)
        assert cosine.min() > 0.9999, cosine.min()
