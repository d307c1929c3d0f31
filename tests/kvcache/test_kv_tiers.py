"""Each tier on its own: device LRU within budget, host copies, disk files + index within budget."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kv_support import BASE_SPEC, BlockFactory, FakeEvent, IndexOpener, bits

from service.engine.kv_layout import KVBlock
from service.kvcache import device
from service.kvcache.fileformat import CorruptBlockError, MissingBlockError, block_relpath
from service.kvcache.host_pool import HostPool
from service.kvcache.index import KVIndex
from service.kvcache.keys import block_key
from service.kvcache.tiers import DiskTier, GpuTier, HostTier, TierChange, TierMove

FP = "d" * 64


def key_of(block: KVBlock) -> str:
    return block_key(FP, "tpl", block.kv.dtype, block.token_ids)


# ---- device tier (exercised with CPU tensors) ---------------------------------------------------------------


def test_gpu_tier_keeps_within_budget_evicting_least_recently_used(make_block: BlockFactory) -> None:
    a, b, c = (make_block(BASE_SPEC, num_tokens=10, seed=s) for s in range(3))
    size = a.nbytes()
    tier = GpuTier(budget_bytes=2 * size + size // 2)

    assert tier.put("a", a) == [] and tier.put("b", b) == []
    assert tier.get("a") is a  # a is now more recent than b
    evicted = tier.put("c", c)

    assert [k for k, _ in evicted] == ["b"] and evicted[0][1] is b
    assert "b" not in tier and tier.get("a") is a and tier.get("c") is c
    assert tier.used_bytes == 2 * size <= tier.budget_bytes
    assert tier.evictions == 1


def test_gpu_tier_hands_back_a_block_over_its_budget(make_block: BlockFactory) -> None:
    block = make_block(BASE_SPEC, num_tokens=10)
    disabled = GpuTier(budget_bytes=0)
    assert disabled.put("a", block) == [("a", block)]
    assert len(disabled) == 0 and disabled.used_bytes == 0


def test_gpu_tier_put_of_a_held_key_only_refreshes_it(make_block: BlockFactory) -> None:
    a, b = make_block(BASE_SPEC, seed=1), make_block(BASE_SPEC, seed=2)
    tier = GpuTier(budget_bytes=2 * a.nbytes())
    tier.put("a", a)
    tier.put("b", b)
    assert tier.put("a", a) == []
    assert tier.used_bytes == 2 * a.nbytes()
    assert [k for k, _ in tier.put("c", make_block(BASE_SPEC, seed=3))] == ["b"]  # a was refreshed


def test_gpu_tier_never_evicts_a_pinned_block(make_block: BlockFactory) -> None:
    a, b, c = (make_block(BASE_SPEC, num_tokens=10, seed=s) for s in range(3))
    size = a.nbytes()
    tier = GpuTier(budget_bytes=2 * size)
    tier.put("a", a)
    tier.put("b", b)
    assert tier.pin("a") is a and tier.pins("a") == 1  # a is the least recently used, and pinned
    evicted = tier.put("c", c)
    assert [k for k, _ in evicted] == ["b"]  # b went instead of a
    assert tier.pin("c") is c and tier.pinned_bytes == 2 * size
    # Everything pinned: a new block is handed back and nothing is evicted for it.
    d = make_block(BASE_SPEC, num_tokens=10, seed=4)
    assert tier.put("d", d) == [("d", d)]
    assert tier.get("a") is a and tier.get("c") is c and tier.used_bytes == 2 * size
    tier.unpin("a")
    assert [k for k, _ in tier.put("d", d)] == ["a"]  # unpinned, a can go again
    assert tier.pin("missing") is None
    with pytest.raises(ValueError, match="not pinned"):
        tier.unpin("a")


def test_a_pinned_block_discarded_keeps_its_bytes_until_the_last_reader_is_done(make_block: BlockFactory) -> None:
    a, b = make_block(BASE_SPEC, num_tokens=10, seed=1), make_block(BASE_SPEC, num_tokens=10, seed=2)
    size = a.nbytes()
    moves: list[TierMove] = []
    tier = GpuTier(budget_bytes=2 * size, listener=moves.append)
    tier.put("a", a)
    tier.pin("a")
    tier.pin("a")  # two readers
    assert tier.discard("a")
    assert [(m.change, m.key) for m in moves] == [(TierChange.ADD, "a"), (TierChange.EVICT, "a")]  # told at once
    assert "a" not in tier and tier.get("a") is None  # no new reader finds it
    assert tier.used_bytes == size  # but its bytes stay counted under its readers
    assert tier.put("a", b) == [("a", b)]  # and its key is not rewritten while they read it
    tier.unpin("a")
    assert tier.used_bytes == size and tier.pinned_bytes == size
    tier.unpin("a")
    assert tier.used_bytes == 0 and tier.pinned_bytes == 0
    assert len(moves) == 2  # the last unpin frees the bytes without telling the eviction twice
    assert tier.put("a", b) == [] and tier.get("a") is b  # after the last reader it can come back


def test_gpu_tier_keeps_a_block_copy_event_until_it_completed(make_block: BlockFactory) -> None:
    a, b = make_block(BASE_SPEC, seed=1), make_block(BASE_SPEC, seed=2)
    tier = GpuTier(budget_bytes=a.nbytes())
    copying = FakeEvent("a")
    tier.put("a", a, arriving=copying)

    assert tier.arrival("a") is copying  # a later hit must still wait for the copy
    copying.done = True
    assert tier.arrival("a") is None
    copying.done = False
    assert tier.arrival("a") is None  # forgotten once seen complete
    tier.put("b", b, arriving=FakeEvent("b"))  # evicts a
    assert tier.arrival("a") is None and "a" not in tier
    assert tier.discard("b") and tier.arrival("b") is None


# ---- host tier ---------------------------------------------------------------------------------------------


def test_host_tier_round_trip_is_bit_exact_and_independent_of_the_pool(make_block: BlockFactory) -> None:
    block = make_block(BASE_SPEC, num_tokens=13, seed=4)
    tier = HostTier(HostPool(1 << 20, pinned=False), torch.device("cpu"), stream=None)

    assert tier.store("k", block)
    slot = tier.get("k")
    assert slot is not None and slot.token_ids == block.token_ids
    back, event = tier.to_device(slot)

    assert event is None
    assert torch.equal(bits(back.kv), bits(block.kv)) and back.token_ids == block.token_ids
    tier.discard("k")
    assert tier.pool.used_bytes == 0
    # The pool's bytes may now be reused; the block handed out must not change with them.
    tier.store("other", make_block(BASE_SPEC, num_tokens=13, seed=5))
    assert torch.equal(bits(back.kv), bits(block.kv))


def test_copy_to_device_on_cpu_is_a_clone_not_a_view() -> None:
    host = torch.arange(12, dtype=torch.float32)
    copied, event = device.copy_to_device(host, torch.device("cpu"), device.new_copy_stream("cpu"))
    assert event is None and torch.equal(copied, host)
    host.zero_()
    assert copied.sum() == 66


# ---- disk tier ---------------------------------------------------------------------------------------------


@pytest.fixture
def index(index_opener: IndexOpener) -> KVIndex:
    return index_opener()


def disk_tier(tmp_path: Path, index: KVIndex, budget: int) -> DiskTier:
    return DiskTier(tmp_path / "cache", index, FP, BASE_SPEC, budget)


def files_in(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "cache").rglob("*.kvblock"))


def test_disk_tier_stores_a_block_once(tmp_path: Path, index: KVIndex, make_block: BlockFactory) -> None:
    tier = disk_tier(tmp_path, index, budget=1 << 20)
    block = make_block(BASE_SPEC, num_tokens=9)
    key = key_of(block)

    size = tier.write(key, block)
    mtime = tier.path_of(key).stat().st_mtime_ns

    assert size > block.nbytes()
    assert tier.write(key, block) == 0
    assert tier.path_of(key).stat().st_mtime_ns == mtime
    assert files_in(tmp_path) == [tmp_path / "cache" / block_relpath(key)]
    assert index.keys() == [key] and index.total_bytes() == size
    loaded = tier.read(key, block.token_ids, into=None)
    assert torch.equal(bits(loaded.kv), bits(block.kv))


def test_disk_tier_evicts_least_recently_used_files_to_stay_in_budget(
    tmp_path: Path, index: KVIndex, make_block: BlockFactory
) -> None:
    blocks = [make_block(BASE_SPEC, num_tokens=20, seed=s) for s in range(6)]
    keys = [key_of(b) for b in blocks]
    probe = disk_tier(tmp_path / "probe", index, budget=1 << 30)
    file_size = probe.write(keys[0], blocks[0])
    probe.remove(keys[0])
    tier = disk_tier(tmp_path, index, budget=3 * file_size + file_size // 2)

    for i, (key, block) in enumerate(zip(keys, blocks, strict=True)):
        tier.write(key, block)
        tier.touch([keys[0]], now=1e12 + i)  # block 0 stays the most recently used
        assert index.total_bytes() <= tier.budget_bytes

    kept = {keys[0], keys[4], keys[5]}
    assert set(index.keys()) == kept
    assert {p.name.removesuffix(".kvblock") for p in files_in(tmp_path)} == kept
    assert tier.evictions == 3


def test_disk_tier_skips_a_block_larger_than_its_budget(
    tmp_path: Path, index: KVIndex, make_block: BlockFactory
) -> None:
    block = make_block(BASE_SPEC, num_tokens=20)
    tier = disk_tier(tmp_path, index, budget=block.nbytes() // 2)
    assert tier.write(key_of(block), block) == 0
    assert files_in(tmp_path) == [] and index.keys() == []


def test_disk_tier_deletes_a_corrupt_file_and_its_entry(
    tmp_path: Path, index: KVIndex, make_block: BlockFactory
) -> None:
    tier = disk_tier(tmp_path, index, budget=1 << 20)
    block = make_block(BASE_SPEC, num_tokens=9)
    key = key_of(block)
    tier.write(key, block)
    path = tier.path_of(key)
    path.write_bytes(path.read_bytes()[:-1])

    with pytest.raises(CorruptBlockError, match="truncated"):
        tier.read(key, block.token_ids, into=None)

    assert not path.exists() and index.get(key) is None and index.total_bytes() == 0


def test_disk_tier_drops_an_entry_whose_file_is_gone(tmp_path: Path, index: KVIndex, make_block: BlockFactory) -> None:
    tier = disk_tier(tmp_path, index, budget=1 << 20)
    block = make_block(BASE_SPEC, num_tokens=9)
    key = key_of(block)
    tier.write(key, block)
    tier.path_of(key).unlink()

    with pytest.raises(MissingBlockError):
        tier.read(key, block.token_ids, into=None)

    assert index.get(key) is None and not tier.contains(key)
