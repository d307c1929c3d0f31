"""The answer use case: retrieve → plan and load KV → stitch → prefill the question → decode, as events.

`Answerer.retrieve` runs on any thread (embedding and Qdrant, batched across concurrent questions);
`Answerer.prompt` joins the token ids; the scheduler's KV source brings the chunks' KV to the device at the request's
admission on the engine loop; the scheduler stitches, prefills and decodes it with the other running answers
(`service/serving/answer_session.py` drives one answer through it), and `Answerer.done_event` reports the TTFT
breakdown and where each chunk's KV came from. The events (`TokenEvent`, `DoneEvent`) are the facade's plain
values (`service.facade.types`): they know nothing about HTTP.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from service.engine.conversation import Turn
from service.engine.engine import GenerationMode, GenerationResult, StitchEngine
from service.engine.kv_layout import TokenIds
from service.engine.prompt import PromptIds, PromptTemplate
from service.engine.recompute_spec import NO_RECOMPUTE, RecomputeSpec
from service.engine.sampling import SamplingParams, TokenLogprobs
from service.engine.stitch import PositionMode
from service.engine.token_bytes import token_bytes
from service.errors import InvalidRequestError
from service.facade.types import ChatMessage, DoneEvent, Logprob, TokenChoice
from service.kvcache.store import FetchResult, KVStore
from service.kvcache.tiers import Tier
from service.retrieval.collection import PLAIN_SEARCH, RetrievedChunk, SearchOptions
from service.retrieval.fusion import reciprocal_rank_fusion

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Question:
    """One question, its bounds checked at the HTTP boundary; `prepare` adds its token ids and checks that they
    and the answer fit the model's context."""

    text: str
    top_k: int = 5
    mode: GenerationMode = GenerationMode.TURBO
    positions: PositionMode = PositionMode.REORDERED
    sampling: SamplingParams = field(default_factory=SamplingParams)
    recompute: RecomputeSpec = NO_RECOMPUTE  # part of the stitched context recomputed before the question (turbo)
    history: tuple[ChatMessage, ...] = ()  # earlier messages, oldest first; they go between chunks and question
    # What retrieval searches, each text on its own, the rankings fused (`service.retrieval.fusion`); empty: the
    # question alone. A conversation's: the question alone, and the question after its earlier user turns.
    search_texts: tuple[str, ...] = ()
    search: SearchOptions = PLAIN_SEARCH  # the request's metadata filter (and hybrid on/off)
    ids: TokenIds = ()  # the prompt's suffix (conversation and question) as token ids, set once by `prepare`


@dataclass(frozen=True)
class Retrieval:
    chunks: list[RetrievedChunk]
    dropped: int  # retrieved but left out: they would not fit the model's context with the answer
    retrieve_ms: float


def fit_context(
    engine: StitchEngine, hits: Sequence[RetrievedChunk], suffix_tokens: int, max_new_tokens: int
) -> list[RetrievedChunk]:
    """The hits (best first) whose blocks fit the model's context beside the template prefix, the prefilled
    suffix (the conversation and the question in their template turns) and the answer budget; a hit that does
    not fit is left out and later ones still may fit."""
    return fit_blocks(engine.template, engine.spec.max_context, hits, suffix_tokens, max_new_tokens)


def fit_blocks(
    template: PromptTemplate,
    max_context: int,
    hits: Sequence[RetrievedChunk],
    suffix_tokens: int,
    max_new_tokens: int,
) -> list[RetrievedChunk]:
    """`fit_context` for a template and a context length, without an engine (offline jobs that load only the
    model, such as `kvstitch finetune --data-dir`)."""
    room = max_context - len(template.prefix) - suffix_tokens - max_new_tokens
    wrapper = len(template.doc_open) + len(template.doc_close)
    kept = []
    for hit in hits:
        if hit.token_ids and len(hit.token_ids) + wrapper <= room:
            kept.append(hit)
            room -= len(hit.token_ids) + wrapper
    return kept


def _log_read_ahead_failure(started: concurrent.futures.Future[int]) -> None:
    if not started.cancelled() and started.exception() is not None:
        log.warning("no KV read ahead for a question: %s", started.exception())


# The top-k chunks for each of a question's texts, with its search options, searched together (the runtime's
# `search_many`); `UnavailableError` when Qdrant is away.
Search = Callable[[Sequence[str], int, SearchOptions], list[list[RetrievedChunk]]]


class Answerer:
    """Answers questions with one engine, KV store and retrieval."""

    def __init__(
        self,
        engine: StitchEngine,
        store: KVStore,
        search: Search,
        resident: Callable[[TokenIds], bool] | None = None,
    ) -> None:
        """`resident`: whether the engine holds a chunk block where an admission takes it without a fetch (the
        shared chunk arena); such blocks are not read ahead."""
        self.engine = engine
        self.store = store
        self.search = search
        self.resident = resident

    def retrieve(self, question: Question) -> Retrieval:
        """The top-k chunks that fit the context (best first); `UnavailableError` when Qdrant is away. Several
        search texts (a conversation's) are searched in one round and their rankings fused."""
        start = time.perf_counter()
        rankings = self.search(question.search_texts or (question.text,), question.top_k, question.search)
        hits = rankings[0] if len(rankings) == 1 else reciprocal_rank_fusion(rankings, question.top_k)
        kept = self._fit(hits, question)
        return Retrieval(kept, len(hits) - len(kept), (time.perf_counter() - start) * 1e3)

    def _fit(self, hits: Sequence[RetrievedChunk], question: Question) -> list[RetrievedChunk]:
        return fit_context(self.engine, hits, len(self._ids(question)), question.sampling.max_new_tokens)

    def _ids(self, question: Question) -> TokenIds:
        return question.ids or self.suffix(question)

    def suffix(self, question: Question) -> TokenIds:
        """The prompt's prefilled suffix: the conversation's turns and the question, each encoded alone."""
        encode = self.engine.encode_question
        turns = [Turn(m.role, encode(m.text)) for m in question.history]
        return self.engine.conversation.suffix([*turns, Turn("user", encode(question.text))])

    def prepare(self, question: Question) -> Question:
        """The question with its suffix ids (encoded once for the request); `InvalidRequestError` when the
        question (and the history) and the answer budget alone exceed the model's context."""
        ids = self.suffix(question)
        needed = len(ids) + question.sampling.max_new_tokens + len(self.engine.template.prefix)
        if needed > self.engine.spec.max_context:
            what = "history and question" if question.history else "question"
            raise InvalidRequestError(
                "history" if question.history else "max_new_tokens",
                f"{what} ({len(ids)} tokens with the template) plus max_new_tokens "
                f"({question.sampling.max_new_tokens}) exceed the model's context of {self.engine.spec.max_context}",
            )
        return replace(question, ids=ids)

    def prompt(self, question: Question, retrieval: Retrieval) -> PromptIds:
        """The request's prompt as token ids: template prefix, the retrieved chunks' blocks, then the
        conversation and the question (the prefilled suffix)."""
        blocks = tuple(self.engine.template.chunk_block(c.token_ids) for c in retrieval.chunks)
        return PromptIds(self.engine.template.prefix, blocks, self._ids(question))

    def read_ahead(self, prompt: PromptIds, mode: GenerationMode) -> concurrent.futures.Future[int] | None:
        """Start reading the turbo prompt's disk-only chunks into the host tier while it waits in line
        (`KVStore.read_ahead`, off the caller's thread); None when there is nothing to read. A help only: a
        failure is logged, the fetch at admission reads what it must."""
        if mode is not GenerationMode.TURBO or not prompt.blocks:
            return None
        resident = self.resident
        blocks = prompt.blocks if resident is None else [b for b in prompt.blocks if not resident(b)]
        if not blocks:
            return None
        try:
            started = self.store.read_ahead(blocks)
        except RuntimeError as err:  # the store closing, its threads gone: the admission's fetch says what is wrong
            log.warning("no KV read ahead for a question: %s", err)
            return None
        if started is not None:  # None: the read-ahead thread has a full queue
            started.add_done_callback(_log_read_ahead_failure)
        return started

    def done_event(
        self,
        question: Question,
        retrieval: Retrieval,
        fetch: FetchResult | None,
        result: GenerationResult,
        ttft_ms: float,
        resident: Sequence[int] = (),
    ) -> DoneEvent:
        """The `done` event of a finished answer: TTFT and its breakdown, where the chunks' KV came from.
        `resident`: the token counts of the chunks read from the shared chunk arena as found, without a fetch
        (`fetch` counts the others): counted as GPU hits, the arena being device memory the answer copied nothing
        into."""
        arena = ArenaReads(len(resident), sum(resident) * self.engine.spec.kv_bytes_per_token())
        return DoneEvent(
            mode=question.mode.value,
            positions=question.positions.value,
            ttft_ms=ttft_ms,
            output_tokens=len(result.token_ids),
            finish_reason=result.finish_reason,
            timings_ms=_timings(retrieval, fetch, result.timings),
            kv=_tier_counts(fetch, arena),
            kv_bytes=_tier_bytes(fetch, arena),
            answer=result.text,
            prompt_tokens=result.prompt_tokens,
            context_tokens=result.context_tokens,
            recompute=str(question.recompute),
            recomputed_tokens=result.recomputed_tokens,
            recomputed_share=_share(result.recomputed_tokens, result.context_tokens - len(self.engine.template.prefix)),
            logprobs=self.named(result.logprobs),
        )

    def named(self, entries: Sequence[TokenLogprobs]) -> tuple[Logprob, ...]:
        """Log-probability entries with each token id turned into its text and its own bytes."""
        tokenizer = self.engine.tokenizer

        def choice(token: int, logprob: float) -> TokenChoice:
            return TokenChoice(str(tokenizer.decode([token])), logprob, token_bytes(tokenizer, token))

        def entry(e: TokenLogprobs) -> Logprob:
            chosen = choice(e.token, e.logprob)
            return Logprob(chosen.token, chosen.logprob, chosen.token_bytes, tuple(choice(t, lp) for t, lp in e.top))

        return tuple(entry(e) for e in entries)


def _share(part: int, whole: int) -> float:
    return part / whole if whole > 0 else 0.0


def _timings(retrieval: Retrieval, fetch: FetchResult | None, engine_timings: Any) -> dict[str, float]:
    load = fetch.timings.load_ms if fetch is not None else 0.0
    h2d = fetch.timings.h2d_ms if fetch is not None else 0.0
    precompute = (fetch.timings.precompute_ms if fetch is not None else 0.0) + engine_timings.precompute_ms
    return {
        "retrieve": retrieval.retrieve_ms,
        "load": load,
        "h2d": h2d,
        "precompute": precompute,
        "stitch": engine_timings.stitch_ms,
        "recompute": engine_timings.recompute_ms,
        "prefill": engine_timings.prefill_ms,
        "decode": engine_timings.decode_ms,
        "transport": 0.0,  # one process: no hop between a gateway and an engine (a gateway sets its own)
        "relay_in": 0.0,  # an engine's API process sets its hops to and from its core process
        "relay_out": 0.0,
    }


@dataclass(frozen=True)
class ArenaReads:
    """Chunks an answer read from the shared chunk arena without a fetch, and their bytes."""

    chunks: int = 0
    nbytes: int = 0


def _tier_counts(fetch: FetchResult | None, arena: ArenaReads = ArenaReads()) -> dict[str, int]:
    counts = {tier.value: 0 for tier in Tier}
    if fetch is not None:
        for tier, n in fetch.counts.items():
            counts[tier.value] += n
    counts[Tier.GPU.value] += arena.chunks
    return counts


def _tier_bytes(fetch: FetchResult | None, arena: ArenaReads = ArenaReads()) -> dict[str, int]:
    sizes = {tier.value: 0 for tier in Tier}
    if fetch is not None:
        for tier, n in fetch.bytes_loaded.items():
            sizes[tier.value] += n
    sizes[Tier.GPU.value] += arena.nbytes
    return sizes
