"""By-request segment plans (segment_launch.py, `_request_kernel.py`): the question prefill's attention, a program
per block of one request's rows streaming every chunk of a split of its chunk list.

Held to the same torch reference as the by-chunk plans (itself held to attention over the stitched copy in
test_engine_segment_attention.py): default, llama3- and yarn-scaled RoPE, GQA, a chunk read twice by one request, a
request reading none, APE's temperature and scale, NaN in every slot the call does not name, one split to one per
chunk; and the padded form a CUDA graph replays. The kernels run on CUDA (marked gpu) or under Triton's
interpreter (TRITON_INTERPRET=1); the host plan's shape is checked everywhere.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import numpy as np
import pytest
import torch

from service.engine import segment_launch
from service.engine.segment_attention import ContextScaling, SegmentBatch, reference_attention
from service.engine.segment_launch import SegmentAttention, SegmentPlan, host_layout
from service.engine.segment_plan import REQUEST_BLOCK_M, REQUEST_COLUMNS, PlanCapacity
from tests.test_engine_segment_attention import (
    INTERPRETER,
    KERNEL_DEVICE,
    NEEDS_KERNELS,
    SCALE,
    TOLERANCE,
    assert_one_plan_replays,
    compiles_for_sm90,
    random_batch,
    rotary_for,
    scenario,
)


def prefill_batch(requests: int, chunks: int, reads: int, rows: int, seed: int) -> tuple[SegmentBatch, list[int]]:
    """`random_batch` with every request's last `rows` tail slots as its query rows (a question prefill)."""
    batch, sizes = random_batch(requests, chunks, reads, seed)
    all_rows: list[int] = []
    positions: list[int] = []
    for index, request in enumerate(batch.requests):
        last = next(p for r, p in zip(batch.rows, batch.positions, strict=True) if r == index)
        n = min(rows, request.tail.used)
        all_rows += [index] * n
        positions += range(last - n + 1, last + 1)
    return SegmentBatch(batch.chunks, batch.requests, tuple(all_rows), tuple(positions)), sizes


def test_a_by_request_plan_splits_each_request_and_keeps_its_rows_together() -> None:
    """Host side: a group of pairs per (request, split), one pair per row; the splits cover the request's segments
    in order, once; tiles of REQUEST_BLOCK_M items; every row merges its splits and its tail."""
    batch, _ = prefill_batch(requests=5, chunks=6, reads=3, rows=11, seed=2)
    group = 7
    plan = SegmentPlan.build(batch, group, kv_heads=2, device=torch.device("cpu"), pieces=2, by_request=True)
    assert plan.by_request and [launch.block_m for launch in plan.chunks] == [REQUEST_BLOCK_M]
    tiles = plan.chunks[0].tiles.numpy()
    assert tiles.shape[1] == REQUEST_COLUMNS
    rows = np.asarray(batch.rows)
    for request in range(len(batch.requests)):
        mine = tiles[tiles[:, 0] == np.flatnonzero(rows == request)[0]]
        n_rows = int((rows == request).sum())
        splits = sorted({(int(t[5]), int(t[6])) for t in mine})
        assert splits == [(0, 1), (1, 3)]  # 3 segments in 2 splits, in order, each once
        assert len(mine) == 2 * -(-n_rows * group // REQUEST_BLOCK_M) and (mine[:, 1] == n_rows).all()
        assert sorted(set(mine[:, 7].tolist())) == list(range(-(-n_rows * group // REQUEST_BLOCK_M)))
    segments = plan.segments.numpy()
    want = [(batch.chunks[s.chunk].start, batch.chunks[s.chunk].length) for r in batch.requests for s in r.segments]
    assert [tuple(x) for x in segments.tolist()] == want
    counts = plan.row_ptr[1:] - plan.row_ptr[:-1]
    assert counts.tolist() == [2] * len(batch.rows) and plan.pairs == 3 * len(batch.rows)


def test_a_by_request_plan_refuses_rows_out_of_request_order() -> None:
    batch, _ = prefill_batch(requests=3, chunks=4, reads=2, rows=2, seed=3)
    swapped = SegmentBatch(batch.chunks, batch.requests, batch.rows[::-1], batch.positions[::-1])
    with pytest.raises(ValueError, match="request order"):
        SegmentPlan.build(swapped, 2, 2, torch.device("cpu"), by_request=True)


def test_auto_splits_fill_the_gpu_for_one_request_and_not_for_many() -> None:
    one, _ = prefill_batch(requests=1, chunks=20, reads=16, rows=9, seed=4)
    many, _ = prefill_batch(requests=260, chunks=20, reads=16, rows=9, seed=4)
    cpu = torch.device("cpu")
    lone = SegmentPlan.build(one, 7, 4, cpu, by_request=True)
    crowd = SegmentPlan.build(many, 7, 4, cpu, by_request=True)
    assert lone.pairs == len(one.rows) * (16 + 1)  # a split per chunk: 4 programs would leave the GPU idle
    assert crowd.pairs == 2 * len(many.rows)  # 260 requests' 1,040 programs fill it unsplit
    first_64 = SegmentBatch(many.chunks, many.requests[:64], *_first_rows(many, 64))
    few = SegmentPlan.build(first_64, 7, 4, cpu, by_request=True)
    assert few.pairs == (4 + 1) * len(first_64.rows)  # 256 programs: split in 4, about four waves


def _first_rows(batch: SegmentBatch, requests: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The rows and positions of `batch`'s first `requests` requests."""
    kept = [(r, p) for r, p in zip(batch.rows, batch.positions, strict=True) if r < requests]
    return tuple(r for r, _ in kept), tuple(p for _, p in kept)


@pytest.mark.gpu
@NEEDS_KERNELS
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
@pytest.mark.parametrize(("rope", "heads", "kv_heads"), [("default", 4, 4), ("llama3", 4, 2), ("yarn", 6, 2)])
@pytest.mark.parametrize("splits", (1, 2, 5))
@pytest.mark.parametrize("descriptors", (False, True))
@pytest.mark.parametrize("prerotate", (False, True))
def test_by_request_kernels_equal_the_reference(
    rope: str,
    heads: int,
    kv_heads: int,
    dtype: torch.dtype,
    splits: int,
    descriptors: bool,
    prerotate: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The segment scenario (a chunk read twice by one request, a request reading none, a 3-row prefill, NaN
    around every range) through a by-request plan; K/V by pointers or a descriptor (`KV_DESCRIPTORS`); queries
    rotated in the tiles or before them (`REQUEST_PREROTATE`)."""
    monkeypatch.setattr(segment_launch, "KV_DESCRIPTORS", descriptors)
    monkeypatch.setattr(segment_launch, "REQUEST_PREROTATE", prerotate)
    if dtype == torch.bfloat16 and KERNEL_DEVICE == "cpu":
        pytest.skip("Triton's interpreter multiplies bf16 tiles wrongly (tl.dot); bf16 runs on CUDA")
    rotary = rotary_for(rope, KERNEL_DEVICE)
    s = scenario(rotary, heads, kv_heads, dtype, KERNEL_DEVICE)
    want = reference_attention(s.q, s.batch, s.arena, s.pool, rotary, SCALE)
    device = torch.device(KERNEL_DEVICE)
    plan = SegmentPlan.build(s.batch, heads // kv_heads, kv_heads, device, splits, by_request=True)
    got = SegmentAttention(plan, rotary)(s.q, s.arena, s.pool, SCALE)
    assert got.dtype == dtype and torch.isfinite(got).all()
    assert (got.float() - want.float()).abs().max().item() < TOLERANCE[dtype]


@pytest.mark.gpu
@NEEDS_KERNELS
def test_by_request_kernels_apply_ape_temperature_and_scale() -> None:
    rotary = rotary_for("llama3", KERNEL_DEVICE)
    s = scenario(rotary, 4, 2, torch.float32, KERNEL_DEVICE)
    context = ContextScaling(temperature=1.3, scale=0.85)
    want = reference_attention(s.q, s.batch, s.arena, s.pool, rotary, SCALE, context)
    plan = SegmentPlan.build(s.batch, 2, 2, torch.device(KERNEL_DEVICE), 2, by_request=True)
    got = SegmentAttention(plan, rotary, context)(s.q, s.arena, s.pool, SCALE)
    assert (got - want).abs().max().item() < 2e-5
    plain = reference_attention(s.q, s.batch, s.arena, s.pool, rotary, SCALE)
    assert (got - plain).abs().max().item() > 1e-3


@pytest.mark.gpu
@NEEDS_KERNELS
@pytest.mark.parametrize("splits", (None, 1, 3))
@pytest.mark.parametrize("descriptors", (False, True))
@pytest.mark.parametrize("prerotate", (False, True))
def test_by_request_kernels_on_many_rows_at_gqa_7(
    splits: int | None, descriptors: bool, prerotate: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """6 requests x 3 of 6 chunks, 20 rows each at GQA 7 (a request's items span three 64-item blocks), queries
    strided in memory; K/V by pointers or a descriptor; queries rotated in the tiles or before them."""
    monkeypatch.setattr(segment_launch, "KV_DESCRIPTORS", descriptors)
    monkeypatch.setattr(segment_launch, "REQUEST_PREROTATE", prerotate)
    rotary = rotary_for("llama3", KERNEL_DEVICE)
    batch, (arena_slots, pool_slots) = prefill_batch(requests=6, chunks=6, reads=3, rows=20, seed=1)
    gen = torch.Generator().manual_seed(2)
    arena = torch.randn((2, 2, arena_slots + 64, 16), generator=gen)
    pool = torch.randn((2, 2, pool_slots + 64, 16), generator=gen)
    arena[:, :, arena_slots:] = float("nan")
    pool[:, :, pool_slots:] = float("nan")
    wide = torch.randn((len(batch.rows), 14 + 4, 16), generator=gen)
    wide, arena, pool = (t.to(KERNEL_DEVICE) for t in (wide, arena, pool))
    q = wide[:, :14]
    want = reference_attention(q, batch, arena, pool, rotary, SCALE)
    plan = SegmentPlan.build(batch, 7, 2, torch.device(KERNEL_DEVICE), splits, by_request=True)
    got = SegmentAttention(plan, rotary)(q, arena, pool, SCALE)
    assert (got - want).abs().max().item() < 2e-5


CAPACITY = PlanCapacity(rows=64, entries=400, pairs=200, chunk_tiles=30, tail_tiles=20, segments=20)


def test_a_padded_by_request_plan_has_fixed_shapes_and_refuses_a_batch_too_large() -> None:
    shapes = []
    for seed in (3, 4):
        batch, _ = prefill_batch(requests=4, chunks=5, reads=3, rows=6, seed=seed)
        plan = SegmentPlan.build(batch, 7, 2, torch.device("cpu"), 2, CAPACITY, by_request=True)
        assert plan.pairs == 200 and plan.segments.shape == (20, 2) and plan.chunks[0].tiles.shape == (30, 9)
        shapes.append(plan.shape)
    assert shapes[0] == shapes[1]
    with pytest.raises(ValueError, match=r"segments \d+ > 5"):
        SegmentPlan.build(
            batch, 7, 2, torch.device("cpu"), 2, dataclasses.replace(CAPACITY, segments=5), by_request=True
        )
    by_chunk = SegmentPlan.build(batch, 7, 2, torch.device("cpu"), 2, dataclasses.replace(CAPACITY, pairs=400))
    with pytest.raises(ValueError, match="capacities"):
        by_chunk.load(host_layout(batch, 7, 2, 2, CAPACITY, by_request=True))


@pytest.mark.gpu
@NEEDS_KERNELS
@pytest.mark.parametrize(
    ("programs", "descriptors", "prerotate"), [(None, False, False), (2, False, True), (2, True, False)]
)
def test_one_padded_by_request_plan_replays_two_batches_and_zeroes_dead_rows(
    programs: int | None, descriptors: bool, prerotate: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a program per tile, and with two programs per KV head looping over every live tile (K/V through a
    descriptor too; every padded entry rotated before the partials)."""
    monkeypatch.setattr(segment_launch, "PADDED_PROGRAMS", programs)
    monkeypatch.setattr(segment_launch, "KV_DESCRIPTORS", descriptors)
    monkeypatch.setattr(segment_launch, "REQUEST_PREROTATE", prerotate)
    device = torch.device(KERNEL_DEVICE)
    first, _ = prefill_batch(requests=4, chunks=5, reads=3, rows=6, seed=3)
    second, _ = prefill_batch(requests=3, chunks=5, reads=2, rows=4, seed=4)
    layout = lambda b: host_layout(b, 7, 2, 2, CAPACITY, by_request=True)  # noqa: E731
    assert_one_plan_replays([first, second], layout, CAPACITY.rows, device)


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or INTERPRETER or torch.cuda.is_available(),
    reason="a CPU check: needs triton importable, no interpreter, no CUDA",
)
@pytest.mark.parametrize("dtype", ("bf16", "fp16", "fp32"))
def test_the_request_kernel_compiles_for_an_h100_without_one(dtype: str) -> None:
    from service.engine import _request_kernel

    pointers = {"q_ptr": dtype, "kv_ptr": dtype, "cos_ptr": "fp32", "sin_ptr": "fp32", "out_ptr": dtype}
    pointers |= {"lse_ptr": "fp32", "tiles_ptr": "i64", "count_ptr": "i64", "segments_ptr": "i64"}
    constants = {"group": 7, "head_dim": 128, "dim_p2": 128, "block_m": REQUEST_BLOCK_M, "block_n": 64}
    constants["ieee"] = dtype == "fp32"
    constants["prerotated"] = False  # a constexpr with a default: named, or the signature would make it an i32
    kernel = _request_kernel.request_partials_kernel
    warps = segment_launch.REQUEST_WARPS
    assert compiles_for_sm90(kernel, pointers, {"qk_scale": "fp32"}, {**constants, "kv_desc": None}, warps)
    floats = {"qk_scale": "fp32", "kv_desc": f"tensordesc<{dtype}[64, 128]>"}  # KV_DESCRIPTORS
    assert compiles_for_sm90(kernel, pointers, floats, constants, warps)
    assert compiles_for_sm90(kernel, pointers, {"qk_scale": "fp32"}, {**constants, "prerotated": True}, warps)
