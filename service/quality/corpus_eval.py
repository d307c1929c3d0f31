"""The eval's second form: a user's own ingested corpus and questions, as the server would answer them.

`kvstitch eval --model DIR --data-dir DIR --questions FILE.txt`: each line of FILE is a question; its chunks are
retrieved as `/ask` retrieves them (the runtime's embedder and Qdrant collection, top-k, then the chunks that fit
the context beside the question and the answer budget: `answer.fit_context`), best first, and the prompt is the
served one (`template.prompt` over the chunks' stored token ids). There are no reference answers, so the rows
carry agreement with naive and the first-token KL, not accuracy.

Nothing in the data dir is written: the collection is opened only where one exists, and the chunks' KV is
computed by the engine (equal to the cached KV, which is what the gate proves) rather than read from the KV
store, whose misses would otherwise write new blocks when the model differs from the one that ingested. The
model must share the ingesting model's tokenizer (a fine-tuned copy does): the stored token ids are checked
against the chunk text.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.engine.engine import StitchEngine
from service.engine.prompt import encode_text
from service.quality.dataset import QADataError, QASample, window
from service.quality.eval import Case
from service.retrieval.collection import RetrievedChunk
from service.usecases.answer import fit_context


@dataclass(frozen=True)
class Question:
    text: str
    line: int


def read_questions(path: str | Path, max_chars: int, limit: int | None = None, offset: int = 0) -> list[Question]:
    """The non-blank lines of a UTF-8 text file, each at most `max_chars` (the `limit` after the first `offset`
    when given); QADataError naming file and line."""
    source = Path(path)
    questions = []
    with source.open("rb") as lines:
        for number, raw in enumerate(lines, start=1):
            try:
                text = raw.decode("utf-8").strip()
            except UnicodeDecodeError:
                raise QADataError(f"{source.name} line {number}: not UTF-8 text") from None
            if len(text) > max_chars:
                raise QADataError(
                    f"{source.name} line {number}: the question has {len(text)} characters; at most {max_chars}"
                )
            if text:
                questions.append(Question(text, number))
    if not questions:
        raise QADataError(f"{source.name}: no questions (one per line)")
    return window(questions, offset, limit, source.name, "questions")


class CorpusError(ValueError):
    """The data dir holds no corpus this model can be evaluated on."""


@dataclass
class Corpus:
    """The served retrieval over an ingested corpus: the runtime's embedder and collection."""

    embedder: Any
    collection: Any

    def search(self, text: str, top_k: int) -> list[RetrievedChunk]:
        hits: list[RetrievedChunk] = self.collection.search(self.embedder.embed_query(text), top_k, text)
        return hits

    def close(self) -> None:
        self.collection.close()


@contextlib.contextmanager
def open_corpus(settings: Any) -> Iterator[Corpus]:
    """The embedder and collection `open_runtime` would open for these settings; CorpusError when nothing is
    ingested there (an embedded collection is never created by looking)."""
    from service.retrieval.embedder import Embedder
    from service.serving.runtime import open_collection

    if not settings.qdrant_url and not settings.qdrant_path.is_dir():
        raise CorpusError(f"{settings.data_dir}: no ingested corpus here (no {settings.qdrant_path.name}/ folder)")
    embedder = Embedder(settings.embedding_model, device=settings.embedding_device)
    corpus = Corpus(embedder, open_collection(settings, embedder.dimension))
    try:
        if corpus.collection.count() == 0:
            raise CorpusError(f"{settings.data_dir}: collection {settings.collection!r} holds no chunks")
        yield corpus
    finally:
        corpus.close()


def corpus_cases(
    engine: StitchEngine, corpus: Corpus, questions: Sequence[Question], top_k: int, max_new_tokens: int, source: str
) -> Iterator[Case]:
    """Each question with its retrieved chunks as the engine sees them (prompt ids, the chunks' KV)."""
    for question in questions:
        ids = engine.encode_question(question.text)
        where = f"{source} line {question.line}"
        if len(ids) + max_new_tokens + len(engine.template.prefix) > engine.spec.max_context:
            raise QADataError(f"{where}: the question and {max_new_tokens} new tokens exceed the model's context")
        suffix = len(engine.template.question_head) + len(ids) + len(engine.template.question_tail)
        chunks = fit_context(engine, corpus.search(question.text, top_k), suffix, max_new_tokens)
        if not chunks:
            raise QADataError(f"{where}: no retrieved chunk fits the model's context beside the question")
        check_tokenizer(engine, chunks[0])
        prompt = engine.template.prompt([c.token_ids for c in chunks], ids)
        sample = QASample(question.text, tuple(c.text for c in chunks), (), question.line)
        yield Case(sample, prompt, engine.precompute(prompt.blocks), engine.chunk_context)


def check_tokenizer(engine: StitchEngine, chunk: RetrievedChunk) -> None:
    """The chunker stores the ids of the chunk's text encoded alone; another tokenizer gives other ids."""
    check_chunk_tokens(engine.tokenizer, engine.model.source, chunk)


def check_chunk_tokens(tokenizer: Any, source: str, chunk: RetrievedChunk) -> None:
    """`check_tokenizer` for a tokenizer and the name of its model (jobs that open no engine)."""
    if encode_text(tokenizer, chunk.text) != tuple(chunk.token_ids):
        raise CorpusError(
            f"the chunks were ingested with another tokenizer than {source}'s (chunk {chunk.id} of "
            f"{chunk.doc_id}); use the model that ingested them, or ingest again with this one"
        )
