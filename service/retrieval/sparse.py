"""BM25-style sparse vectors for hybrid search: a chunk's saturated term frequencies, a question's terms.

Terms are lowercase runs of ASCII letters and digits. A term's index is the first four bytes of its BLAKE2b digest
(stable across processes and versions, unlike Python's `hash()`; a collision merely merges two rare terms). A
chunk's weight for a term is BM25's term-frequency part (k1 = 1.2, b = 0.75, length against `AVERAGE_TERMS`); the
inverse document frequency is left to Qdrant (`Modifier.IDF`), which keeps it current as the corpus changes. A
question's vector holds each of its terms once with weight 1, so the score is the BM25 sum over shared terms.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from dataclasses import dataclass

_WORD = re.compile(r"[a-z0-9]+")
K1 = 1.2
B = 0.75
# A chunk's length in terms is measured against this rather than the corpus mean, which would change (and re-weight
# every stored point) with each ingest; 256 is fastembed's BM25 default. Chunks are near one size, so it mostly sets
# how fast repeats of a term saturate.
AVERAGE_TERMS = 256.0


@dataclass(frozen=True)
class SparseTerms:
    """A sparse vector as Qdrant takes it: indices ascending, one value each."""

    indices: list[int]
    values: list[float]


def terms(text: str) -> Counter[str]:
    """The text's terms and how often each occurs."""
    return Counter(_WORD.findall(text.lower()))


def term_index(term: str) -> int:
    return int.from_bytes(hashlib.blake2b(term.encode(), digest_size=4).digest(), "little")


def document_vector(text: str, average_terms: float = AVERAGE_TERMS) -> SparseTerms:
    """A chunk's (or what is embedded for it) BM25 term-frequency weights."""
    counted = terms(text)
    norm = K1 * (1 - B + B * sum(counted.values()) / average_terms)
    weights: dict[int, float] = {}
    for term, freq in counted.items():
        index = term_index(term)
        weights[index] = weights.get(index, 0.0) + freq * (K1 + 1) / (freq + norm)
    return _sorted(weights)


def query_vector(text: str) -> SparseTerms:
    """A question's terms, each once, weight 1."""
    return _sorted({term_index(term): 1.0 for term in terms(text)})


def _sorted(weights: dict[int, float]) -> SparseTerms:
    indices = sorted(weights)
    return SparseTerms(indices, [weights[i] for i in indices])
