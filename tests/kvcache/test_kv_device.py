"""The CUDA helpers: plain tensors and no-ops on the CPU; pinned memory, streams and events on a GPU."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from kv_support import bits

from service.engine.engine import StitchEngine
from service.engine.gate import synthetic_ids
from service.kvcache import device
from service.kvcache.host_pool import HostPool
from service.kvcache.index import SQLITE_FILENAME, SqliteIndex
from service.kvcache.store import TierBudgets
from service.kvcache.tiers import Tier
from service.serving.kv_source import kv_store_for

HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device here")
CPU = torch.device("cpu")


def test_cpu_degrades_to_plain_tensors_and_no_ops() -> None:
    assert not device.uses_cuda(CPU)
    assert device.new_copy_stream(CPU) is None
    assert device.record_event(CPU) is None
    host = device.allocate_host(4096, pinned=False)
    assert host.dtype == torch.uint8 and host.numel() == 4096 and not host.is_pinned()
    target = torch.empty(3)
    assert device.copy_to_host(torch.ones(3), target, stream=None) is None
    assert torch.equal(target, torch.ones(3))
    device.wait_on(None, CPU)
    device.wait_host(None)
    assert device.is_done(None)


def test_cpu_copy_clock_sums_wall_time() -> None:
    clock = device.CopyClock(None)
    with clock.timing():
        torch.ones(1 << 20).clone()
    assert clock.elapsed_ms() > 0


@pytest.mark.gpu
@gpu
def test_pinned_pool_and_async_round_trip() -> None:
    cuda = torch.device("cuda")
    stream = device.new_copy_stream(cuda)
    pool = HostPool(1 << 24, pinned=True)
    slot = pool.reserve("k", (1,), torch.bfloat16, (4, 1024, 256))
    assert slot is not None and pool.pinned and pool.view(slot).is_pinned()
    source = torch.randn(4, 1024, 256, device=cuda).to(torch.bfloat16) * 3  # produced on the compute stream

    demoted = device.copy_to_host(source, pool.view(slot), stream)  # waits for the compute before copying
    slot.pending = demoted
    clock = device.CopyClock(stream)
    with clock.timing():
        back, arrived = device.copy_to_device(pool.view(slot), cuda, stream)
    device.wait_on(arrived, cuda)

    assert demoted is not None and arrived is not None
    assert torch.equal(bits(back), bits(source))
    assert clock.elapsed_ms() > 0 and device.is_done(arrived)
    pool.discard("k")  # waits for the pending copy before the bytes can be reused


@pytest.mark.gpu
@gpu
def test_store_on_cuda_is_bit_exact_through_every_tier(get_engine: Callable[..., StitchEngine], tmp_path: Path) -> None:
    engine = get_engine("qwen2", "cuda")
    prompt = engine.template.prompt(synthetic_ids(engine, (40, 17, 33), seed=1), [5, 6, 7])
    fresh = engine.precompute(prompt.blocks)
    index = SqliteIndex(tmp_path / SQLITE_FILENAME)
    budgets = [TierBudgets(1 << 24, 1 << 24, 1 << 26), TierBudgets(0, 1 << 24, 1 << 26)]
    try:
        for budget, second in zip(budgets, (Tier.GPU, Tier.HOST), strict=True):
            with kv_store_for(engine, tmp_path / "cache", index, budget) as store:
                store.fetch(prompt.blocks)
                store.flush()
                results = [store.fetch(prompt.blocks)]
            with kv_store_for(engine, tmp_path / "cache", index, TierBudgets(0, 1 << 24, 1 << 26)) as cold:
                results.append(cold.fetch(prompt.blocks))
            assert results[0].counts[second] == len(fresh)
            assert results[1].counts[Tier.DISK] == len(fresh)
            for result in results:
                assert all(b.kv.device.type == "cuda" for b in result.blocks)
                for got, want in zip(result.blocks, fresh, strict=True):
                    assert torch.equal(bits(got.kv), bits(want.kv))
    finally:
        index.close()


def stall(stream: torch.cuda.Stream | None, cycles: int = 1 << 27) -> None:
    """Keep a copy stream busy (~70 ms on an H200) so the copies queued after it land late: a stitch that did
    not wait for its blocks would read them before they arrived."""
    with torch.cuda.stream(stream):
        torch.cuda._sleep(cycles)


@pytest.mark.gpu
@gpu
def test_overlapped_host_and_disk_fetches_stitch_to_the_logits_of_fresh_blocks(
    get_engine: Callable[..., StitchEngine], tmp_path: Path
) -> None:
    engine = get_engine("qwen2", "cuda")
    prompt = engine.template.prompt(synthetic_ids(engine, (40, 17, 33, 25), seed=3), [5, 6, 7])
    n = len(prompt.blocks)
    fresh = engine.precompute(prompt.blocks)
    _, expected, _ = engine.prefill_stitched(fresh, prompt.question, all_logits=True)
    budgets = TierBudgets(0, 1 << 24, 1 << 26)
    index = SqliteIndex(tmp_path / SQLITE_FILENAME)
    try:
        with kv_store_for(engine, tmp_path / "cache", index, budgets) as store:
            store.fetch(prompt.blocks)  # misses, demoted into the pinned host pool
            store.flush()
            stall(store.host.stream)
            from_host = store.fetch(prompt.blocks, overlap=True)
            last = from_host.ready[-1]
            returned_early = last is not None and not device.is_done(last.event)
            _, host_logits, _ = engine.prefill_stitched(
                from_host.blocks, prompt.question, all_logits=True, chunk_ready=from_host.ready
            )
        with kv_store_for(engine, tmp_path / "cache", index, budgets, direct_io=True) as cold:
            stall(cold.host.stream)
            from_disk = cold.fetch(prompt.blocks, overlap=True)  # read into pinned slots, O_DIRECT
            _, disk_logits, _ = engine.prefill_stitched(
                from_disk.blocks, prompt.question, all_logits=True, chunk_ready=from_disk.ready
            )
            direct = cold.disk.direct
    finally:
        index.close()

    assert returned_early  # the fetch did not wait for its copies; the stitch did, block by block
    assert from_host.counts[Tier.HOST] == n and from_disk.counts[Tier.DISK] == n
    assert direct is not None and (direct.reads == n or direct.refused())
    for result, got in ((from_host, host_logits), (from_disk, disk_logits)):
        assert all(a is not None and a.device.type == "cuda" for a in result.ready)
        assert 0 < result.timings.h2d_ms < 60  # the copies alone, not the stall queued before them
        assert torch.equal(got, expected)
