"""Embedded mode's dense search: every point's unit vector in one matrix, a round of questions in one product.

Embedded Qdrant answers each question on its own: it normalizes every stored vector again, scores them, and copies
the payloads of an over-fetched list, ~6 ms a question at 4,000 points on one core, so a round of 20 questions
held the retrieval thread for over 100 ms. The collection is the one client of its folder, so it can keep the
vectors it writes: here a round's scores are one [questions x points] product on the unit vectors, the unpublished
points are masked out (so the top k are exact without over-fetching), and only the winners' payloads are read
from Qdrant, by id. Scores are Qdrant's: the cosine of float32 unit vectors.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class DenseRows:
    """Unit vectors and visibility of the points, by id; `nearest` ranks visible points for a round of queries."""

    def __init__(self, dimension: int) -> None:
        self.dimension = dimension
        self._vectors: dict[str, np.ndarray] = {}
        self._visible: dict[str, bool] = {}
        self._matrix: np.ndarray | None = None  # built from the dicts at the first search after a write
        self._ids: list[str] = []
        self._shown = np.zeros(0, dtype=bool)

    def __len__(self) -> int:
        return len(self._vectors)

    def put(self, point: str, vector: Sequence[float], visible: bool) -> None:
        row = np.asarray(vector, dtype=np.float32)
        if row.shape != (self.dimension,):
            raise ValueError(f"vector of shape {row.shape} for dimension {self.dimension}")
        norm = float(np.linalg.norm(row))
        self._vectors[point] = row / norm if norm > 0 else row
        self._visible[point] = visible
        self._matrix = None

    def show(self, point: str) -> None:
        if point in self._visible:
            self._visible[point] = True
            self._matrix = None

    def remove(self, point: str) -> None:
        if self._vectors.pop(point, None) is not None:
            del self._visible[point]
            self._matrix = None

    def has_hidden(self) -> bool:
        return not all(self._visible.values())

    def nearest(self, queries: Sequence[Sequence[float]], limits: Sequence[int]) -> list[list[tuple[str, float]]]:
        """Per query, up to `limit` visible (point id, cosine score), best first."""
        matrix = self._built()
        if not len(queries):
            return []
        unit = np.array(queries, dtype=np.float32)  # a copy: normalized in place below
        norms = np.linalg.norm(unit, axis=1, keepdims=True)
        norms[norms == 0] = 1.0  # a zero question vector scores 0 everywhere, as in Qdrant
        unit /= norms
        scores = unit @ matrix.T if len(self._ids) else np.zeros((len(unit), 0), dtype=np.float32)
        scores[:, ~self._shown] = -np.inf
        visible = int(self._shown.sum())
        return [self._best(row, min(limit, visible)) for row, limit in zip(scores, limits, strict=True)]

    def _best(self, scores: np.ndarray, k: int) -> list[tuple[str, float]]:
        if k <= 0:
            return []
        top = np.argpartition(-scores, k - 1)[:k] if k < len(scores) else np.arange(len(scores))
        ordered = top[np.argsort(-scores[top], kind="stable")]
        return [(self._ids[i], float(scores[i])) for i in ordered]

    def _built(self) -> np.ndarray:
        if self._matrix is None:
            self._ids = list(self._vectors)
            rows = [self._vectors[point] for point in self._ids]
            self._matrix = np.stack(rows) if rows else np.zeros((0, self.dimension), dtype=np.float32)
            self._shown = np.array([self._visible[point] for point in self._ids], dtype=bool)
        return self._matrix
