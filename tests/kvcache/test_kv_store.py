"""The tiered store with a real (tiny) engine: every tier gives the same answer, damage is a counted miss."""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from kv_support import FakeEvent, IndexOpener, bits

from service.engine.engine import StitchEngine
from service.engine.gate import synthetic_ids
from service.engine.kv_layout import KVBlock
from service.engine.offline import generate
from service.engine.prompt import PromptIds
from service.engine.sampling import SamplingParams
from service.kvcache import device, fileformat, tiers
from service.kvcache import store as store_module
from service.kvcache.fileformat import block_relpath, read_block, read_header, write_block
from service.kvcache.index import KVIndex
from service.kvcache.precompute import precompute_batches
from service.kvcache.store import KVStore, TierBudgets
from service.kvcache.tiers import Tier
from service.serving.kv_source import kv_store_for
from service.serving.runtime import open_store
from service.settings import Settings

EngineFactory = Callable[..., StitchEngine]
CHUNK_LENGTHS = (23, 9, 31, 14)
MIB = 1 << 20


@pytest.fixture
def engine(get_engine: EngineFactory) -> StitchEngine:
    return get_engine("qwen2", "cpu")


@pytest.fixture
def prompt(engine: StitchEngine) -> PromptIds:
    chunks = synthetic_ids(engine, CHUNK_LENGTHS, seed=5)
    return engine.template.prompt(chunks, synthetic_ids(engine, [8], seed=6)[0])


@pytest.fixture
def fresh(engine: StitchEngine, prompt: PromptIds) -> list[KVBlock]:
    """The blocks computed directly, in the same single batch the store computes its misses in."""
    return engine.precompute(prompt.blocks)


@pytest.fixture
def index(index_opener: IndexOpener) -> KVIndex:
    return index_opener()


class Stores:
    """Opens stores over one cache dir and closes them all at the end."""

    def __init__(self, engine: StitchEngine, cache_dir: Path) -> None:
        self.engine = engine
        self.cache_dir = cache_dir
        self.opened: list[KVStore] = []

    def open(self, index: KVIndex, gpu: int = 0, host: int = MIB, disk: int = 64 * MIB, **options: Any) -> KVStore:
        budgets = TierBudgets(gpu, host, disk)
        self.opened.append(kv_store_for(self.engine, self.cache_dir, index, budgets, **options))
        return self.opened[-1]


@pytest.fixture
def stores(engine: StitchEngine, tmp_path: Path, index_opener: IndexOpener) -> Iterator[Stores]:
    """Depends on `index_opener` so the stores close (and finish their background writes) before the index
    is closed and its Redis prefix deleted."""
    made = Stores(engine, tmp_path / "cache")
    yield made
    for store in made.opened:
        store.close()


def logits(engine: StitchEngine, blocks: Sequence[KVBlock], prompt: PromptIds) -> torch.Tensor:
    return engine.prefill_stitched(blocks, prompt.question, all_logits=True)[1]


def counts(**nonzero: int) -> dict[Tier, int]:
    return {tier: nonzero.get(tier.value, 0) for tier in Tier}


def block_files(cache_dir: Path) -> list[Path]:
    return sorted(cache_dir.rglob("*.kvblock"))


# ---- every tier gives the same answer ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("gpu", "host", "second"),
    [(MIB, MIB, Tier.GPU), (0, MIB, Tier.HOST)],
    ids=["gpu-tier", "host-tier"],
)
def test_miss_then_memory_hit_then_disk_after_restart(
    engine: StitchEngine,
    prompt: PromptIds,
    fresh: list[KVBlock],
    stores: Stores,
    index: KVIndex,
    index_opener: IndexOpener,
    gpu: int,
    host: int,
    second: Tier,
) -> None:
    n = len(prompt.blocks)
    expected = logits(engine, fresh, prompt)
    store = stores.open(index, gpu=gpu, host=host)

    first = store.fetch(prompt.blocks)
    assert first.counts == counts(miss=n) and first.corrupt == 0
    assert first.timings.precompute_ms > 0
    store.flush()
    again = store.fetch(prompt.blocks)
    store.close()
    index.close()
    restarted = stores.open(index_opener(), gpu=gpu, host=host)  # new store, index reopened, same dir
    assert restarted.plan(prompt.blocks).counts() == counts(disk=n)
    from_disk = restarted.fetch(prompt.blocks)

    assert again.counts == counts(**{second.value: n}) and again.timings.precompute_ms == 0
    assert from_disk.counts == counts(disk=n) and from_disk.corrupt == 0
    assert from_disk.timings.load_ms > 0
    kv_bytes = sum(len(b) for b in prompt.blocks) * engine.spec.kv_bytes_per_token()
    assert from_disk.bytes_loaded == {**dict.fromkeys(Tier, 0), Tier.DISK: kv_bytes}
    for result in (first, again, from_disk):
        assert [b.token_ids for b in result.blocks] == list(prompt.blocks)
        for got, want in zip(result.blocks, fresh, strict=True):
            assert torch.equal(bits(got.kv), bits(want.kv))
        assert torch.equal(logits(engine, result.blocks, prompt), expected)  # bit for bit


def test_the_scheduler_accepts_fetched_blocks(
    engine: StitchEngine, prompt: PromptIds, stores: Stores, index: KVIndex
) -> None:
    store = stores.open(index)
    sampling = SamplingParams(max_new_tokens=6, ignore_eos=True)
    baseline = generate(engine, prompt, sampling)
    fetched = store.fetch(prompt.blocks)
    cached = generate(engine, prompt, sampling, chunk_kv=fetched.blocks)
    assert cached.token_ids == baseline.token_ids


def test_misses_are_computed_in_one_batch_and_repeats_loaded_once(
    engine: StitchEngine, prompt: PromptIds, stores: Stores, index: KVIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    original = engine.precompute

    def counting(blocks: Sequence[Sequence[int]]) -> list[KVBlock]:
        calls.append(len(blocks))
        return original(blocks)

    monkeypatch.setattr(engine, "precompute", counting)
    store = stores.open(index)
    repeated = (*prompt.blocks, prompt.blocks[0])

    result = store.fetch(repeated)

    assert calls == [len(prompt.blocks)]
    assert result.counts == counts(miss=len(repeated))
    assert result.blocks[0] is result.blocks[-1]
    store.flush()
    assert len(block_files(stores.cache_dir)) == len(prompt.blocks)


def test_a_partial_hit_computes_only_the_new_blocks(
    engine: StitchEngine, prompt: PromptIds, stores: Stores, index: KVIndex
) -> None:
    store = stores.open(index, gpu=0, host=MIB)
    store.fetch(prompt.blocks[:2])
    store.flush()

    result = store.fetch(prompt.blocks)

    assert result.sources == [Tier.HOST, Tier.HOST, Tier.MISS, Tier.MISS]
    stats = store.stats()
    assert stats.hits == {Tier.GPU: 0, Tier.HOST: 2, Tier.DISK: 0}
    assert stats.misses == 4 and stats.corrupt == 0


def test_disk_reads_larger_than_the_host_pool_still_arrive_intact(
    engine: StitchEngine, prompt: PromptIds, fresh: list[KVBlock], stores: Stores, index: KVIndex
) -> None:
    writer = stores.open(index)
    writer.fetch(prompt.blocks)
    writer.flush()
    one_block = max(b.nbytes() for b in fresh) + 4096  # the parallel reads cannot all have a slot at once
    reader = stores.open(index, host=one_block)

    result = reader.fetch(prompt.blocks)

    assert result.counts == counts(disk=len(fresh))
    assert reader.stats().usage[Tier.HOST].used_bytes <= one_block
    for got, want in zip(result.blocks, fresh, strict=True):
        assert torch.equal(bits(got.kv), bits(want.kv))


# ---- damage on disk ----------------------------------------------------------------------------------------


def truncate(path: Path, store: KVStore, block: KVBlock) -> None:
    path.write_bytes(path.read_bytes()[:-100])


def flip_payload_byte(path: Path, store: KVStore, block: KVBlock) -> None:
    header = read_header(path)
    data = bytearray(path.read_bytes())
    data[header.payload_offset + header.payload_bytes // 2] ^= 0x10
    path.write_bytes(bytes(data))


def wrong_fingerprint(path: Path, store: KVStore, block: KVBlock) -> None:
    write_block(path, store.key_of(block.token_ids), "0" * 64, block)


def wrong_shape(path: Path, store: KVStore, block: KVBlock) -> None:
    kv = block.kv[:1].clone()  # one layer too few, otherwise a valid file
    write_block(path, store.key_of(block.token_ids), store.fingerprint, KVBlock(block.token_ids, kv))


@pytest.mark.parametrize("damage", [truncate, flip_payload_byte, wrong_fingerprint, wrong_shape])
def test_damaged_file_is_counted_recomputed_and_rewritten(
    engine: StitchEngine,
    prompt: PromptIds,
    fresh: list[KVBlock],
    stores: Stores,
    index: KVIndex,
    damage: Callable[[Path, KVStore, KVBlock], None],
) -> None:
    writer = stores.open(index)
    writer.fetch(prompt.blocks)
    writer.flush()
    bad = 2
    key = writer.key_of(prompt.blocks[bad])
    path = stores.cache_dir / block_relpath(key)
    damage(path, writer, fresh[bad])

    reader = stores.open(index)  # empty memory tiers: everything comes from disk
    result = reader.fetch(prompt.blocks)

    n = len(prompt.blocks)
    assert result.corrupt == 1 and reader.stats().corrupt == 1
    assert result.counts == counts(disk=n - 1, miss=1)
    assert result.sources[bad] is Tier.MISS
    # The answer is what computing that block afresh gives: bit for bit against the same computation, and
    # within float noise of the batch computed before the damage.
    recomputed = [*fresh[:bad], engine.precompute([prompt.blocks[bad]])[0], *fresh[bad + 1 :]]
    got = logits(engine, result.blocks, prompt)
    assert torch.equal(got, logits(engine, recomputed, prompt))
    assert float((got - logits(engine, fresh, prompt)).abs().max()) <= 1e-4
    reader.flush()
    rewritten = read_block(path, key, reader.fingerprint, engine.spec, expected_token_ids=prompt.blocks[bad])
    assert torch.equal(bits(rewritten.kv), bits(result.blocks[bad].kv))
    assert index.get(key) is not None
    assert stores.open(index).fetch(prompt.blocks).counts == counts(disk=n)


# ---- ingestion ---------------------------------------------------------------------------------------------


def test_the_same_text_put_twice_is_stored_once(
    engine: StitchEngine, prompt: PromptIds, fresh: list[KVBlock], stores: Stores, index: KVIndex
) -> None:
    store = stores.open(index)
    block = fresh[0]

    first = store.put([block])
    path = stores.cache_dir / block_relpath(store.key_of(block.token_ids))
    written_at = path.stat().st_mtime_ns
    second = store.put([KVBlock(tuple(block.token_ids), block.kv.clone())])

    assert first == path.stat().st_size and second == 0
    assert block_files(stores.cache_dir) == [path] and path.stat().st_mtime_ns == written_at
    assert index.keys() == [store.key_of(block.token_ids)]
    assert store.fetch(prompt.blocks[:1]).counts == counts(disk=1)


def test_put_refuses_a_block_of_another_shape(fresh: list[KVBlock], stores: Stores, index: KVIndex) -> None:
    store = stores.open(index)
    with pytest.raises(ValueError, match="shape"):
        store.put([KVBlock(fresh[0].token_ids, fresh[0].kv[:1])])
    assert index.keys() == []


# ---- budgets -----------------------------------------------------------------------------------------------


def test_every_tier_stays_within_its_budget(
    engine: StitchEngine, prompt: PromptIds, fresh: list[KVBlock], stores: Stores, index: KVIndex
) -> None:
    sizes = sorted(b.nbytes() for b in fresh)
    gpu_budget = sizes[-1] + sizes[-2]  # the two largest blocks
    host_budget = sizes[-1] + sizes[0] + 8192  # rounds each block up to 4 KiB pages
    store = stores.open(index, gpu=gpu_budget, host=host_budget, disk=2 * MIB)

    for _ in range(2):
        result = store.fetch(prompt.blocks)
        store.flush()
        usage = store.stats().usage
        assert usage[Tier.GPU].used_bytes <= gpu_budget
        assert usage[Tier.HOST].used_bytes <= usage[Tier.HOST].budget_bytes <= host_budget
        assert torch.equal(logits(engine, result.blocks, prompt), logits(engine, fresh, prompt))

    stats = store.stats()
    gpu_blocks = stats.usage[Tier.GPU].blocks
    assert gpu_blocks is not None and 0 < gpu_blocks < len(fresh)
    assert stats.evictions[Tier.GPU] > 0
    assert stats.usage[Tier.DISK].used_bytes == index.total_bytes() > 0


def test_disk_budget_holds_after_many_puts(
    engine: StitchEngine, fresh: list[KVBlock], stores: Stores, index: KVIndex
) -> None:
    more = engine.precompute(synthetic_ids(engine, [17] * 6, seed=9))
    budget = 3 * (more[0].nbytes() + 8192)
    store = stores.open(index, disk=budget)

    for block in [*fresh, *more]:
        store.put([block])
        assert index.total_bytes() <= budget

    on_disk = block_files(stores.cache_dir)
    assert 0 < len(on_disk) == len(index.keys()) < len(fresh) + len(more)
    assert sum(p.stat().st_size for p in on_disk) == index.total_bytes() <= budget
    assert store.stats().evictions[Tier.DISK] > 0


def test_store_computes_misses_through_the_callable_it_was_given(
    engine: StitchEngine, prompt: PromptIds, stores: Stores, index: KVIndex
) -> None:
    """The store holds no engine: misses go to its precompute callable (the engine loop's, in the runtime)."""
    calls: list[int] = []

    def precompute(blocks: Sequence[Sequence[int]]) -> list[KVBlock]:
        calls.append(len(blocks))
        return engine.precompute(blocks)

    store = stores.open(index, precompute=precompute)
    result = store.fetch(prompt.blocks)
    assert calls == [len(prompt.blocks)]
    assert result.counts == counts(miss=len(prompt.blocks))
    fresh = engine.precompute(prompt.blocks)
    assert all(torch.equal(a.kv, b.kv) for a, b in zip(result.blocks, fresh, strict=True))


def test_contains_and_remove_cover_every_tier(
    engine: StitchEngine, prompt: PromptIds, stores: Stores, index: KVIndex
) -> None:
    store = stores.open(index)
    store.fetch(prompt.blocks)
    store.flush()
    key = store.key_of(prompt.blocks[0])
    assert store.contains(key)
    store.remove(key)
    assert not store.contains(key)
    assert store.plan(prompt.blocks[:1]).counts() == counts(miss=1)  # gone from the memory tiers too


def test_a_pinned_fetch_holds_its_device_blocks_in_place_until_released(
    engine: StitchEngine, prompt: PromptIds, fresh: list[KVBlock], stores: Stores, index: KVIndex
) -> None:
    sizes = [b.nbytes() for b in fresh]
    store = stores.open(index, gpu=sum(sizes))  # room for exactly this prompt's blocks
    result = store.fetch(prompt.blocks, pin=True)
    keys = [store.key_of(b) for b in prompt.blocks]
    assert result.pinned == keys
    assert all(store.gpu.pins(k) == 1 for k in keys)
    # Another prompt's blocks cannot push the pinned ones out: they are handed back instead.
    others = engine.template.prompt(synthetic_ids(engine, [40, 12], seed=9), [5])
    second = store.fetch(others.blocks)
    assert all(store.gpu.peek(k) is b for k, b in zip(keys, result.blocks, strict=True))
    assert not any(store.gpu.peek(store.key_of(b)) is not None for b in others.blocks)
    assert second.pinned == []
    store.release(result)
    store.release(result)  # once only
    assert result.pinned == [] and all(store.gpu.pins(k) == 0 for k in keys)
    store.fetch(others.blocks)  # now they make room
    assert sum(store.gpu.peek(k) is not None for k in keys) < len(keys)


# ---- per-block arrival: the stitch overlaps the copies -----------------------------------------------------


class CopySpy:
    """CUDA copy events faked on the CPU: every copy to the device gets a pending `FakeEvent`, and every
    device-side wait is recorded with the number of blocks the stitcher had rotated and placed by then."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, engine: StitchEngine) -> None:
        self.events: list[FakeEvent] = []
        self.waits: list[tuple[str, int]] = []
        self.placed = 0
        real_copy, rotary = device.copy_to_device, engine.forward.rotary
        real_rotate = rotary.rotate

        def copy(host: torch.Tensor, target: torch.device, stream: Any) -> tuple[torch.Tensor, FakeEvent]:
            self.events.append(FakeEvent(f"copy{len(self.events)}"))
            return real_copy(host, target, stream)[0], self.events[-1]

        def wait_on(event: FakeEvent | None, target: torch.device) -> None:
            if event is not None:
                self.waits.append((event.name, self.placed))

        def rotate(x: torch.Tensor, positions: torch.Tensor, factor: float = 1.0) -> torch.Tensor:
            self.placed += 1
            return real_rotate(x, positions, factor)

        monkeypatch.setattr(device, "copy_to_device", copy)
        monkeypatch.setattr(device, "wait_on", wait_on)
        monkeypatch.setattr(rotary, "rotate", rotate)


def arrival_names(result: Any) -> list[str | None]:
    return [None if a is None else a.event.name for a in result.ready]


def test_an_overlapped_fetch_leaves_each_wait_to_the_stitch_just_before_its_block(
    engine: StitchEngine,
    prompt: PromptIds,
    fresh: list[KVBlock],
    stores: Stores,
    index: KVIndex,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    n = len(prompt.blocks)
    store = stores.open(index, gpu=0, host=MIB)
    store.fetch(prompt.blocks)  # misses, kept in the host pool
    spy = CopySpy(monkeypatch, engine)

    result = store.fetch(prompt.blocks, overlap=True)

    assert result.counts == counts(host=n)
    assert arrival_names(result) == [f"copy{i}" for i in range(n)]
    assert all(a is not None and a.device == engine.spec.device for a in result.ready)
    assert spy.waits == []  # nothing waited for yet: the copies may still be running
    _, got, _ = engine.prefill_stitched(result.blocks, prompt.question, all_logits=True, chunk_ready=result.ready)
    # Block i (after the prefix) is waited for once the prefix and the i blocks before it were placed.
    assert spy.waits == [(f"copy{i}", i + 1) for i in range(n)]
    assert torch.equal(got, logits(engine, fresh, prompt))


def test_a_plain_fetch_orders_the_stream_after_every_copy_before_returning(
    engine: StitchEngine, prompt: PromptIds, stores: Stores, index: KVIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = len(prompt.blocks)
    store = stores.open(index, gpu=0, host=MIB)
    store.fetch(prompt.blocks)
    spy = CopySpy(monkeypatch, engine)

    result = store.fetch(prompt.blocks)

    assert spy.waits == [(f"copy{i}", 0) for i in range(n)]  # all before anything was placed
    assert arrival_names(result) == [f"copy{i}" for i in range(n)]  # still reported: waiting again is harmless


def test_a_device_hit_waits_for_its_copy_until_that_completed(
    engine: StitchEngine, prompt: PromptIds, stores: Stores, index: KVIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = len(prompt.blocks)
    writer = stores.open(index)
    writer.fetch(prompt.blocks)
    writer.flush()
    store = stores.open(index, gpu=MIB, host=MIB)
    spy = CopySpy(monkeypatch, engine)

    from_disk = store.fetch(prompt.blocks, overlap=True)
    in_flight = store.fetch(prompt.blocks, overlap=True)
    for event in spy.events:
        event.done = True
    landed = store.fetch(prompt.blocks, overlap=True)

    assert from_disk.counts == counts(disk=n) and len(spy.events) == n
    assert in_flight.counts == landed.counts == counts(gpu=n)
    assert arrival_names(in_flight) == arrival_names(from_disk)  # the same copy events, block by block
    assert sorted(name for name in arrival_names(from_disk) if name) == sorted(e.name for e in spy.events)
    assert landed.ready == [None] * n


def test_on_cpu_nothing_waits_and_overlap_gives_the_same_blocks(
    engine: StitchEngine, prompt: PromptIds, fresh: list[KVBlock], stores: Stores, index: KVIndex
) -> None:
    n = len(prompt.blocks)
    store = stores.open(index, gpu=0, host=MIB)

    computed = store.fetch(prompt.blocks, overlap=True)
    copied = store.fetch(prompt.blocks, overlap=True)

    assert computed.ready == copied.ready == [None] * n
    assert computed.timings.h2d_ms == 0 and copied.timings.h2d_ms > 0  # host copies timed by the wall clock
    for result in (computed, copied):
        for got, want in zip(result.blocks, fresh, strict=True):
            assert torch.equal(bits(got.kv), bits(want.kv))
    sampling = SamplingParams(max_new_tokens=5, ignore_eos=True)
    baseline = generate(engine, prompt, sampling)
    cached = generate(engine, prompt, sampling, chunk_kv=copied.blocks, chunk_ready=copied.ready)
    assert cached.token_ids == baseline.token_ids


# ---- batched precompute of misses under a token cap --------------------------------------------------------


def test_precompute_batches_pack_longest_first_under_the_cap() -> None:
    lengths = [10, 40, 12, 39, 5, 41, 100]

    batches = precompute_batches(lengths, 90)

    assert batches == [[6], [1, 5], [2, 3], [0, 4]]  # 100 alone (over the cap); 2 x 41, 2 x 39, 2 x 10
    assert sorted(i for batch in batches for i in batch) == list(range(len(lengths)))
    assert precompute_batches([30, 10, 20], 90) == [[0, 1, 2]]  # 3 x 30 fits: one batch, request order
    assert precompute_batches([], 90) == []


@pytest.mark.parametrize("cap", ["two-longest", "below-every-block"])
def test_many_misses_are_computed_in_batches_under_the_cap(
    engine: StitchEngine, stores: Stores, index: KVIndex, monkeypatch: pytest.MonkeyPatch, cap: str
) -> None:
    chunks = synthetic_ids(engine, [30, 7, 22, 15, 30, 9, 26, 12, 18, 5], seed=13)
    blocks = list(engine.template.prompt(chunks, [1, 2]).blocks)
    longest = max(len(b) for b in blocks)
    max_tokens = 2 * longest + 1 if cap == "two-longest" else min(len(b) for b in blocks) - 1
    calls: list[list[tuple[int, ...]]] = []
    original = engine.precompute

    def recording(batch: Sequence[Sequence[int]]) -> list[KVBlock]:
        calls.append([tuple(b) for b in batch])
        return original(batch)

    monkeypatch.setattr(engine, "precompute", recording)
    store = stores.open(index, max_precompute_tokens=max_tokens)

    result = store.fetch(blocks)

    assert result.counts == counts(miss=len(blocks))
    assert sorted(ids for call in calls for ids in call) == sorted(blocks)  # each computed once
    if cap == "two-longest":
        assert 1 < len(calls) < len(blocks)
        assert all(len(call) * max(map(len, call)) <= max_tokens for call in calls)
    else:
        assert [len(call) for call in calls] == [1] * len(blocks)  # over the cap alone: still computed
    # Bit for bit what the same batches give, and within float noise of one batch of everything.
    batched = {block.token_ids: block for call in calls for block in original(call)}
    at_once = original(blocks)
    for got, alone in zip(result.blocks, at_once, strict=True):
        assert torch.equal(bits(got.kv), bits(batched[got.token_ids].kv))
        assert float((got.kv - alone.kv).abs().max()) <= 1e-5


def test_the_precompute_cap_must_be_positive(engine: StitchEngine, stores: Stores, index: KVIndex) -> None:
    with pytest.raises(ValueError, match="max_precompute_tokens"):
        stores.open(index, max_precompute_tokens=0)


# ---- O_DIRECT through the store ----------------------------------------------------------------------------


def test_disk_hits_are_read_with_o_direct_into_the_host_pool(
    engine: StitchEngine, prompt: PromptIds, fresh: list[KVBlock], stores: Stores, index: KVIndex
) -> None:
    n = len(prompt.blocks)
    writer = stores.open(index)
    writer.fetch(prompt.blocks)
    writer.flush()
    direct, buffered = stores.open(index, direct_io=True), stores.open(index)

    results = [direct.fetch(prompt.blocks), buffered.fetch(prompt.blocks)]

    reads = direct.disk.direct
    assert reads is not None and buffered.disk.direct is None
    if reads.refused():
        pytest.skip(f"the test filesystem refuses O_DIRECT in {reads.refused()}")
    assert reads.reads == n
    for result in results:
        assert result.counts == counts(disk=n)
        for got, want in zip(result.blocks, fresh, strict=True):
            assert torch.equal(bits(got.kv), bits(want.kv))


# ---- a disk that frees itself (issue 15) -------------------------------------------------------------------


def test_a_lower_disk_budget_at_restart_is_applied_at_start(
    engine: StitchEngine, stores: Stores, index: KVIndex, tmp_path: Path
) -> None:
    blocks = engine.precompute(synthetic_ids(engine, [300] * 16, seed=21))
    assert sum(b.nbytes() for b in blocks) > 2 * MIB  # more than the lower budget below
    first = stores.open(index, disk=64 * MIB)
    first.put(blocks)
    first.close()
    assert index.total_bytes() > MIB

    settings = Settings(model="unused", data_dir=tmp_path / "data", cache_dir=stores.cache_dir, disk_cache_mb=1)
    restarted = open_store(settings, engine, index, engine.precompute)
    stores.opened.append(restarted)

    on_disk = block_files(stores.cache_dir)
    assert index.total_bytes() <= MIB  # trimmed before any write
    assert 0 < len(on_disk) == len(index.keys()) < len(blocks)
    assert sum(p.stat().st_size for p in on_disk) == index.total_bytes()
    assert restarted.stats().evictions[Tier.DISK] == len(blocks) - len(on_disk)


def test_a_full_budget_makes_room_before_writing(
    engine: StitchEngine, stores: Stores, index: KVIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocks = engine.precompute(synthetic_ids(engine, [40] * 5, seed=23))
    budget = 3 * (blocks[0].nbytes() + 8192)
    store = stores.open(index, disk=budget)
    store.put(blocks[:3])
    peak = 0
    real_write = fileformat.write_block

    def measured(*args: Any, **kwargs: Any) -> int:
        nonlocal peak  # what the tier holds while the new file is being written
        peak = max(peak, index.total_bytes() + blocks[0].nbytes())
        return real_write(*args, **kwargs)

    monkeypatch.setattr(tiers, "write_block", measured)
    store.put(blocks[3:])

    assert peak <= budget  # evicted first: the disk never holds more than the budget, even mid-write
    assert store.contains(store.key_of(blocks[4].token_ids))


class _NoSpaceAfter:
    """Makes one step of a block write fail with ENOSPC, as a full disk does part-way through a file."""

    def __init__(self, real: Callable[..., Any]) -> None:
        self.real = real
        self.armed = True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.armed:
            self.armed = False
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.real(*args, **kwargs)


@pytest.mark.parametrize("step", ["fsync", "directory fsync"])
def test_a_write_failing_with_enospc_leaves_nothing_is_counted_and_later_writes_succeed(
    engine: StitchEngine,
    stores: Stores,
    index: KVIndex,
    monkeypatch: pytest.MonkeyPatch,
    step: str,
) -> None:
    blocks = engine.precompute(synthetic_ids(engine, [40, 41], seed=25))
    store = stores.open(index)
    failing = _NoSpaceAfter(os.fsync if step == "fsync" else fileformat._fsync_dir)
    if step == "fsync":  # mid-file: the temp file holds part of the block
        monkeypatch.setattr(fileformat.os, "fsync", failing)
    else:  # after the rename: the file is in place but not yet listed in the index
        monkeypatch.setattr(fileformat, "_fsync_dir", failing)

    with pytest.raises(OSError, match="No space left"):
        store.put(blocks[:1])

    assert list(stores.cache_dir.rglob("*")) == [p for p in stores.cache_dir.rglob("*") if p.is_dir()]  # no file
    assert index.keys() == [] and index.total_bytes() == 0
    assert store.stats().write_errors == {"index": 0, "disk": 0, "no_space": 1, "other": 0}

    assert store.put(blocks) > 0  # the next writes go through
    assert sorted(index.keys()) == sorted(store.key_of(b.token_ids) for b in blocks)
    assert len(block_files(stores.cache_dir)) == 2


def test_a_background_write_failing_with_enospc_is_counted_as_no_space(
    engine: StitchEngine, prompt: PromptIds, stores: Stores, index: KVIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = stores.open(index)
    monkeypatch.setattr(fileformat.os, "fsync", _NoSpaceAfter(os.fsync))
    store.fetch(prompt.blocks)  # misses: computed, then written in the background; the first write fails
    store.flush()

    assert store.stats().write_errors["no_space"] == 1
    assert len(block_files(stores.cache_dir)) == len(index.keys()) == len(prompt.blocks) - 1
    assert not [p for p in stores.cache_dir.rglob("*") if p.is_file() and p.suffix != ".kvblock"]  # no temp file


# ---- reading ahead -----------------------------------------------------------------------------------------


def stored(stores: Stores, index: KVIndex, prompt: PromptIds) -> KVStore:
    """A store that computed the prompt's blocks and wrote them to disk (all written before it returns)."""
    writer = stores.open(index)
    writer.fetch(prompt.blocks)
    writer.flush()
    return writer


def test_blocks_read_ahead_are_fetched_as_host_hits_with_the_same_bits(
    prompt: PromptIds, fresh: list[KVBlock], stores: Stores, index: KVIndex
) -> None:
    """`prefetch` reads the disk-only blocks into the host tier in the background; the fetch then copies them
    from there (no disk read on the caller's thread) and they hold the same bits as read from disk."""
    stored(stores, index, prompt)
    reader = stores.open(index, host=4 * MIB)
    n = len(prompt.blocks)
    assert reader.prefetch(prompt.blocks) == n
    assert reader.prefetch(prompt.blocks) == 0  # already on their way: not read twice
    result = reader.fetch(prompt.blocks)
    assert result.counts == counts(host=n) and reader.prefetched == n and reader.stats().read_ahead == n
    for got, want in zip(result.blocks, fresh, strict=True):
        assert torch.equal(bits(got.kv), bits(want.kv))
    assert reader.prefetch(prompt.blocks) == 0  # the host tier holds them now


def test_a_fetch_waits_for_a_read_ahead_still_running(
    prompt: PromptIds, fresh: list[KVBlock], stores: Stores, index: KVIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fetch that finds its blocks still being read ahead waits for those reads (a host hit once they land)
    rather than reading the same files again into the same slots."""
    stored(stores, index, prompt)
    reader = stores.open(index, host=4 * MIB)
    gate = threading.Event()
    reads: list[str] = []
    real_read = reader.disk.read

    def slow_read(key: str, *args: Any, **kwargs: Any) -> Any:
        reads.append(key)
        gate.wait(timeout=10)
        return real_read(key, *args, **kwargs)

    monkeypatch.setattr(reader.disk, "read", slow_read)
    assert reader.prefetch(prompt.blocks) == len(prompt.blocks)
    threading.Timer(0.2, gate.set).start()
    result = reader.fetch(prompt.blocks)
    assert result.counts == counts(host=len(prompt.blocks))
    assert sorted(reads) == sorted(reader.key_of(b) for b in prompt.blocks)  # each file read once
    for got, want in zip(result.blocks, fresh, strict=True):
        assert torch.equal(bits(got.kv), bits(want.kv))


def test_a_damaged_block_read_ahead_is_counted_and_recomputed(
    engine: StitchEngine, prompt: PromptIds, fresh: list[KVBlock], stores: Stores, index: KVIndex
) -> None:
    writer = stored(stores, index, prompt)
    bad = 1
    path = stores.cache_dir / block_relpath(writer.key_of(prompt.blocks[bad]))
    truncate(path, writer, fresh[bad])
    reader = stores.open(index, host=4 * MIB)
    assert reader.prefetch(prompt.blocks) == len(prompt.blocks)
    result = reader.fetch(prompt.blocks)
    n = len(prompt.blocks)
    # The read ahead found the damage (the disk tier deleted the file) and counted it; the fetch computed it.
    assert result.counts == counts(host=n - 1, miss=1) and reader.prefetched == n - 1
    assert reader.stats().corrupt == 1
    recomputed = engine.precompute([prompt.blocks[bad]])[0]
    assert torch.equal(bits(result.blocks[bad].kv), bits(recomputed.kv))
    reader.flush()  # and written again, whole
    key = reader.key_of(prompt.blocks[bad])
    rewritten = read_block(path, key, reader.fingerprint, engine.spec, expected_token_ids=prompt.blocks[bad])
    assert torch.equal(bits(rewritten.kv), bits(recomputed.kv))


def test_reading_ahead_skips_what_is_held_and_what_has_no_room(
    prompt: PromptIds, fresh: list[KVBlock], stores: Stores, index: KVIndex
) -> None:
    """Misses (nothing on disk) and blocks the memory tiers hold are not read; a host tier with room for one
    block reads one ahead and leaves the rest to the fetch, which reads them itself."""
    fresh_store = stores.open(index)
    assert fresh_store.prefetch(prompt.blocks) == 0  # nothing stored yet: all misses
    fresh_store.fetch(prompt.blocks)
    fresh_store.flush()
    assert fresh_store.prefetch(prompt.blocks) == 0  # its host tier holds them all
    small = stores.open(index, host=max(b.nbytes() for b in fresh) + 4096)
    assert small.prefetch(prompt.blocks) == 1
    result = small.fetch(prompt.blocks)
    assert sorted(t.value for t in result.sources) == sorted(["host"] + ["disk"] * (len(fresh) - 1))
    for got, want in zip(result.blocks, fresh, strict=True):
        assert torch.equal(bits(got.kv), bits(want.kv))


def test_removing_a_block_read_ahead_waits_for_its_read(
    prompt: PromptIds, stores: Stores, index: KVIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`remove` never frees a host slot a reader thread is still writing into: it waits for the read first."""
    stored(stores, index, prompt)
    reader = stores.open(index, host=4 * MIB)
    gate, done = threading.Event(), threading.Event()
    real_read = reader.disk.read

    def slow_read(*args: Any, **kwargs: Any) -> Any:
        gate.wait(timeout=10)
        block = real_read(*args, **kwargs)
        done.set()
        return block

    monkeypatch.setattr(reader.disk, "read", slow_read)
    assert reader.prefetch(prompt.blocks[:1]) == 1
    threading.Timer(0.2, gate.set).start()
    reader.remove(reader.key_of(prompt.blocks[0]))
    assert done.is_set() and not reader.contains(reader.key_of(prompt.blocks[0]))
    assert reader.host.pool.peek(reader.key_of(prompt.blocks[0])) is None


def test_the_read_ahead_queue_is_bounded(
    prompt: PromptIds, stores: Stores, index: KVIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the read-ahead thread is busy, at most READ_AHEAD_QUEUE prompts wait for it; the next ones are not
    read ahead (None), and once the queue drains read aheads are taken again."""
    monkeypatch.setattr(store_module, "READ_AHEAD_QUEUE", 3)
    reader = stores.open(index)
    running, release = threading.Event(), threading.Event()

    def busy_prefetch(blocks: Any) -> int:
        running.set()
        release.wait(timeout=10)
        return len(blocks)

    monkeypatch.setattr(reader, "prefetch", busy_prefetch)
    first = reader.read_ahead(prompt.blocks)
    assert first is not None and running.wait(timeout=10)
    queued = [reader.read_ahead(prompt.blocks) for _ in range(4)]
    assert [q is not None for q in queued] == [True, True, True, False]
    release.set()
    assert [f.result(timeout=10) for f in (first, *queued[:3]) if f is not None] == [len(prompt.blocks)] * 4
    again = reader.read_ahead(prompt.blocks[:1])
    assert again is not None and again.result(timeout=10) == 1
