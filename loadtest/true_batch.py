"""A true batch for `bench_tables`: B requests submitted together to one `Scheduler`, built as the server builds it.

`batch_scheduler` builds the scheduler with the server's own `build_scheduler` (the server's batching defaults:
`prefill_chunk`, `batch_prefill_min`, CUDA graphs for the batched steps, questions riding in decode steps and
overlapped steps wherever the engine has its own graphs) over a `KVPool` sized for the B requests, and captures
those graphs as the server's start does (`Scheduler.warm`), before anything is timed. `run_batch` adds the B
requests at once and steps the scheduler until every one has its last token. Each turbo request's chunk KV is
fetched at its admission from the tier under test through the server's own KV source
(`service.serving.kv_source.StoreChunks`); a naive request fetches nothing and the scheduler prefills its whole
prompt, `prefill_chunk` tokens per step between the running requests' decode steps.

Times count from the batch start (just before the B requests are added): a request's TTFT is when its first
token id is on the host, the batch's total when its last request has its last token. Each decode step's time is
the scheduler's own `decode` phase (the batched step and the pick, which waits for the GPU).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from service.engine.batch_request import BatchRequest
from service.engine.engine import GenerationMode, StitchEngine
from service.engine.kv_pool import KVPool
from service.engine.prompt import PromptIds
from service.engine.sampling import SamplingParams
from service.engine.scheduler import Scheduler
from service.engine.scheduler_config import BatchingOptions, build_scheduler, graphs_on, scratch_slots
from service.kvcache.store import FetchResult, KVStore
from service.kvcache.tiers import Tier
from service.serving.kv_source import StoreChunks


def slots_needed(prompt: PromptIds, sampling: SamplingParams) -> int:
    """A request's slab: its joined prompt and its answer budget (`BatchRequest.tokens_needed`)."""
    return len(prompt.joined()) + sampling.max_new_tokens


def batch_scheduler(engine: StitchEngine, prompts: Sequence[PromptIds], sampling: SamplingParams) -> Scheduler:
    """A scheduler for these requests at once, as the server's: a pool with one slab each, every one admitted in
    the first step (`max_batch` = their count), its graphs on CUDA captured now for every length they reach."""
    on_cuda = graphs_on(engine)
    slots = sum(slots_needed(p, sampling) for p in prompts) + scratch_slots(engine)
    pool = KVPool(engine.spec, slots * engine.spec.kv_bytes_per_token())
    scheduler = build_scheduler(engine, pool, BatchingOptions(max_batch=len(prompts)))
    if on_cuda:
        # Live lengths run from the first decode step's to the full slab: capture each bucket in between now.
        for length in {n for p in prompts for n in (len(p.joined()) + 1, slots_needed(p, sampling))}:
            scheduler.warm(length)
    return scheduler


@dataclass
class Answered:
    """One request of a true batch: the scheduler's request and what the benchmark saw of it."""

    request: BatchRequest
    fetch: FetchResult | None = None
    fetch_ms: float = 0.0  # the admission fetch's wall time (0: naive)
    finished_at: float = 0.0

    @property
    def tokens(self) -> list[int]:
        return self.request.result.token_ids


@dataclass
class BatchRun:
    """One batch to its last token: its requests in the order they were added and its decode steps."""

    started: float
    answered: list[Answered]
    steps: list[tuple[int, float]] = field(default_factory=list)  # (requests decoded, seconds of the step)
    prefilled_together: int = 0  # requests whose question went through one batched prefill

    def ttfts_ms(self) -> list[float]:
        return [(a.request.first_token_at - self.started) * 1e3 for a in self.answered]

    def figures(self) -> dict[str, float]:
        """TTFT of the first and of the last request to get its first token and the median, all from the batch
        start; the batch's total to its last token; decode ms per step at the largest batch a step decoded."""
        ttfts = self.ttfts_ms()
        largest = max((n for n, _ in self.steps), default=0)
        full = [seconds * 1e3 for n, seconds in self.steps if n == largest]
        return {
            "first_ttft_ms": min(ttfts),
            "p50_ttft_ms": statistics.median(ttfts),
            "last_ttft_ms": max(ttfts),
            "batch_ms": (max(a.finished_at for a in self.answered) - self.started) * 1e3,
            "decode_ms_per_step": statistics.median(full) if full else float("nan"),
            "decode_batch": float(largest),
            "prefilled_together": float(self.prefilled_together),
        }

    def stages(self) -> list[dict[str, float]]:
        """Per request, the stages `bench_tables` reports (TTFT from the batch start)."""
        return [_stages(a, ttft) for a, ttft in zip(self.answered, self.ttfts_ms(), strict=True)]


def _stages(answered: Answered, ttft_ms: float) -> dict[str, float]:
    timings, fetch = answered.request.result.timings, answered.fetch
    tokens = len(answered.tokens)
    return {
        "queue_ms": answered.request.queue_ms,
        "fetch_ms": answered.fetch_ms,
        "load_ms": fetch.timings.load_ms if fetch else 0.0,
        "h2d_ms": fetch.timings.h2d_ms if fetch else 0.0,  # read after the batch: every copy has landed
        "precompute_ms": (fetch.timings.precompute_ms if fetch else 0.0) + timings.precompute_ms,
        "stitch_ms": timings.stitch_ms,
        "prefill_ms": timings.prefill_ms,
        "ttft_ms": ttft_ms,
        "decode_ms_per_token": timings.decode_ms / max(1, tokens - 1),
    }


def run_batch(
    scheduler: Scheduler,
    prompts: Sequence[PromptIds],
    sampling: SamplingParams,
    store: KVStore | None,
    expected: Tier | None = None,
) -> BatchRun:
    """Every prompt submitted at once (turbo from `store`'s tiers, naive when it is None) and stepped to the end;
    raises the first request's error, or RuntimeError when a fetch found a block outside the `expected` tier."""
    answered = [_answered(p, sampling, store) for p in prompts]
    scheduler.planner.kv_source = None if store is None else _TimedChunks(StoreChunks(store), answered)
    together_before = scheduler.prefilled_together
    run = BatchRun(time.perf_counter(), answered)
    for a in answered:
        scheduler.add(a.request)
    try:
        while scheduler.has_work():
            decoding = scheduler.busy_s["decode"]
            scheduler.step()
            if scheduler.last_batch:
                run.steps.append((scheduler.last_batch, scheduler.busy_s["decode"] - decoding))
    except BaseException as err:  # a step itself failed: end what is left, so the scheduler can run the next batch
        scheduler.fail_all(err if isinstance(err, Exception) else RuntimeError("interrupted"))
        raise
    run.prefilled_together = scheduler.prefilled_together - together_before
    _check(answered, expected)
    return run


def _answered(prompt: PromptIds, sampling: SamplingParams, store: KVStore | None) -> Answered:
    mode = GenerationMode.NAIVE if store is None else GenerationMode.TURBO
    answered = Answered(BatchRequest(prompt, sampling, mode))
    answered.request.on_finish = _finished(answered)
    return answered


def _finished(answered: Answered) -> Callable[[BatchRequest], None]:
    def on_finish(_: BatchRequest) -> None:
        answered.finished_at = time.perf_counter()

    return on_finish


class _TimedChunks:
    """The server's KV source, each fetch timed and handed to its request's record (requests are admitted in the
    order they were added: first come, first served)."""

    def __init__(self, chunks: StoreChunks, answered: Sequence[Answered]) -> None:
        self.chunks = chunks
        self.pending = list(answered)

    def fetch(self, blocks: Sequence[Sequence[int]]) -> FetchResult:
        answered = self.pending.pop(0)
        began = time.perf_counter()
        answered.fetch = self.chunks.fetch(blocks)
        answered.fetch_ms = (time.perf_counter() - began) * 1e3
        return answered.fetch


def _check(answered: Sequence[Answered], expected: Tier | None) -> None:
    for a in answered:
        if a.request.error is not None:
            raise a.request.error
        if a.request.result.finish_reason != "length":
            raise RuntimeError(f"a request ended with {a.request.result.finish_reason!r}, not at its last token")
        blocks = len(a.request.prompt.blocks)
        if expected is not None and a.fetch is not None and a.fetch.counts.get(expected, 0) != blocks:
            raise RuntimeError(f"expected every block from the {expected.value} tier, got {a.fetch.counts}")
