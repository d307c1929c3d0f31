"""Training prompts from the user's own ingested corpus (`kvstitch finetune --data-dir DIR`).

Self-distillation needs prompts, not answers: the teacher answers them. The prompts should look like the ones the
service will serve, so each is made the way `/ask` makes one:

1. A question from a chunk's own text: one of its sentences (6 to 60 words), turned into one of a few question
   forms (what the documents say about a span of it, complete the sentence from its opening, quote the sentence
   that holds a span, sum up what they say about a span). Sentences come from the corpus itself, so the answer
   is in the corpus and the question's words are the documents' words; the forms mix copying exact spans (turbo's
   failure on a real model was inventing dates and names that naive read correctly) with reading a passage as a
   whole. A span starts at a word with a capital, a digit or five letters where the sentence has one, so it is
   "Ommeria in 1873", not "of the".
2. The chunks for it retrieved as `/ask` retrieves them (the runtime's embedder and collection, hybrid where the
   settings say so, top-k, then the chunks that fit the context beside the question and the answer budget:
   `answer.fit_blocks`), best first. The chunk the sentence came from is usually among them but need not be: the
   teacher answers whatever it was given, and a prompt whose chunks do not hold the answer is a served case too.
3. The served prompt over the chunks' stored token ids (`template.prompt`).

Chunks are visited in a seeded shuffle, each giving at most one question per pass, so `count` questions spread
over the corpus before any chunk is asked about twice. Opening the corpus is the eval's: the data dir's
embedded Qdrant (stop the server that owns it first) or the configured Qdrant server; nothing is written.
"""

from __future__ import annotations

import logging
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from service.engine.model import LoadedModel
from service.engine.prompt import PromptIds, PromptTemplate, encode_text
from service.quality.corpus_eval import CorpusError, check_chunk_tokens, open_corpus
from service.usecases.answer import fit_blocks

log = logging.getLogger(__name__)

MIN_WORDS, MAX_WORDS = 6, 60
SPAN_WORDS = (2, 5)
SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
EDGE_PUNCTUATION = "\"'()[]{}.,;:!?"
QUESTION_FORMS = (
    'What do the documents say about "{span}"?',
    'Complete this sentence from the documents: "{opening} ..."',
    'Quote the sentence from the documents that mentions "{span}".',
    'In one sentence, what do the documents say about "{span}"?',
)


@dataclass(frozen=True)
class CorpusPrompt:
    question: str
    prompt: PromptIds
    source: tuple[str, int]  # (doc_id, chunk index) of the sentence asked about


def sentences(text: str) -> list[str]:
    """The chunk's sentences of `MIN_WORDS` to `MAX_WORDS` words, whitespace collapsed."""
    pieces = (" ".join(s.split()) for s in SENTENCE_END.split(text))
    return [s for s in pieces if MIN_WORDS <= len(s.split()) <= MAX_WORDS]


def _salient(word: str) -> bool:
    core = word.strip(EDGE_PUNCTUATION)
    return bool(core) and (core[0].isupper() or any(c.isdigit() for c in core) or len(core) >= 5)


def question_from(sentence: str, rng: random.Random) -> str:
    """One of `QUESTION_FORMS` about the sentence."""
    words = sentence.split()
    form = rng.choice(QUESTION_FORMS)
    if "{opening}" in form:
        opening = " ".join(words[: max(3, len(words) // 2)])
        return form.format(opening=opening)
    size = min(len(words), rng.randint(*SPAN_WORDS))
    starts = [i for i in range(len(words) - size + 1) if _salient(words[i])] or list(range(len(words) - size + 1))
    start = rng.choice(starts)
    span = " ".join(words[start : start + size]).strip(EDGE_PUNCTUATION)
    return form.format(span=span)


def make_questions(
    chunks: Sequence[tuple[str, int, str]], count: int, rng: random.Random
) -> list[tuple[str, tuple[str, int]]]:
    """`count` (question, (doc_id, index)) pairs, one chunk after another in a seeded shuffle, again and again;
    CorpusError when no chunk has a sentence to ask about."""
    usable = [(doc, index, found) for doc, index, text in sorted(chunks) if (found := sentences(text))]
    if not usable:
        raise CorpusError(f"no ingested chunk has a sentence of {MIN_WORDS} to {MAX_WORDS} words to ask about")
    questions: list[tuple[str, tuple[str, int]]] = []
    while len(questions) < count:
        order = list(range(len(usable)))
        rng.shuffle(order)
        for position in order[: count - len(questions)]:
            doc, index, found = usable[position]
            questions.append((question_from(rng.choice(found), rng), (doc, index)))
    return questions


def corpus_prompts(
    model: LoadedModel,
    template: PromptTemplate,
    settings: Any,
    count: int,
    top_k: int,
    answer_tokens: int,
    seed: int,
) -> list[CorpusPrompt]:
    """`count` served prompts over the corpus ingested under `settings` (see the module docstring)."""
    rng = random.Random(seed)
    suffix = len(template.question_head) + len(template.question_tail)
    prompts: list[CorpusPrompt] = []
    with open_corpus(settings) as corpus:
        questions = make_questions(list(corpus.collection.chunk_texts()), count, rng)
        for text, source in questions:
            ids = encode_text(model.tokenizer, text)
            hits = corpus.search(text, top_k)
            chunks = fit_blocks(template, model.spec.max_context, hits, suffix + len(ids), answer_tokens)
            if not chunks:
                log.warning("no retrieved chunk fits beside %r; skipped", text)
                continue
            check_chunk_tokens(model.tokenizer, model.source, chunks[0])
            prompts.append(CorpusPrompt(text, template.prompt([c.token_ids for c in chunks], ids), source))
    if not prompts:
        raise CorpusError("no question over the corpus has a retrieved chunk that fits the model's context")
    return prompts
