"""Question embeddings replayed from CUDA graphs: one launch instead of a forward's hundred kernel launches.

A MiniLM forward for one question is about a hundred small kernels. Launched one by one from Python they cost
several ms of CPU, far more than the GPU's work, and on a GPU shared with the engine each launch can also wait for
the engine's time slice. Captured once per (batch, length) bucket, a round of questions is one graph launch.

Inputs are padded up to their bucket: padded tokens get attention mask 0, so no token attends to them and the
pooling skips them; padded rows are all mask and are dropped. The forward is the model's own (`model(features)`),
so pooling and a Normalize module are the model's; only models whose tokenizer gives plain [rows, tokens] tensors
are bucketed, others keep `encode`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # a retrieval round holds at most 64 questions (RetrievalBatcher)
LENGTH_BUCKETS = (16, 32, 64, 128, 256, 512)
PADDED_FEATURES = {"input_ids", "attention_mask", "token_type_ids"}  # what padding knows how to fill


class NotBucketableError(RuntimeError):
    """The model cannot be run from fixed-shape buckets (its features or pooling need the real lengths)."""


def bucket_of(size: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds `size` (ValueError past the largest)."""
    for bucket in buckets:
        if size <= bucket:
            return bucket
    raise ValueError(f"{size} is past the largest bucket {buckets[-1]}")


def length_buckets(max_tokens: int) -> tuple[int, ...]:
    """The length buckets up to the model's own token limit, which always ends them (tokenizing truncates there)."""
    below = tuple(b for b in LENGTH_BUCKETS if b < max_tokens)
    return (*below, max_tokens)


@dataclass
class _Bucket:
    features: dict[str, Any]  # static inputs of one (rows, tokens) shape, and the tokenizer's constants
    output: torch.Tensor | None = None  # the graph's output (None until captured)
    graph: torch.cuda.CUDAGraph | None = None


class BucketedQueryEncoder:
    """Unit vectors of questions from fixed-shape forwards of a SentenceTransformer. With `graphs` (CUDA only)
    every bucket is captured at construction and served by a replay; without, each bucket runs eagerly (what the
    CPU tests compare with `encode`). Not thread-safe: the caller serializes calls (the Embedder's lock)."""

    def __init__(self, model: Any, prompt: str = "", graphs: bool = True) -> None:
        self._model = model
        self._prompt = prompt
        self._device = torch.device(model.device)
        self._pad_id = int(getattr(model.tokenizer, "pad_token_id", None) or 0)
        # `preprocess` replaced `tokenize` in sentence-transformers 5.2; older versions have only `tokenize`.
        self._tokenize: Any = getattr(model, "preprocess", None) or model.tokenize
        self._probe = self._bucketable_features()  # the features' names, dtypes and constants, for every bucket
        self._lengths = length_buckets(int(model.max_seq_length))
        self._buckets: dict[tuple[int, int], _Bucket] = {}
        if graphs and self._device.type == "cuda":
            self._capture_all()

    @property
    def graphs(self) -> int:
        """How many buckets are served by a graph replay."""
        return sum(1 for bucket in self._buckets.values() if bucket.graph is not None)

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """float32 [len(texts), dimension], L2-normalized; rounds past the largest batch bucket go in slices."""
        largest = BATCH_BUCKETS[-1]
        parts = [self._encode_round(list(texts[i : i + largest])) for i in range(0, len(texts), largest)]
        return np.concatenate(parts) if parts else np.zeros((0, 0), dtype=np.float32)

    def _encode_round(self, texts: list[str]) -> np.ndarray:
        features = self._tokenize([self._prompt + text for text in texts])
        rows, tokens = features["input_ids"].shape
        bucket = self._bucket(bucket_of(rows, BATCH_BUCKETS), bucket_of(tokens, self._lengths))
        with torch.inference_mode():  # the static inputs were made in it: updated in place only inside it
            _fill(bucket.features, features, self._pad_id)
            if bucket.graph is not None:
                bucket.graph.replay()
                output = bucket.output
            else:
                output = self._forward(bucket.features)
            assert output is not None
            vectors = torch.nn.functional.normalize(output[:rows].float(), dim=-1)
            return vectors.cpu().numpy()

    def _forward(self, features: dict[str, Any]) -> torch.Tensor:
        # A fresh dict: the model's modules add their outputs to the one they are given.
        embedding: torch.Tensor = self._model(dict(features))["sentence_embedding"]
        return embedding

    def _bucket(self, rows: int, tokens: int) -> _Bucket:
        bucket = self._buckets.get((rows, tokens))
        if bucket is None:  # eager mode makes its buckets as they are first needed, as inference tensors too
            with torch.inference_mode():
                bucket = self._buckets[(rows, tokens)] = _Bucket(self._static_features(rows, tokens))
        return bucket

    def _static_features(self, rows: int, tokens: int) -> dict[str, Any]:
        """Zeroed [rows, tokens] tensors for the padded features; the tokenizer's constants (a modality name) as
        they are."""
        return {
            name: torch.zeros((rows, tokens), dtype=value.dtype, device=self._device)
            if isinstance(value, torch.Tensor)
            else value
            for name, value in self._probe.items()
        }

    def _bucketable_features(self) -> dict[str, Any]:
        """The tokenizer's features for two probe questions, checked to be what padding into a bucket can fill
        (NotBucketableError otherwise)."""
        features: dict[str, Any] = self._tokenize(["a probe question", "a"])
        tensors = {name for name, value in features.items() if isinstance(value, torch.Tensor)}
        unknown = tensors - PADDED_FEATURES
        if unknown or "input_ids" not in tensors or "attention_mask" not in tensors:
            known = sorted(PADDED_FEATURES)
            raise NotBucketableError(f"tokenizer features {sorted(tensors)} (padding fills only {known})")
        if any(features[name].dim() != 2 for name in tensors):
            raise NotBucketableError("tokenizer features are not [rows, tokens] tensors")
        constants = {name: value for name, value in features.items() if name not in tensors}
        if constants != {n: v for n, v in self._tokenize(["another"]).items() if n not in tensors}:
            raise NotBucketableError(f"tokenizer features {sorted(constants)} change with the text")
        if self._prompt and any(getattr(module, "include_prompt", True) is False for module in self._model):
            raise NotBucketableError("the pooling leaves the prompt out, which needs each question's prompt length")
        return features

    def _capture_all(self) -> None:
        """Every bucket, the largest first so that the smaller ones fit in the memory its capture reserved (one
        pool: replays never overlap, the caller serializes them)."""
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self._device)  # type: ignore[no-untyped-call]
        shapes = sorted(((r, t) for r in BATCH_BUCKETS for t in self._lengths), key=lambda s: -s[0] * s[1])
        with torch.inference_mode(), torch.cuda.stream(stream):
            for rows, tokens in shapes:
                bucket = self._bucket(rows, tokens)
                _fill_probe(bucket.features, self._pad_id)
                self._forward(bucket.features)  # lazy set-up (kernels' autotuning, workspaces) outside the capture
                stream.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    bucket.output = self._forward(bucket.features)
                bucket.graph = graph
        torch.cuda.current_stream(self._device).wait_stream(stream)


def _fill(static: dict[str, Any], features: dict[str, Any], pad_id: int) -> None:
    """Copy a round's features into a bucket's static inputs, padding the rest (ids: pad, mask and types: 0)."""
    rows, tokens = features["input_ids"].shape
    for name, tensor in _tensors(static):
        tensor.fill_(pad_id if name == "input_ids" else 0)
        tensor[:rows, :tokens].copy_(features[name], non_blocking=True)


def _fill_probe(static: dict[str, Any], pad_id: int) -> None:
    """Inputs for a capture: one real token in every row, so no row's pooling divides by an empty mask."""
    for name, tensor in _tensors(static):
        tensor.fill_(pad_id if name == "input_ids" else 0)
    static["attention_mask"][:, 0] = 1


def _tensors(features: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    return [(name, value) for name, value in features.items() if isinstance(value, torch.Tensor)]
