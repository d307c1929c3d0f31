"""Shared-chunk admission fetches only the chunks the arena lacks.

Requests run through the real scheduler over a real KV store, seen through a spying KV source that records every
fetch. A chunk the arena holds is pinned before the missing ones are placed and is never fetched again; the tokens
stay the copy path's (fp32 CPU, greedy: exact); a refusal for room holds no pin and no fetched block; the `done`
event and the metrics count a chunk read resident as a GPU hit.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from service.engine.batch_request import BatchRequest
from service.engine.chunk_arena import ChunkArena
from service.engine.engine import GenerationMode, StitchEngine
from service.engine.gate import synthetic_ids
from service.engine.sampling import SamplingParams
from service.engine.scheduler import Scheduler
from service.facade.types import DoneEvent
from service.kvcache.store import FetchResult, KVStore
from service.kvcache.tiers import Tier
from service.metrics import Metrics
from service.retrieval.collection import RetrievedChunk
from service.serving.answer_session import AnswerItem, AnswerSession
from service.serving.engine_loop import EngineLoop
from service.serving.kv_source import StoreChunks
from service.serving.runtime import arena_residency
from service.usecases.answer import Answerer, Question, Retrieval
from tests.test_engine_shared_scheduler import (
    LENGTHS,
    Ask,
    Run,
    assert_nothing_pinned,
    block_sizes,
    copy_path,
    drain,
    nan_arena,
    nan_pool,
)


class SpyingSource:
    """The store's KV source, recording the token ids of every block each fetch asked for."""

    def __init__(self, store: KVStore) -> None:
        self.inner = StoreChunks(store)
        self.fetched: list[list[tuple[int, ...]]] = []

    def fetch(self, blocks: Sequence[Sequence[int]], pin: bool = False) -> FetchResult:
        self.fetched.append([tuple(ids) for ids in blocks])
        return self.inner.fetch(blocks, pin)

    def release(self, fetched: FetchResult) -> None:
        self.inner.release(fetched)


@pytest.fixture
def store(qwen2_kv_store: KVStore) -> KVStore:
    return qwen2_kv_store


def shared_scheduler(engine: StitchEngine, store: KVStore, arena: ChunkArena) -> tuple[Scheduler, SpyingSource]:
    source = SpyingSource(store)
    return Scheduler(engine, nan_pool(engine, 2000), max_batch=8, kv_source=source, arena=arena), source


def one_by_one(scheduler: Scheduler, requests: Sequence[BatchRequest]) -> None:
    """Each request run to its end before the next is added (so each finds what the ones before left)."""
    for request in requests:
        scheduler.add(request)
        drain(scheduler)


def blocks_of(request: BatchRequest, *indices: int) -> list[tuple[int, ...]]:
    return [tuple(request.prompt.blocks[i]) for i in indices]


def test_chunks_the_arena_holds_are_read_there_and_only_the_others_fetched(
    get_engine: Callable[[str, str], StitchEngine], store: KVStore
) -> None:
    """The first request fetches its three chunks; a second over the same chunks fetches nothing; a third mixing
    two of them with a new chunk fetches the new one alone. Every answer's tokens are the copy path's, the
    resident chunks are recorded per request (for the done event) and counted in the arena's stats."""
    engine = get_engine("qwen2", "cpu")
    asks = (Ask((0, 1, 2), max_new=8, seed=1), Ask((0, 1, 2), max_new=8, seed=2), Ask((2, 3, 0), max_new=7, seed=3))
    want = copy_path(engine, asks)
    arena = nan_arena(engine, sum(block_sizes(engine)))
    scheduler, source = shared_scheduler(engine, store, arena)
    run = Run(engine, asks)
    one_by_one(scheduler, run.requests)
    first, second, third = run.requests
    assert source.fetched == [blocks_of(first, 0, 1, 2), blocks_of(third, 1)]
    assert (first.resident_chunks, second.resident_chunks, third.resident_chunks) == ((), (0, 1, 2), (0, 2))
    assert run.outcomes() == want
    assert scheduler.shared is not None and scheduler.shared.stats().resident_reads == 5
    assert arena.chunks == 4 and arena.evictions == 0 and store.gpu.pinned_bytes == 0
    assert_nothing_pinned(scheduler)


def test_a_resident_chunk_is_pinned_before_a_placement_that_must_evict(
    get_engine: Callable[[str, str], StitchEngine], store: KVStore
) -> None:
    """An arena of exactly chunks 0 and 1's slots holds chunk 0 (least recently used) and chunk 3. A request
    reading chunks 1 then 0 needs room for chunk 1: it evicts chunk 3, never chunk 0, which it pinned first and
    did not fetch; chunk 0 stays where it was, and the tokens are the copy path's."""
    engine = get_engine("qwen2", "cpu")
    sizes = block_sizes(engine)
    asks = (Ask((0,), max_new=4, seed=1), Ask((3,), max_new=4, seed=2), Ask((1, 0), max_new=8, seed=3))
    want = copy_path(engine, asks)
    arena = nan_arena(engine, sizes[0] + sizes[1])
    scheduler, source = shared_scheduler(engine, store, arena)
    run = Run(engine, asks)
    one_by_one(scheduler, run.requests[:2])
    chunk_0 = run.requests[0].prompt.blocks[0]
    (where,) = arena.pin_held(engine.kv_version, [chunk_0])
    assert where is not None
    arena.release([where])
    assert arena.chunks == 2 and arena.used_slots == sizes[0] + sizes[3] and arena.evictions == 0
    reader = run.requests[2]
    scheduler.add(reader)
    scheduler.step()
    assert reader.arena_ranges[1] == where and reader.resident_chunks == (1,)
    assert arena.evictions == 1 and arena.pins(engine.kv_version, run.requests[1].prompt.blocks[0]) is None
    assert source.fetched[-1] == blocks_of(reader, 0)  # chunk 1 alone
    drain(scheduler)
    assert run.outcomes() == want
    assert_nothing_pinned(scheduler)


def test_a_refusal_for_room_holds_no_pin_and_no_fetched_block(
    get_engine: Callable[[str, str], StitchEngine], store: KVStore
) -> None:
    """An arena of exactly chunks 0 and 2's slots: chunk 0 resident and unpinned, chunk 2 pinned by a running
    answer. A request reading chunks 1 and 0 (the room check let through, as a fragmented arena may) pins chunk 0,
    fetches chunk 1, and finds no room: the only chunk a placement could evict is the one it pinned. It waits
    holding nothing (no slab, no arena pin, no device-tier pin, no fetched KV) and chunk 0 is not evicted; once
    the running answer ends it runs, evicting chunk 2, with the copy path's tokens."""
    engine = get_engine("qwen2", "cpu")
    sizes = block_sizes(engine)
    asks = (Ask((0,), max_new=4, seed=1), Ask((2,), max_new=10, seed=2), Ask((1, 0), max_new=6, seed=3))
    want = copy_path(engine, asks)
    arena = nan_arena(engine, sizes[0] + sizes[2])
    scheduler, source = shared_scheduler(engine, store, arena)
    assert scheduler.shared is not None
    run = Run(engine, asks)
    resident, running, waiting = run.requests
    one_by_one(scheduler, [resident])
    scheduler.add(running)
    scheduler.step()
    held = store.gpu.pinned_bytes
    assert list(scheduler.running) == [running] and held > 0
    scheduler.shared.may_fit = lambda request: True  # type: ignore[method-assign]
    scheduler.add(waiting)
    scheduler.step()
    assert list(scheduler.waiting) == [waiting] and source.fetched[-1] == blocks_of(waiting, 0)
    assert waiting.slab is None and waiting.arena_ranges == () and waiting.fetch is None and waiting.chunk_kv is None
    chunk_0, chunk_2 = resident.prompt.blocks[0], running.prompt.blocks[0]
    assert arena.pins(engine.kv_version, chunk_0) == 0 and arena.pins(engine.kv_version, chunk_2) == 1
    assert arena.evictions == 0 and arena.pinned_chunks == 1 and store.gpu.pinned_bytes == held
    drain(scheduler)
    assert run.outcomes() == want
    assert arena.evictions == 1 and arena.pins(engine.kv_version, chunk_2) is None
    assert waiting.resident_chunks == (1,) and scheduler.shared.stats().waited == 1
    assert store.gpu.pinned_bytes == 0
    assert_nothing_pinned(scheduler)


def retrieved(engine: StitchEngine, ids: Sequence[int], index: int) -> RetrievedChunk:
    text = f"chunk {index}"
    return RetrievedChunk(f"c{index}", "doc", index, 1.0, text, tuple(ids), "v1", f"k{index}", 0, len(text))


def answer(
    session_of: Callable[[Question, Retrieval], AnswerSession],
    engine: StitchEngine,
    chunks: Sequence[RetrievedChunk],
    seed: int,
) -> DoneEvent:
    """One answer through an `AnswerSession`, as the server runs it; its `done` event."""
    ids = synthetic_ids(engine, (7,), seed=1000 + seed)[0]
    question = Question("q", sampling=SamplingParams(max_new_tokens=4, ignore_eos=True), ids=tuple(ids))
    session = session_of(question, Retrieval(list(chunks), 0, 0.0))
    ended = threading.Event()
    items: list[AnswerItem] = []

    def listener(item: AnswerItem) -> None:
        items.append(item)
        if item is None:
            ended.set()

    session.start(listener)
    assert ended.wait(120), "the answer did not end"
    assert session.done is not None, items
    return session.done


def test_the_done_event_and_the_metrics_count_resident_chunks_as_gpu_hits(
    get_engine: Callable[[str, str], StitchEngine], store: KVStore
) -> None:
    """Two answers through the engine loop, the second reading two of the first's chunks and a new one: its done
    event counts the two it read from the arena (fetching nothing for them) as GPU hits, with their bytes, and
    the new one as computed; `kvstitch_kv_blocks` counts them so and the arena counts its resident reads. The
    store's own hit counter (`kvstitch_kv_hits`) is its lookups alone: it was never asked for them."""
    engine = get_engine("qwen2", "cpu")
    arena = nan_arena(engine, sum(block_sizes(engine)))
    scheduler, source = shared_scheduler(engine, store, arena)
    assert scheduler.shared is not None
    metrics = Metrics()
    metrics.watch_arena(scheduler.shared.stats)
    loop = EngineLoop(8)
    loop.serve_answers(scheduler)
    answerer = Answerer(engine, store, lambda *_: [[]])

    def session_of(question: Question, retrieval: Retrieval) -> AnswerSession:
        return AnswerSession(loop, answerer, metrics, question, retrieval, loop.admit(), time.perf_counter())

    corpus = synthetic_ids(engine, LENGTHS, seed=21)
    chunks = [retrieved(engine, corpus[i], i) for i in range(4)]
    try:
        first = answer(session_of, engine, chunks[:3], seed=1)
        second = answer(session_of, engine, [chunks[0], chunks[3], chunks[1]], seed=2)
        assert loop.call(lambda: arena.pinned_chunks) == 0 and loop.call(lambda: scheduler.has_work()) is False
    finally:
        loop.close()
    assert first.kv == {"gpu": 0, "host": 0, "disk": 0, "miss": 3}
    assert second.kv == {"gpu": 2, "host": 0, "disk": 0, "miss": 1}
    per_token = engine.spec.kv_bytes_per_token()
    resident_tokens = sum(len(engine.template.chunk_block(corpus[i])) for i in (0, 1))
    assert second.kv_bytes["gpu"] == resident_tokens * per_token
    assert second.kv_bytes["miss"] == len(engine.template.chunk_block(corpus[3])) * per_token
    assert len(source.fetched) == 2 and len(source.fetched[1]) == 1  # chunk 3 alone
    sample = metrics.registry.get_sample_value
    assert sample("kvstitch_kv_blocks_total", {"tier": "gpu"}) == 2
    assert sample("kvstitch_kv_blocks_total", {"tier": "miss"}) == 4
    assert sample("kvstitch_arena_resident_reads_total") == 2
    assert store.stats().hits[Tier.GPU] == 0 and store.stats().misses == 4


def test_an_answer_reads_its_disk_only_chunks_ahead_and_admits_them_as_host_hits(
    get_engine: Callable[[str, str], StitchEngine], store: KVStore
) -> None:
    """Chunks whose KV only the disk holds are read into the host tier when the answer starts (before it waits in
    line), so its admission copies them from host memory: the done event counts host hits, no disk reads."""
    engine = get_engine("qwen2", "cpu")
    arena = nan_arena(engine, sum(block_sizes(engine)))
    scheduler, _ = shared_scheduler(engine, store, arena)
    corpus = synthetic_ids(engine, LENGTHS, seed=31)
    chunks = [retrieved(engine, corpus[i], i) for i in range(3)]
    store.put(engine.precompute([engine.template.chunk_block(c.token_ids) for c in chunks]))
    assert store.plan([engine.template.chunk_block(c.token_ids) for c in chunks]).counts()[Tier.DISK] == 3
    loop = EngineLoop(8)
    loop.serve_answers(scheduler)
    answerer = Answerer(engine, store, lambda *_: [[]])
    started: list[int] = []
    read_ahead = answerer.read_ahead

    def read_ahead_first(*args: Any) -> Any:  # the reads ahead done before the engine sees the answer
        future = read_ahead(*args)
        started.append(future.result() if future is not None else 0)
        return future

    answerer.read_ahead = read_ahead_first  # type: ignore[method-assign]

    def session_of(question: Question, retrieval: Retrieval) -> AnswerSession:
        return AnswerSession(loop, answerer, Metrics(), question, retrieval, loop.admit(), time.perf_counter())

    try:
        done = answer(session_of, engine, chunks, seed=3)
    finally:
        loop.close()
    assert started == [3] and store.prefetched == 3
    assert done.kv == {"gpu": 0, "host": 3, "disk": 0, "miss": 0}


def test_reading_ahead_is_for_turbo_prompts_and_never_fails_an_answer(
    get_engine: Callable[[str, str], StitchEngine], caplog: pytest.LogCaptureFixture
) -> None:
    engine = get_engine("qwen2", "cpu")
    asked: list[object] = []

    class Store:
        def read_ahead(self, blocks: list[object]) -> concurrent.futures.Future[int]:
            asked.append(blocks)
            if len(asked) > 2:
                raise RuntimeError("cannot schedule new futures after shutdown")
            started: concurrent.futures.Future[int] = concurrent.futures.Future()
            if len(asked) == 1:
                started.set_result(2)
            else:
                started.set_exception(OSError("the index went away"))
            return started

    answerer = Answerer(engine, Store(), lambda *_: [[]])  # type: ignore[arg-type]
    prompt = engine.template.prompt(synthetic_ids(engine, (5, 6), seed=4), synthetic_ids(engine, (3,), seed=5)[0])
    assert answerer.read_ahead(prompt, GenerationMode.NAIVE) is None and asked == []
    first = answerer.read_ahead(prompt, GenerationMode.TURBO)
    assert first is not None and first.result() == 2 and [list(b) for b in asked] == [list(prompt.blocks)]
    failed = answerer.read_ahead(prompt, GenerationMode.TURBO)  # its failure logged, nobody waits for it
    assert failed is not None and "the index went away" in caplog.text
    assert answerer.read_ahead(prompt, GenerationMode.TURBO) is None  # the store closing: logged, not raised
    assert "cannot schedule new futures" in caplog.text


def test_chunks_the_arena_holds_are_not_read_ahead(
    get_engine: Callable[[str, str], StitchEngine], store: KVStore
) -> None:
    """A chunk the arena holds is read there at admission, without a fetch: reading it ahead from disk would only
    spend the disk and evict host blocks. With the arena's residency the answerer skips it; without, it would not."""
    engine = get_engine("qwen2", "cpu")
    arena = nan_arena(engine, sum(block_sizes(engine)))
    scheduler, source = shared_scheduler(engine, store, arena)
    corpus = synthetic_ids(engine, LENGTHS, seed=41)
    chunks = [retrieved(engine, corpus[i], i) for i in range(3)]
    blocks = [engine.template.chunk_block(c.token_ids) for c in chunks]
    store.put(engine.precompute(blocks))
    loop = EngineLoop(8)
    loop.serve_answers(scheduler)
    answerer = Answerer(engine, store, lambda *_: [[]], arena_residency(scheduler, engine))

    def session_of(question: Question, retrieval: Retrieval) -> AnswerSession:
        return AnswerSession(loop, answerer, Metrics(), question, retrieval, loop.admit(), time.perf_counter())

    try:
        answer(session_of, engine, chunks, seed=4)  # reads them ahead (or the fetch reads them), then places them
        assert store.prefetched <= 3 and all(loop.call(lambda b=b: arena.holds(engine.kv_version, b)) for b in blocks)
        for block in blocks:  # the store's memory tiers forget them: only the disk and the arena hold them now
            store.gpu.discard(store.key_of(block))
            store.host.discard(store.key_of(block))
        assert store.plan(blocks).counts()[Tier.DISK] == 3
        fetches = len(source.fetched)
        done = answer(session_of, engine, chunks, seed=5)
    finally:
        loop.close()
    assert done.kv == {"gpu": 3, "host": 0, "disk": 0, "miss": 0} and len(source.fetched) == fetches
    prompt = engine.template.prompt([c.token_ids for c in chunks], synthetic_ids(engine, (3,), seed=6)[0])
    assert answerer.read_ahead(prompt, GenerationMode.TURBO) is None  # every chunk resident: nothing to read
    without = Answerer(engine, store, lambda *_: [[]]).read_ahead(prompt, GenerationMode.TURBO)  # no residency
    assert without is not None and without.result() == 3
