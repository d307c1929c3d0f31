"""Optional second-stage ranking: a sentence-transformers cross-encoder reads each (question, chunk) pair and
reorders the retrieved candidates before the context is fitted.

The bi-encoder search embeds question and chunk apart; a cross-encoder attends across both, so it ranks better
but costs one forward per pair. So only the first `candidates` hits of the search are read, in one batched
`predict`, on the embedder's device, on the caller's thread (a request's worker thread, never the event loop).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sentence_transformers import CrossEncoder
from transformers.utils import logging as hf_logging

from service.retrieval.collection import RetrievedChunk, SearchOptions
from service.retrieval.embedder import SideStream

DEFAULT_CANDIDATES = 20
MAX_CANDIDATES = 200
DEFAULT_BATCH_SIZE = 32


class Reranker:
    """Scores (question, chunk) pairs with one cross-encoder model folder; safe to share across threads."""

    def __init__(self, model: str | Path, device: str = "cpu", batch_size: int = DEFAULT_BATCH_SIZE) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        folder = Path(model)
        if not folder.is_dir():
            raise ValueError(f"rerank model {str(model)!r} is not a folder (KVSTITCH_RERANK_MODEL)")
        self.model_name = str(folder)
        self.batch_size = batch_size
        self._lock = threading.Lock()  # the fast tokenizer inside is not re-entrant
        hf_logging.disable_progress_bar()
        try:
            self._model = CrossEncoder(self.model_name, device=device, local_files_only=True)
        except (OSError, ValueError) as err:
            raise ValueError(
                f"rerank model {self.model_name!r} cannot be loaded as a sentence-transformers CrossEncoder "
                f"(KVSTITCH_RERANK_MODEL): {err}"
            ) from err
        if not device.startswith("cuda"):
            self._model.model.float()  # half-precision weights run several times slower on CPU
        self._on_own_stream = SideStream(device)

    def scores(self, question: str, texts: Sequence[str]) -> list[float]:
        """The model's relevance score of each text for the question, in order (higher is more relevant)."""
        if not texts:
            return []
        pairs = [(question, text) for text in texts]
        with self._lock, self._on_own_stream():
            raw: Any = self._model.predict(
                pairs, batch_size=self.batch_size, convert_to_numpy=True, show_progress_bar=False
            )
        return [float(s) for s in raw.reshape(len(texts), -1)[:, 0]]

    def rerank(self, question: str, hits: Sequence[RetrievedChunk]) -> list[RetrievedChunk]:
        """The hits ordered by the model's score, best first, each carrying that score (ties keep search order)."""
        scored = zip(self.scores(question, [h.text for h in hits]), hits, strict=True)
        ranked = sorted(scored, key=lambda pair: -pair[0])
        return [dataclasses.replace(hit, score=score) for score, hit in ranked]


class RerankedSearch:
    """A search of several texts at once (texts, top_k, options) → hits of each, that fetches `candidates` hits
    (at least top_k) for each text, has the reranker reorder them by that text and keeps the first top_k."""

    def __init__(self, search_many: Any, reranker: Reranker, candidates: int = DEFAULT_CANDIDATES) -> None:
        if not 1 <= candidates <= MAX_CANDIDATES:
            raise ValueError(f"candidates must be in 1..{MAX_CANDIDATES}, got {candidates}")
        self._search_many = search_many
        self.reranker = reranker
        self.candidates = candidates

    def __call__(self, text: str, top_k: int, options: SearchOptions) -> list[RetrievedChunk]:
        return self.many([text], top_k, options)[0]

    def many(self, texts: Sequence[str], top_k: int, options: SearchOptions) -> list[list[RetrievedChunk]]:
        found: list[list[RetrievedChunk]] = self._search_many(texts, max(top_k, self.candidates), options)
        return [self.reranker.rerank(text, hits)[:top_k] for text, hits in zip(texts, found, strict=True)]
