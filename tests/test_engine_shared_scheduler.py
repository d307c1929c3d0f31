"""Shared-chunk mode through the real scheduler: turbo answers read their chunks from one `ChunkArena`.

Each test runs the same requests through a scheduler on the copy path (no arena) and through one with an arena,
and asserts the same greedy tokens and texts (fp32 CPU: exact). Pools and arenas are NaN-poisoned, so a request
reading a slot nobody wrote for it would turn NaN and break the equality. After every run no arena range and no
device-tier block stays pinned, whichever way the requests ended.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest
import torch
from pydantic import ValidationError

from service.engine.batch_request import BatchRequest
from service.engine.chunk_arena import ArenaFullError, ChunkArena
from service.engine.engine import StitchEngine
from service.engine.gate import synthetic_ids
from service.engine.kv_pool import KVPool
from service.engine.planner import AdmissionPlan
from service.engine.prompt import PromptIds
from service.engine.recompute_spec import parse_recompute
from service.engine.sampling import SamplingParams
from service.engine.scheduler import Scheduler
from service.kvcache.store import KVStore
from service.serving.kv_source import StoreChunks
from service.serving.runtime import open_arena
from service.settings import MIB, Settings

LENGTHS = (30, 17, 41, 12, 25)  # the corpus: chunk i has LENGTHS[i] tokens (its block, the template's wrapper too)


@dataclass(frozen=True)
class Ask:
    """One request: the corpus chunks it reads, in order, and how."""

    reads: tuple[int, ...]
    mode: str = "turbo"
    positions: str = "reordered"
    max_new: int = 8
    question: int = 7
    seed: int = 0
    recompute: str = "none"


# Chunks 0 and 2 are read by four requests; a naive request and a composite one run beside them.
ASKS = (
    Ask((0, 1, 2), max_new=10, seed=1),
    Ask((2, 0), positions="composite", max_new=12, seed=2),
    Ask((0, 3), max_new=6, seed=3, question=11),
    Ask((1, 2, 4), mode="naive", max_new=7, seed=4),
    Ask((2, 4, 0), max_new=9, seed=5),
    Ask((), max_new=5, seed=6, question=4),
)


class Run:
    """Requests through one scheduler, with what each streamed."""

    def __init__(self, engine: StitchEngine, asks: Sequence[Ask]) -> None:
        corpus = synthetic_ids(engine, LENGTHS, seed=21)
        self.deltas: list[list[str]] = [[] for _ in asks]
        self.requests = [
            BatchRequest(
                prompt(engine, corpus, ask),
                SamplingParams(max_new_tokens=ask.max_new, ignore_eos=True),
                ask.mode,
                ask.positions,
                on_text=deltas.append,
                recompute=parse_recompute(ask.recompute),
            )
            for ask, deltas in zip(asks, self.deltas, strict=True)
        ]

    def outcomes(self) -> list[tuple[list[int], str, str]]:
        for request, deltas in zip(self.requests, self.deltas, strict=True):
            assert "".join(deltas) == request.result.text
        return [(r.result.token_ids, r.result.text, r.result.finish_reason) for r in self.requests]


def prompt(engine: StitchEngine, corpus: Sequence[Sequence[int]], ask: Ask) -> PromptIds:
    question = synthetic_ids(engine, (ask.question,), seed=1000 + ask.seed)[0]
    return engine.template.prompt([corpus[c] for c in ask.reads], question)


def block_sizes(engine: StitchEngine) -> list[int]:
    """Slots each corpus chunk's block takes in the arena."""
    return [len(engine.template.chunk_block(c)) for c in synthetic_ids(engine, LENGTHS, seed=21)]


def nan_pool(engine: StitchEngine, slots: int) -> KVPool:
    return KVPool(engine.spec, slots * engine.spec.kv_bytes_per_token(), poison="nan")


def nan_arena(engine: StitchEngine, slots: int) -> ChunkArena:
    budget = slots * engine.spec.kv_bytes_per_token()
    return ChunkArena(engine.spec, engine.forward.rotary, budget, base=engine.chunk_start, poison="nan")


def drain(scheduler: Scheduler, limit: int = 300) -> None:
    for _ in range(limit):
        if not scheduler.has_work():
            return
        scheduler.step()
    raise AssertionError(f"still {len(scheduler.waiting)} waiting, {len(scheduler.running)} running")


def join_one_by_one(scheduler: Scheduler, requests: Sequence[BatchRequest]) -> None:
    """The first two requests added together and stepped (nothing runs yet: prefilled apart), then one joining at
    each step while the first ones run; stepped to the end."""
    for request in requests[:2]:
        scheduler.add(request)
    scheduler.step()
    for request in requests[2:]:
        scheduler.add(request)
        scheduler.step()
    drain(scheduler)


def copy_path(engine: StitchEngine, asks: Sequence[Ask], overlap: bool = False) -> list[tuple[list[int], str, str]]:
    """The asks on the copy path (no arena), all added at once."""
    run = Run(engine, asks)
    scheduler = Scheduler(engine, nan_pool(engine, 2000), max_batch=8, overlap=overlap)
    for request in run.requests:
        scheduler.add(request)
    drain(scheduler)
    return run.outcomes()


def assert_nothing_pinned(scheduler: Scheduler) -> None:
    arena = scheduler.shared.arena if scheduler.shared is not None else None
    assert arena is not None and arena.pinned_chunks == 0
    assert scheduler.pool.used_slots == 0 and not scheduler.has_work()


@pytest.fixture
def store(qwen2_kv_store: KVStore) -> KVStore:
    return qwen2_kv_store


@pytest.mark.parametrize("overlap", [False, True], ids=["read-each-step", "overlapped"])
@pytest.mark.parametrize("arch", ("llama", "qwen2"))
def test_shared_requests_decode_the_copy_paths_tokens(
    get_engine: Callable[[str, str], StitchEngine], arch: str, overlap: bool
) -> None:
    """Six requests (four turbo ones sharing chunks, a naive one, one without chunks), half joining after two
    steps: every token and text is the copy path's; the arena holds each chunk the turbo requests read once, the
    pool holds only each shared answer's tail while it runs, and nothing stays pinned at the end."""
    engine = get_engine(arch, "cpu")
    want = copy_path(engine, ASKS, overlap)
    sizes = block_sizes(engine)
    arena = nan_arena(engine, sum(sizes))
    scheduler = Scheduler(engine, nan_pool(engine, 2000), max_batch=8, overlap=overlap, arena=arena)
    assert scheduler.graphs is None and not scheduler.prefill_with_decode
    run = Run(engine, ASKS)
    for request in run.requests[:3]:
        scheduler.add(request)
    scheduler.step()
    scheduler.step()
    for request in run.requests[3:]:
        scheduler.add(request)
    scheduler.step()
    shared = [r for r, a in zip(run.requests, ASKS, strict=True) if a.mode == "turbo" and a.reads and not r.finished]
    assert len(shared) >= 3 and all(r.reads for r in shared)
    prefix = len(engine.template.prefix)
    for request in shared:  # a running shared answer's slab: prefix, question, answer budget; no chunk
        assert request.slab is not None
        assert request.slab.size == prefix + len(request.prompt.question) + request.sampling.max_new_tokens
    per_request = sum(r.slab.size for r in run.requests if r.slab is not None)
    assert scheduler.pool.used_slots == per_request
    assert arena.pins(engine.kv_version, run.requests[0].prompt.blocks[0]) == sum(  # chunk 0: one pin per reader
        1 for r in shared if run.requests[0].prompt.blocks[0] in r.prompt.blocks
    )
    drain(scheduler)
    assert run.outcomes() == want
    read = {c for a in ASKS if a.mode == "turbo" for c in a.reads}
    assert arena.chunks == len(read) and arena.used_slots == sum(sizes[c] for c in read)
    assert_nothing_pinned(scheduler)


@pytest.mark.parametrize("overlap", [False, True], ids=["read-each-step", "overlapped"])
@pytest.mark.parametrize("arch", ("llama", "qwen2"))
def test_shared_questions_ride_in_the_running_answers_step_with_the_copy_paths_tokens(
    get_engine: Callable[[str, str], StitchEngine], arch: str, overlap: bool
) -> None:
    """`prefill_with_decode` in shared mode: the requests joining while answers run have their questions
    prefilled in the decode step's forward (one mixed forward: the step by chunk, the questions by request), and
    every token and text is the copy path's; those added to an idle engine are prefilled apart."""
    engine = get_engine(arch, "cpu")
    want = copy_path(engine, ASKS, overlap)
    arena = nan_arena(engine, sum(block_sizes(engine)))
    pool = nan_pool(engine, 2000)
    scheduler = Scheduler(engine, pool, max_batch=8, overlap=overlap, arena=arena, prefill_with_decode=True)
    run = Run(engine, ASKS)
    for request in run.requests[:2]:
        scheduler.add(request)
    scheduler.step()
    assert scheduler.prefilled_together == 2 and scheduler.prefilled_with_decode == 0  # nobody ran: apart
    for request in run.requests[2:]:
        scheduler.add(request)
        scheduler.step()
    drain(scheduler)
    assert run.outcomes() == want
    # Joining one by one: the shared ones (2, 4 and 5, which reads no chunk) rode; the naive one is prefilled alone.
    assert scheduler.prefilled_with_decode == 3 and scheduler.prefilled_together == 5
    # Their question tokens, counted as computed riding; eager on the CPU: no graph bucket, no padding.
    riders = [run.requests[i] for i in (2, 4, 5)]
    assert scheduler.rider_tokens() == {"question": sum(len(r.prompt.question) for r in riders), "padding": 0}
    assert scheduler.rider_tokens()["question"] > 0
    assert_nothing_pinned(scheduler)


def test_a_question_whose_step_has_no_row_left_is_prefilled_apart(
    get_engine: Callable[[str, str], StitchEngine],
) -> None:
    """Overlapped: the only running answer's unread token is its last, so the step the new question was admitted
    to ride in has no row; the question is prefilled over the arena apart, and every token is the copy path's."""
    engine = get_engine("qwen2", "cpu")
    asks = (Ask((0, 1), max_new=2, seed=1), Ask((2, 0), max_new=6, seed=2))
    want = copy_path(engine, asks, overlap=True)
    arena = nan_arena(engine, sum(block_sizes(engine)))
    scheduler = Scheduler(engine, nan_pool(engine, 2000), 8, overlap=True, arena=arena, prefill_with_decode=True)
    run = Run(engine, asks)
    scheduler.add(run.requests[0])
    scheduler.step()
    planned: list[list[BatchRequest]] = []
    admit = scheduler.planner.admit

    def admit_and_record(only: Callable[[BatchRequest], bool] | None = None) -> AdmissionPlan:
        plan = admit(only)
        planned.append(plan.shared_riding)
        return plan

    scheduler.planner.admit = admit_and_record  # type: ignore[method-assign]
    scheduler.add(run.requests[1])
    scheduler.step()
    assert planned[0] == [run.requests[1]]  # admitted to ride, with the one running answer's last token unread
    assert scheduler.prefilled_with_decode == 0 and scheduler.prefilled_together == 2  # prefilled apart instead
    drain(scheduler)
    assert run.outcomes() == want
    assert scheduler.prefilled_with_decode == 0 and scheduler.prefilled_together == 2
    assert_nothing_pinned(scheduler)


def test_questions_over_the_ride_budget_are_prefilled_apart(
    get_engine: Callable[[str, str], StitchEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    from service.engine import shared_chunks

    monkeypatch.setattr(shared_chunks, "RIDE_TOKENS", 3)  # under every question here
    engine = get_engine("llama", "cpu")
    asks = ASKS[:3]
    want = copy_path(engine, asks)
    arena = nan_arena(engine, sum(block_sizes(engine)))
    scheduler = Scheduler(engine, nan_pool(engine, 2000), 8, arena=arena, prefill_with_decode=True)
    run = Run(engine, asks)
    for request in run.requests:
        scheduler.add(request)
        scheduler.step()
    drain(scheduler)
    assert run.outcomes() == want
    assert scheduler.prefilled_with_decode == 0 and scheduler.prefilled_together == 3


@pytest.mark.parametrize("overlap", [False, True], ids=["read-each-step", "overlapped"])
def test_the_part_of_a_wave_a_step_cannot_hold_rides_in_the_next_step(
    get_engine: Callable[[str, str], StitchEngine], monkeypatch: pytest.MonkeyPatch, overlap: bool
) -> None:
    """Four shared questions arrive at once while an answer runs, and a decode step holds two of them: two ride
    in this step, the other two wait for the next and ride in it. None is prefilled apart (which would stall the
    running answer for a forward of its own), and every token is the copy path's."""
    from service.engine import shared_chunks

    engine = get_engine("qwen2", "cpu")
    asks = (
        Ask((0, 1), max_new=12, seed=1),
        Ask((2, 0), max_new=6, seed=2),
        Ask((0, 3), max_new=5, seed=3),
        Ask((1,), max_new=7, seed=4),
        Ask((4, 2), max_new=6, seed=5),
    )
    want = copy_path(engine, asks, overlap)
    arena = nan_arena(engine, sum(block_sizes(engine)))
    scheduler = Scheduler(engine, nan_pool(engine, 2000), 8, overlap=overlap, arena=arena, prefill_with_decode=True)
    run = Run(engine, asks)
    question = len(run.requests[1].prompt.question)
    assert all(len(r.prompt.question) == question for r in run.requests)
    monkeypatch.setattr(shared_chunks, "RIDE_TOKENS", 2 * question)
    scheduler.add(run.requests[0])
    scheduler.step()
    assert scheduler.prefilled_together == 1
    for request in run.requests[1:]:
        scheduler.add(request)
    scheduler.step()
    assert scheduler.prefilled_with_decode == 2 and list(scheduler.waiting) == run.requests[3:]
    scheduler.step()
    assert scheduler.prefilled_with_decode == 4 and not scheduler.waiting
    drain(scheduler)
    assert run.outcomes() == want
    assert scheduler.prefilled_together == 5 and scheduler.prefilled_with_decode == 4  # one apart, four rode
    assert_nothing_pinned(scheduler)


def test_cancelled_and_failed_requests_give_their_pins_back(
    get_engine: Callable[[str, str], StitchEngine], store: KVStore
) -> None:
    """Through the KV store's tiers (its device tier pinned while shared requests run): one request cancelled
    mid-answer, one whose block copy fails at admission, then a step that fails for the whole batch. Every arena
    range and device-tier pin is given back; the requests before the failure streamed the copy path's tokens."""
    engine = get_engine("qwen2", "cpu")
    asks = ASKS[:3]
    want = copy_path(engine, asks)
    arena = nan_arena(engine, sum(block_sizes(engine)))
    scheduler = Scheduler(engine, nan_pool(engine, 2000), max_batch=8, kv_source=StoreChunks(store), arena=arena)
    run = Run(engine, asks)
    for request in run.requests:
        scheduler.add(request)
    scheduler.step()
    assert store.gpu.pinned_bytes > 0 and arena.pinned_chunks == 4  # chunks 0, 1, 2, 3
    scheduler.cancel(run.requests[1])
    scheduler.step()
    assert run.requests[1].result.finish_reason == "cancelled" and run.requests[1].arena_ranges == ()
    assert arena.pins(engine.kv_version, run.requests[0].prompt.blocks[0]) == 2  # requests 0 and 2 still read it
    drain(scheduler)
    got = run.outcomes()
    assert [got[0], got[2]] == [want[0], want[2]]
    tokens = got[1][0]
    assert 0 < len(tokens) < len(want[1][0]) and tokens == want[1][0][: len(tokens)]
    assert store.gpu.pinned_bytes == 0
    assert_nothing_pinned(scheduler)

    def broken_copy() -> None:
        raise RuntimeError("the host tier lost the block")

    # The failing copy is chunk 4's, which the arena lacks (a resident chunk is read without waiting for a copy);
    # chunk 1, resident, was pinned before the copy failed and is given back.
    corpus = synthetic_ids(engine, LENGTHS, seed=21)
    broken_prompt = prompt(engine, corpus, Ask((4, 1)))
    broken = BatchRequest(
        broken_prompt,
        SamplingParams(max_new_tokens=4),
        chunk_kv=engine.precompute(broken_prompt.blocks),
        chunk_ready=[broken_copy, None],
    )
    again = Run(engine, asks[:2])
    for request in (broken, *again.requests):
        scheduler.add(request)
    scheduler.step()
    assert broken.result.finish_reason == "error" and isinstance(broken.error, RuntimeError)
    assert broken.slab is None and broken.arena_ranges == ()
    assert arena.pins(engine.kv_version, broken_prompt.blocks[0]) is None  # chunk 4 never placed
    assert arena.pins(engine.kv_version, broken_prompt.blocks[1]) == 1  # chunk 1: request 0 of the two running
    assert arena.pinned_chunks == 3 and store.gpu.pinned_bytes == 0  # chunks 0, 1, 2 of the two running, resident

    def failing_step(*_: object) -> torch.Tensor:
        raise RuntimeError("the device fell over")

    assert scheduler.shared is not None
    scheduler.shared.decoder.step = failing_step  # type: ignore[method-assign]
    drain(scheduler)
    assert all(r.result.finish_reason == "error" for r in again.requests)
    assert store.gpu.pinned_bytes == 0
    assert_nothing_pinned(scheduler)


@pytest.mark.parametrize("refused_by", ["room check", "acquire"])
def test_a_request_whose_chunks_do_not_fit_the_arena_now_waits_then_runs(
    get_engine: Callable[[str, str], StitchEngine], store: KVStore, refused_by: str
) -> None:
    """An arena holding chunks 0, 1, 2 and no more: a request reading chunks 3 and 4 waits at the head of the line
    (and a request behind it too: first come, first served) while the first runs, then runs as on the copy path.
    Refused by the room check, it fetched nothing; refused by `acquire` itself (the check passed, as it may where
    the arena is fragmented), its slab and its device-tier pins were given back and its KV dropped."""
    engine = get_engine("qwen2", "cpu")
    asks = (Ask((0, 1, 2), max_new=6, seed=1), Ask((3, 4), max_new=5, seed=2), Ask((0,), max_new=4, seed=3))
    want = copy_path(engine, asks)
    arena = nan_arena(engine, sum(block_sizes(engine)[:3]))
    scheduler = Scheduler(engine, nan_pool(engine, 2000), max_batch=8, kv_source=StoreChunks(store), arena=arena)
    assert scheduler.shared is not None
    refusals: list[BatchRequest] = []
    if refused_by == "acquire":
        scheduler.shared.may_fit = lambda request: True  # type: ignore[method-assign]
        place = scheduler.shared.place

        def counted_place(request: BatchRequest, missing: Sequence[int]) -> None:
            try:
                place(request, missing)
            except ArenaFullError:
                refusals.append(request)
                raise

        scheduler.shared.place = counted_place  # type: ignore[method-assign]
    run = Run(engine, asks)
    for request in run.requests:
        scheduler.add(request)
    scheduler.step()
    pinned = store.gpu.pinned_bytes
    assert list(scheduler.running) == run.requests[:1] and pinned > 0
    assert list(scheduler.waiting) == run.requests[1:] and run.requests[1].slab is None
    assert run.requests[1].chunk_kv is None and run.requests[1].fetch is None
    assert scheduler.pool.used_slots == run.requests[0].slab_tokens  # the waiting request holds no slab
    assert arena.pinned_chunks == 3
    scheduler.step()
    assert store.gpu.pinned_bytes == pinned  # only the running request's blocks, however often the other tried
    assert refusals == ([run.requests[1]] * 2 if refused_by == "acquire" else [])
    drain(scheduler)
    assert run.outcomes() == want
    assert arena.evictions >= 2 and store.gpu.pinned_bytes == 0
    assert_nothing_pinned(scheduler)


def test_requests_the_arena_cannot_serve_keep_the_copy_path(get_engine: Callable[[str, str], StitchEngine]) -> None:
    """Chunks larger than the whole arena, naive requests and recompute keep their whole context in their slab
    (no arena range); the tokens are still the copy path's."""
    engine = get_engine("qwen2", "cpu")
    asks = (
        Ask((0, 1, 2), max_new=5, seed=1),
        Ask((3,), max_new=5, seed=2),
        Ask((4,), mode="naive", max_new=4),
        Ask((3,), max_new=6, seed=4, recompute="prefix:4"),
    )
    want = copy_path(engine, asks)
    arena = nan_arena(engine, block_sizes(engine)[3])  # holds chunk 3 only
    scheduler = Scheduler(engine, nan_pool(engine, 2000), max_batch=8, arena=arena)
    run = Run(engine, asks)
    for request in run.requests:
        scheduler.add(request)
    assert [r.tail_tokens is not None for r in run.requests] == [False, True, False, False]
    scheduler.step()
    assert not run.requests[0].reads and run.requests[1].reads and not run.requests[3].reads
    assert run.requests[3].slab is not None and run.requests[3].slab.size == run.requests[3].tokens_needed
    drain(scheduler)
    assert run.outcomes() == want
    assert run.requests[3].result.recomputed_tokens > 0
    assert_nothing_pinned(scheduler)


def test_the_setting_is_validated_and_the_arena_sized_from_the_pool(
    get_engine: Callable[[str, str], StitchEngine],
) -> None:
    """`shared_chunks` is auto unless set (on, off; anything else refused); where the shared path serves, the arena
    is `shared_arena_mb`, or else half of the pool's budget with the pool keeping the other half; off, no arena and
    the whole pool."""
    engine = get_engine("qwen2", "cpu")
    assert Settings().shared_chunks == "auto"
    with pytest.raises(ValidationError):
        Settings(shared_chunks="maybe")
    assert open_arena(Settings(shared_chunks="off"), engine, 64) == (64, None)
    pool_mib, arena = open_arena(Settings(shared_chunks="on"), engine, 64)
    assert pool_mib == 32 and arena is not None and arena.base == engine.chunk_start
    assert arena.slots == (32 * MIB) // engine.spec.kv_bytes_per_token()
    pool_mib, arena = open_arena(Settings(shared_chunks="on", shared_arena_mb=8), engine, 64)
    assert pool_mib == 64 and arena is not None and arena.slots == (8 * MIB) // engine.spec.kv_bytes_per_token()


def test_a_context_temperature_gives_the_copy_paths_tokens_in_both_kinds_of_rows(
    get_engine: Callable[[str, str], StitchEngine],
) -> None:
    """APE's temperature: shared rows scale their chunks' scores in the attention, copy-path rows (naive here, its
    slab its whole context) are left as they are; every request's tokens are the copy path's under the same T."""
    engine = get_engine("qwen2", "cpu")
    asks = ASKS[:4]
    engine.context_temperature = 0.6
    try:
        want = copy_path(engine, asks)
        scheduler = Scheduler(engine, nan_pool(engine, 2000), max_batch=8, arena=nan_arena(engine, 400))
        run = Run(engine, asks)
        for request in run.requests:
            scheduler.add(request)
        drain(scheduler)
    finally:
        engine.context_temperature = 1.0
    assert run.outcomes() == want
    assert [r.tail_tokens is not None for r in run.requests] == [True, True, True, False]
    assert want[:3] != copy_path(engine, asks[:3])  # the temperature changed the turbo answers
    assert_nothing_pinned(scheduler)


def test_the_arena_stats_count_answers_readers_waits_and_evictions(
    get_engine: Callable[[str, str], StitchEngine],
) -> None:
    """What the metrics and /readyz read (`SharedChunks.stats`): an arena holding chunks 0, 1, 2 and no more; the
    request reading chunks 3 and 4 waits (once counted, however many steps it waits), then runs after evicting
    two of them; the copy-path request (naive) is no shared answer."""
    engine = get_engine("qwen2", "cpu")
    sizes = block_sizes(engine)
    asks = (
        Ask((0, 1, 2), max_new=6, seed=1),
        Ask((3, 4), max_new=5, seed=2),
        Ask((0,), max_new=4, seed=3),
        Ask((1,), mode="naive", max_new=3, seed=4),
    )
    arena = nan_arena(engine, sum(sizes[:3]))
    scheduler = Scheduler(engine, nan_pool(engine, 2000), max_batch=8, arena=arena)
    assert scheduler.shared is not None
    before = scheduler.shared.stats()
    assert (before.used_bytes, before.chunks, before.answers, before.waited, before.readers) == (0, 0, 0, 0, 0)
    assert before.capacity_bytes == arena.slots * engine.spec.kv_bytes_per_token()
    run = Run(engine, asks)
    for request in run.requests:
        scheduler.add(request)
    scheduler.step()
    scheduler.step()
    during = scheduler.shared.stats()
    assert (during.answers, during.readers, during.waited) == (1, 1, 0)  # the first runs, the second waits
    assert (during.chunks, during.pinned_chunks) == (3, 3)
    assert during.used_bytes == sum(sizes[:3]) * engine.spec.kv_bytes_per_token() == during.capacity_bytes
    drain(scheduler)
    after = scheduler.shared.stats()
    assert after.answers == 3 and after.waited == 1 and after.readers == 0 and after.pinned_chunks == 0
    assert after.evictions == arena.evictions >= 2 and after.chunks == arena.chunks
    assert after.used_bytes == arena.used_slots * engine.spec.kv_bytes_per_token()
    assert_nothing_pinned(scheduler)
