"""A finished request holds no chunk KV: the blocks fetched for it from the host tier (which a GPU tier too small
for them does not keep) are freed when it ends, by reference counting alone, whoever still holds the request.

A long-running server collects reference cycles rarely (a full collection waits for hundreds of thousands of new
objects), so a block kept alive only by cyclic garbage stays on the device for hundreds of answers: on an H200 with a
1 GiB GPU tier, 16 host-tier chunks of 34 MiB per answer exhausted 100 GB. Each test runs with the collector off
and checks what is still alive, through the real scheduler over a real KV store (its GPU tier CPU tensors here).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
from gc_alive import AliveSince

from service.engine.batch_request import BatchRequest
from service.engine.chunk_arena import ChunkArena
from service.engine.engine import StitchEngine
from service.engine.gate import synthetic_ids
from service.engine.kv_layout import KVBlock, TokenIds
from service.engine.kv_pool import KVPool
from service.engine.sampling import SamplingParams
from service.engine.scheduler import Scheduler
from service.kvcache.index import SqliteIndex
from service.kvcache.store import KVStore, TierBudgets
from service.kvcache.tiers import Tier
from service.serving.kv_source import StoreChunks, kv_store_for

CHUNKS = 12  # the corpus
CHUNK_TOKENS = 20
READS = 4  # chunks per request
REQUESTS = 24
FAILING_CHUNK = CHUNKS  # a chunk outside the corpus whose precompute fails


def gpu_tier_ids(store: KVStore) -> set[int]:
    """The ids of the blocks the store's GPU tier holds (they stay: the tier keeps them)."""
    return {id(store.gpu.peek(key)) for key, _ in store.gpu.held()}


class Corpus:
    """The engine's chunk ids and requests over them."""

    def __init__(self, engine: StitchEngine) -> None:
        self.engine = engine
        self.chunks = synthetic_ids(engine, [CHUNK_TOKENS] * (CHUNKS + 1), seed=5)

    def blocks(self, reads: Sequence[int]) -> list[TokenIds]:
        return [self.engine.template.chunk_block(tuple(self.chunks[c])) for c in reads]

    def request(self, n: int, reads: Sequence[int] | None = None) -> BatchRequest:
        reads = reads if reads is not None else [(n + i) % CHUNKS for i in range(READS)]
        question = synthetic_ids(self.engine, (6,), seed=100 + n)[0]
        prompt = self.engine.template.prompt([self.chunks[c] for c in reads], question)
        return BatchRequest(prompt, SamplingParams(max_new_tokens=3, ignore_eos=True))


def small_gpu_tier_store(engine: StitchEngine, root: Path, precompute: Callable[..., list[KVBlock]]) -> KVStore:
    """A GPU tier of one chunk's bytes (most blocks do not fit: host hits are copied per request) over a host pool
    that holds the whole corpus."""
    chunk_bytes = (CHUNK_TOKENS + 8) * engine.spec.kv_bytes_per_token()
    budgets = TierBudgets(gpu_bytes=chunk_bytes, host_bytes=64 << 20, disk_bytes=64 << 20)
    return kv_store_for(engine, root / "cache", SqliteIndex(root / "index.sqlite"), budgets, precompute=precompute)


@pytest.fixture
def engine(get_engine: Callable[[str, str], StitchEngine], device: str) -> StitchEngine:
    """The tiny Qwen2 on the CPU, and on CUDA where there is one (its copies then run on the store's streams)."""
    return get_engine("qwen2", device)


def failing_precompute(engine: StitchEngine, corpus: Corpus) -> Callable[[Sequence[Sequence[int]]], list[KVBlock]]:
    """The engine's precompute, failing (as a device out of memory would) for the chunk outside the corpus."""
    failing = corpus.blocks([FAILING_CHUNK])[0]

    def precompute(blocks: Sequence[Sequence[int]]) -> list[KVBlock]:
        if any(tuple(b) == failing for b in blocks):
            raise RuntimeError("CUDA out of memory (injected)")
        return engine.precompute(blocks)

    return precompute


@pytest.mark.parametrize(
    ("overlap", "shared"),
    [(False, False), (True, False), (False, True)],
    ids=["read-each-step", "overlapped", "shared-chunks"],
)
def test_host_tier_blocks_are_freed_when_their_requests_end(
    engine: StitchEngine, tmp_path: Path, no_collector: None, overlap: bool, shared: bool
) -> None:
    """Shared-chunk mode too: there the fetch asks only for the chunks the arena lacks, pins the GPU tier's blocks
    and copies the others into the arena (an arena of eight chunks' slots: chunks are evicted and fetched again)."""
    corpus = Corpus(engine)
    with small_gpu_tier_store(engine, tmp_path, engine.precompute) as store:
        store.fetch(corpus.blocks(range(CHUNKS)))  # every chunk computed once: the host pool holds them all
        store.flush()  # the disk writer holds the computed blocks until written
        engine.prefix_block  # noqa: B018 (computed once, kept by the engine)
        blocks = AliveSince(KVBlock)
        pool = KVPool(engine.spec, 4000 * engine.spec.kv_bytes_per_token())
        arena_bytes = 8 * len(corpus.blocks([0])[0]) * engine.spec.kv_bytes_per_token()
        arena = ChunkArena(engine.spec, engine.forward.rotary, arena_bytes, base=engine.chunk_start)
        source = StoreChunks(store)
        scheduler = Scheduler(
            engine, pool, max_batch=4, overlap=overlap, kv_source=source, arena=arena if shared else None
        )
        fetched: list[weakref.ref[torch.Tensor]] = []

        def watch(request: BatchRequest) -> None:  # while it ends: its fetch is still there to read
            if request.fetch is None:
                assert len(request.resident_chunks) == READS  # shared, every chunk found in the arena
            else:
                fetched.extend(weakref.ref(b.kv) for b in request.fetch.blocks)

        requests = [corpus.request(n) for n in range(REQUESTS)]  # the caller keeps every request
        for request in requests:
            request.on_finish = watch
            scheduler.add(request)
        scheduler.run_until_idle()

        assert [r.result.finish_reason for r in requests] == ["length"] * REQUESTS
        # Shared, the chunks the arena held were read there, not fetched.
        resident = sum(len(r.resident_chunks) for r in requests)
        assert (resident > 0) == shared and len(fetched) == REQUESTS * READS - resident
        assert store.stats().hits[Tier.HOST] >= len(fetched) // 2 > 0  # most fetches copied from the host pool
        tier = {id(store.gpu.peek(key).kv) for key, _ in store.gpu.held()}  # type: ignore[union-attr]
        alive = [ref() for ref in fetched if ref() is not None and id(ref()) not in tier]
        assert alive == []
        assert blocks.new(besides=gpu_tier_ids(store)) == []
        assert [(r.chunk_kv, r.chunk_ready, r.fetch, r.on_finish) for r in requests] == [(None,) * 4] * REQUESTS
        assert pool.used_slots == 0 and store.gpu.pinned_bytes == 0
        assert arena.chunks == (8 if shared else 0) and arena.pinned_chunks == 0 and (arena.evictions > 0) == shared


def test_a_failed_fetch_leaves_no_block_in_its_errors_traceback(
    engine: StitchEngine, tmp_path: Path, no_collector: None
) -> None:
    """A fetch that fails after copying host hits (its misses' precompute ran out of memory): the failed request
    keeps its error, whose traceback must not keep the blocks copied for it (they were the fetch's locals)."""
    corpus = Corpus(engine)
    with small_gpu_tier_store(engine, tmp_path, failing_precompute(engine, corpus)) as store:
        store.fetch(corpus.blocks(range(CHUNKS)))
        store.flush()
        engine.prefix_block  # noqa: B018
        blocks = AliveSince(KVBlock)
        pool = KVPool(engine.spec, 4000 * engine.spec.kv_bytes_per_token())
        scheduler = Scheduler(engine, pool, max_batch=4, kv_source=StoreChunks(store))
        failed = corpus.request(0, reads=[0, 1, 2, FAILING_CHUNK])  # three host hits, then the failing miss
        served = corpus.request(1)
        for request in (failed, served):
            scheduler.add(request)
        scheduler.run_until_idle()

        assert failed.result.finish_reason == "error" and "injected" in str(failed.error)
        assert served.result.finish_reason == "length"
        assert failed.error is not None and failed.error.__traceback__ is not None  # kept, and still printable
        assert blocks.new(besides=gpu_tier_ids(store)) == []
        assert pool.used_slots == 0
