"""Segment attention (segment_attention.py, segment_launch.py): shared chunks with RoPE deferred to the query.

The torch reference is held to plain attention over the stitched copy each request would get today (every chunk's
keys rotated at its absolute positions o + j, then the request's tail, causal), in fp32 on the CPU, for default,
linear, llama3- and yarn-scaled RoPE (the HF rotary modules of tiny configs), GQA, chunks shared by some requests
and not others, a chunk read at two offsets, a multi-row prefill, APE's temperature and scale, and NaN in every
arena and pool slot the call does not name; and to the engine's own stitched buffers of the tiny models (both
position modes). The Triton kernels are held to the reference on CUDA (bf16, fp16, fp32; marked gpu); on the CPU
they run under Triton's interpreter when the run sets TRITON_INTERPRET=1 and triton imports (fp32 and fp16: the
interpreter multiplies bf16 tiles wrongly), and compile for sm_90 wherever triton imports without the interpreter.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, PretrainedConfig, Qwen2Config
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

from service.devtools.tiny_model import LLAMA3_SCALING
from service.engine import segment_launch
from service.engine.attention import attend_causal_end
from service.engine.engine import StitchEngine
from service.engine.fused_stitch import triton_runs_on
from service.engine.gate import synthetic_ids
from service.engine.kv_layout import KVBlock
from service.engine.rotary import Rotary
from service.engine.segment_attention import (
    ChunkRange,
    ContextScaling,
    RequestSegments,
    Segment,
    SegmentBatch,
    Tail,
    reference_attention,
)
from service.engine.segment_launch import HostLayout, SegmentAttention, SegmentPlan, host_layout
from service.engine.segment_plan import PlanCapacity

HEAD_DIM = 16
SCALE = HEAD_DIM**-0.5


def _config(rope: str) -> PretrainedConfig:
    common = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096}
    if rope == "llama3":
        return LlamaConfig(**common, rope_scaling=dict(LLAMA3_SCALING))
    if rope == "linear":
        return LlamaConfig(**common, rope_scaling={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})
    if rope == "yarn":
        scaling = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024}
        return Qwen2Config(**common, rope_scaling=scaling)
    return Qwen2Config(**common)


def rotary_for(rope: str, device: str = "cpu") -> Rotary:
    """The project's Rotary over a tiny HF model's own rotary module (scaling as the config says)."""
    config = _config(rope)
    module = LlamaRotaryEmbedding(config) if isinstance(config, LlamaConfig) else Qwen2RotaryEmbedding(config)
    return Rotary(module.to(device), HEAD_DIM, torch.device(device))


@dataclass
class Scenario:
    """Random un-rotated chunk keys, several requests' placements and tails, and the tensors both paths read."""

    batch: SegmentBatch
    q: torch.Tensor  # [N, Hq, D] unrotated
    arena: torch.Tensor  # [2, Hkv, A, D] chunk keys rotated at local positions
    pool: torch.Tensor  # [2, Hkv, S, D] tails rotated at absolute positions
    raw_chunks: list[torch.Tensor]  # per chunk [2, Hkv, L, D], keys un-rotated
    raw_tails: list[torch.Tensor]  # per request [2, Hkv, used, D], keys un-rotated
    tail_positions: list[list[int]]


# Each request: (segments as (chunk, offset), tail positions, query rows). Chunk 0 is read by requests 0, 1 and 3
# (request 1 at another offset), chunk 2 twice by request 2 (a composite placement); request 3 is a 3-row prefill.
CHUNKS = ((7, 0), (5, 3), (9, 0), (4, 11))  # (length, local base)
REQUESTS: tuple[tuple[tuple[tuple[int, int], ...], list[int], int], ...] = (
    (((0, 2), (1, 9)), [0, 1, 14, 15], 1),
    (((2, 1), (0, 10)), [0, 17, 18], 1),
    (((2, 0), (3, 40), (2, 9)), [18, 44, 45, 46, 47, 48], 2),
    (((1, 2), (0, 7)), [0, 1, 14, 15, 16], 3),
    ((), [0, 1, 2, 3], 1),
)


def scenario(
    rotary: Rotary, heads: int = 4, kv_heads: int = 2, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> Scenario:
    gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
    raw_chunks = [torch.randn((2, kv_heads, length, HEAD_DIM), generator=gen) for length, _ in CHUNKS]
    # Chunks sit apart in the arena; every other slot is NaN and must never be read.
    arena = torch.full((2, kv_heads, 64, HEAD_DIM), float("nan"))
    chunks, start = [], 2
    for raw, (length, base) in zip(raw_chunks, CHUNKS, strict=True):
        arena[:, :, start : start + length] = _rotated(rotary, raw, list(range(base, base + length)))
        chunks.append(ChunkRange(start, length, base))
        start += length + 3
    pool = torch.full((2, kv_heads, 64, HEAD_DIM), float("nan"))
    requests, raw_tails, rows, positions, start = [], [], [], [], 1
    for index, (segments, tail_positions, n_rows) in enumerate(REQUESTS):
        raw = torch.randn((2, kv_heads, len(tail_positions), HEAD_DIM), generator=gen)
        pool[:, :, start : start + len(tail_positions)] = _rotated(rotary, raw, tail_positions)
        raw_tails.append(raw)
        placed = tuple(Segment(c, o) for c, o in segments)
        requests.append(RequestSegments(placed, Tail(start, len(tail_positions))))
        rows += [index] * n_rows
        positions += tail_positions[-n_rows:]
        start += len(tail_positions) + 2
    batch = SegmentBatch(tuple(chunks), tuple(requests), tuple(rows), tuple(positions))
    q = torch.randn((len(rows), heads, HEAD_DIM), generator=gen)
    tails = [list(p) for _, p, _ in REQUESTS]
    to = {"dtype": dtype, "device": device}
    return Scenario(batch, q.to(**to), arena.to(**to), pool.to(**to), raw_chunks, raw_tails, tails)


def _rotated(rotary: Rotary, raw: torch.Tensor, positions: list[int]) -> torch.Tensor:
    kv = raw.clone()
    kv[0] = rotary.rotate(raw[0].to(rotary._device), torch.tensor(positions)).cpu()
    return kv


def stitched_attention(s: Scenario, rotary: Rotary, context: ContextScaling | None = None) -> torch.Tensor:
    """Plain attention over each request's stitched copy, in float64: chunk keys rotated at o + j (scores divided
    by T), then its tail, causal; the context's exp-sum raised to the power S (APE's scale, written directly)."""
    context = context or ContextScaling()
    visible = s.batch.tail_visible()
    outs = []
    for row, request_index in enumerate(s.batch.rows):
        request = s.batch.requests[request_index]
        m = s.batch.positions[row]
        q = rotary.rotate(s.q[row].float().unsqueeze(1), torch.tensor([m]))[:, 0].double()  # [Hq, D]
        chunk_kv = [
            _rotated(
                rotary, s.raw_chunks[seg.chunk], list(range(seg.offset, seg.offset + s.raw_chunks[seg.chunk].shape[2]))
            )
            for seg in request.segments
        ]
        tail_kv = _rotated(rotary, s.raw_tails[request_index], s.tail_positions[request_index])[:, :, : visible[row]]
        context_z, context_num = _exp_sums(q, chunk_kv, SCALE / context.temperature)
        tail_z, tail_num = _exp_sums(q, [tail_kv], SCALE)
        weight = context_z**context.scale / context_z.clamp(min=1e-300)
        out = (context_num * weight.unsqueeze(-1) + tail_num) / (context_z**context.scale + tail_z).unsqueeze(-1)
        outs.append(out)
    return torch.stack(outs)


def _exp_sums(q: torch.Tensor, kvs: list[torch.Tensor], scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Z = sum exp(score) [Hq] and sum exp(score) v [Hq, D] over the keys of every kv in `kvs` (float64)."""
    heads = q.shape[0]
    z = torch.zeros(heads, dtype=torch.float64)
    num = torch.zeros((heads, HEAD_DIM), dtype=torch.float64)
    for kv in kvs:
        group = heads // kv.shape[1]
        k = kv[0].double().repeat_interleave(group, dim=0)  # [Hq, L, D]
        v = kv[1].double().repeat_interleave(group, dim=0)
        weights = torch.exp(torch.einsum("hd,hld->hl", q, k) * scale)
        z += weights.sum(-1)
        num += torch.einsum("hl,hld->hd", weights, v)
    return z, num


ROPES = ("default", "linear", "llama3", "yarn")


@pytest.mark.parametrize("rope", ROPES)
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (6, 2)])
def test_reference_equals_attention_over_the_stitched_copy(rope: str, heads: int, kv_heads: int) -> None:
    """Shared chunks, a chunk at two offsets and twice in one request, a request with no chunk, a 3-row causal
    prefill, NaN everywhere else: rotating q by m - o + base gives the stitched attention to fp32 rounding."""
    rotary = rotary_for(rope)
    s = scenario(rotary, heads, kv_heads)
    got = reference_attention(s.q, s.batch, s.arena, s.pool, rotary, SCALE)
    want = stitched_attention(s, rotary)
    assert torch.isfinite(got).all()
    assert torch.allclose(got.double(), want, atol=2e-5, rtol=0)


def test_the_check_fails_when_a_chunk_is_placed_at_another_offset() -> None:
    """The comparison can fail: moving one segment by a position changes the answer well beyond the tolerance."""
    rotary = rotary_for("default")
    s = scenario(rotary)
    first = s.batch.requests[0]
    moved = RequestSegments((Segment(0, 3), first.segments[1]), first.tail)
    batch = SegmentBatch(s.batch.chunks, (moved, *s.batch.requests[1:]), s.batch.rows, s.batch.positions)
    got = reference_attention(s.q, batch, s.arena, s.pool, rotary, SCALE)
    want = stitched_attention(s, rotary)
    assert (got[0].double() - want[0]).abs().max() > 1e-3
    assert torch.allclose(got[1:].double(), want[1:], atol=2e-5, rtol=0)


@pytest.mark.parametrize("rope", ("default", "yarn"))
def test_context_temperature_divides_the_chunk_scores(rope: str) -> None:
    rotary = rotary_for(rope)
    s = scenario(rotary)
    context = ContextScaling(temperature=1.7)
    got = reference_attention(s.q, s.batch, s.arena, s.pool, rotary, SCALE, context)
    # S = 1: the stitched attention whose chunk keys are divided by T.
    cooled = Scenario(**{**s.__dict__, "raw_chunks": [_keys_over(kv, 1.7) for kv in s.raw_chunks]})
    assert torch.allclose(got.double(), stitched_attention(cooled, rotary), atol=2e-5, rtol=0)
    assert (got.double() - stitched_attention(s, rotary)).abs().max() > 1e-3


def _keys_over(kv: torch.Tensor, t: float) -> torch.Tensor:
    out = kv.clone()
    out[0] /= t
    return out


@pytest.mark.parametrize("temperature", (1.0, 0.8))
def test_context_scale_raises_the_context_exp_sum_to_the_power_s(temperature: float) -> None:
    rotary = rotary_for("llama3")
    s = scenario(rotary, 4, 2)
    context = ContextScaling(temperature=temperature, scale=0.9)
    got = reference_attention(s.q, s.batch, s.arena, s.pool, rotary, SCALE, context)
    assert torch.allclose(got.double(), stitched_attention(s, rotary, context), atol=2e-5, rtol=0)
    assert (got.double() - stitched_attention(s, rotary, ContextScaling(temperature))).abs().max() > 1e-3


def test_a_batch_refuses_rows_it_cannot_attend() -> None:
    tail = Tail(0, 1)
    with pytest.raises(ValueError, match="more query rows"):
        SegmentBatch((), (RequestSegments((), tail),), (0, 0), (0, 1))
    with pytest.raises(ValueError, match="chunk 1"):
        SegmentBatch((ChunkRange(0, 2),), (RequestSegments((Segment(1, 0),), tail),), (0,), (0,))
    with pytest.raises(ValueError, match="positive"):
        ContextScaling(temperature=0.0)
    assert SegmentBatch((), (RequestSegments((), Tail(0, 5)),), (0, 0, 0), (2, 3, 4)).tail_visible() == (3, 4, 5)
    batch = SegmentBatch((ChunkRange(4, 6),), (RequestSegments((Segment(0, 0),), Tail(3, 5)),), (0,), (9,))
    assert batch.reach() == (10, 8)
    kv = torch.zeros((2, 1, 9, HEAD_DIM))
    with pytest.raises(ValueError, match="arena slots up to 10"):
        batch.check_fits(kv, kv)


def test_math_sanity_of_the_direct_formula() -> None:
    """The float64 helper itself: two keys with scores 0 and log 3 weigh 1 : 3."""
    q = torch.tensor([[1.0] + [0.0] * (HEAD_DIM - 1)], dtype=torch.float64)
    kv = torch.zeros((2, 1, 2, HEAD_DIM))
    kv[0, 0, 1, 0] = math.log(3) / SCALE
    kv[1, 0, 0, 0], kv[1, 0, 1, 0] = 4.0, 8.0
    z, num = _exp_sums(q, [kv], SCALE)
    assert torch.allclose(num / z.unsqueeze(-1), torch.tensor([[7.0] + [0.0] * (HEAD_DIM - 1)], dtype=torch.float64))


INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_KERNELS_HERE = triton_runs_on(torch.device(KERNEL_DEVICE), interpreter=INTERPRETER)
# Marked `gpu` so a GPU run selects them with -m gpu; on the CPU they run only under the interpreter.
NEEDS_KERNELS = pytest.mark.skipif(
    not _KERNELS_HERE, reason="needs CUDA and triton (or TRITON_INTERPRET=1 with triton importable)"
)
# bf16/fp16 round q, K, V and the probabilities before their products (fp32 accumulation): a few 1e-3 on outputs
# of size ~1, while a wrong rotation or a missed key moves them by ~0.1.
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def _kernel_case(rope: str, heads: int, kv_heads: int, dtype: torch.dtype) -> tuple[Scenario, Rotary]:
    rotary = rotary_for(rope, KERNEL_DEVICE)
    return scenario(rotary, heads, kv_heads, dtype, KERNEL_DEVICE), rotary


@pytest.mark.gpu
@NEEDS_KERNELS
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
@pytest.mark.parametrize(("rope", "heads", "kv_heads"), [("default", 4, 4), ("llama3", 4, 2), ("yarn", 6, 2)])
@pytest.mark.parametrize("pieces", (1, 3))
@pytest.mark.parametrize("prerotate", (False, True))
def test_kernels_equal_the_reference(
    rope: str,
    heads: int,
    kv_heads: int,
    dtype: torch.dtype,
    pieces: int,
    prerotate: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Shared reads (a chunk's readers in one program), pieces of chunks, tails causal, NaN in every slot the call
    does not name: the kernels give the reference's answer (itself held to the stitched copy above), with the
    queries rotated in the tiles or before them (`PREROTATE`)."""
    monkeypatch.setattr(segment_launch, "PREROTATE", prerotate)
    if dtype == torch.bfloat16 and KERNEL_DEVICE == "cpu":
        pytest.skip("Triton's interpreter multiplies bf16 tiles wrongly (tl.dot); bf16 runs on CUDA")
    s, rotary = _kernel_case(rope, heads, kv_heads, dtype)
    want = reference_attention(s.q, s.batch, s.arena, s.pool, rotary, SCALE)
    plan = SegmentPlan.build(s.batch, heads // kv_heads, kv_heads, torch.device(KERNEL_DEVICE), pieces)
    got = SegmentAttention(plan, rotary)(s.q, s.arena, s.pool, SCALE)
    assert got.dtype == dtype and torch.isfinite(got).all()
    assert (got.float() - want.float()).abs().max().item() < TOLERANCE[dtype]


@pytest.mark.gpu
@NEEDS_KERNELS
def test_kernels_apply_ape_temperature_and_scale() -> None:
    s, rotary = _kernel_case("llama3", 4, 2, torch.float32)
    context = ContextScaling(temperature=1.3, scale=0.85)
    want = reference_attention(s.q, s.batch, s.arena, s.pool, rotary, SCALE, context)
    plan = SegmentPlan.build(s.batch, 2, 2, torch.device(KERNEL_DEVICE))
    got = SegmentAttention(plan, rotary, context)(s.q, s.arena, s.pool, SCALE)
    assert (got - want).abs().max().item() < 2e-5
    plain = reference_attention(s.q, s.batch, s.arena, s.pool, rotary, SCALE)
    assert (got - plain).abs().max().item() > 1e-3


def random_batch(requests: int, chunks: int, reads: int, seed: int) -> tuple[SegmentBatch, list[int]]:
    """`requests` decode rows (the last a 2-row prefill), each reading `reads` of `chunks` random chunks placed back
    to back after a 2-token prefix; chunk lengths 5..40 and local bases 0..7; tails 3..9 slots."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 41, (chunks,), generator=gen).tolist()
    ranges, start = [], 0
    for length in lengths:
        ranges.append(ChunkRange(start, length, int(torch.randint(0, 8, (1,), generator=gen))))
        start += length + 1
    placed, rows, positions, tail_start = [], [], [], 0
    for r in range(requests):
        picks = torch.randperm(chunks, generator=gen)[:reads].tolist()
        segments, offset = [], 2
        for c in picks:
            segments.append(Segment(c, offset))
            offset += lengths[c]
        used = int(torch.randint(3, 10, (1,), generator=gen))
        placed.append(RequestSegments(tuple(segments), Tail(tail_start, used)))
        n_rows = 2 if r == requests - 1 else 1
        rows += [r] * n_rows
        positions += [offset + used - n_rows + i for i in range(n_rows)]
        tail_start += used + 1
    return SegmentBatch(tuple(ranges), tuple(placed), tuple(rows), tuple(positions)), [start, tail_start]


def test_the_array_form_builds_the_same_plan_and_converts_back_exactly() -> None:
    """A call as arrays (the shared decode step's form) is the call as objects: the round trip gives the same
    batch, the same tail visibility and reach, and a plan equal tensor for tensor."""
    batch, _ = random_batch(requests=12, chunks=6, reads=3, seed=4)
    arrays = batch.arrays()
    assert arrays.batch() == batch
    assert arrays.tail_visible().tolist() == list(batch.tail_visible())
    assert arrays.reach() == batch.reach()
    cpu = torch.device("cpu")
    from_objects = SegmentPlan.build(batch, 7, 2, cpu, pieces=2, capacity=CAPACITY)
    from_arrays = SegmentPlan.build(arrays, 7, 2, cpu, pieces=2, capacity=CAPACITY)
    # Every tensor of a plan is a view of its flat one, laid out by its shape.
    assert from_objects.shape == from_arrays.shape and torch.equal(from_objects.flat, from_arrays.flat)
    assert from_objects.reach == from_arrays.reach


def test_the_array_form_refuses_what_the_object_form_refuses() -> None:
    batch, _ = random_batch(requests=3, chunks=4, reads=2, seed=5)
    arrays = batch.arrays()
    with pytest.raises(ValueError, match="outside"):
        dataclasses.replace(arrays, seg_chunk=arrays.seg_chunk + 4)
    with pytest.raises(ValueError, match="more query rows"):
        dataclasses.replace(arrays, rows=np.zeros(20, dtype=np.int64), positions=np.zeros(20, dtype=np.int64))
    with pytest.raises(ValueError, match="one row at least"):
        dataclasses.replace(arrays, rows=arrays.rows[:0], positions=arrays.positions[:0])


def test_a_plan_groups_pairs_by_chunk_and_cuts_chunks_into_pieces() -> None:
    """Host-side plan on the CPU (no triton needed): one tile group per chunk piece holding every reader of it,
    tiles sized to their group's query items, each row's partials = its segments x pieces, and its tail pair."""
    batch, _ = random_batch(requests=12, chunks=6, reads=3, seed=0)
    plan = SegmentPlan.build(batch, group=7, kv_heads=2, device=torch.device("cpu"), pieces=2)
    rows = len(batch.rows)
    counts = plan.row_ptr[1:] - plan.row_ptr[:-1]
    assert counts.tolist() == [2 * len(batch.requests[r].segments) for r in batch.rows]
    readers = {c: sum(1 for r in batch.rows for s in batch.requests[r].segments if s.chunk == c) for c in range(6)}
    tiles = [(launch.block_m, row) for launch in plan.chunks for row in launch.tiles.tolist()]
    assert max(readers.values()) * 7 > 64 and len(plan.chunks) > 1  # a group over two blocks; two tile widths
    for c, chunk in enumerate(batch.chunks):
        mine = [(block_m, row) for block_m, row in tiles if chunk.start <= row[0] < chunk.start + chunk.length]
        pieces = sorted({(row[0], row[1]) for _, row in mine})
        assert len(pieces) == 2 and sum(length for _, length in pieces) == chunk.length
        assert pieces[0][0] == chunk.start
        block_m = min(64, max(16, 1 << (readers[c] * 7 - 1).bit_length()))
        assert {m for m, _ in mine} == {block_m} and len(mine) == 2 * -(-readers[c] * 7 // block_m)
        assert all(row[3] == readers[c] for _, row in mine)
    assert plan.pairs == 2 * sum(readers.values()) + rows
    assert plan.row_tail.tolist() == sorted(plan.row_tail.tolist()) and plan.row_tail.min() >= plan.pairs - rows


@pytest.mark.gpu
@NEEDS_KERNELS
@pytest.mark.parametrize("pieces", (None, 1, 4))
@pytest.mark.parametrize("prerotate", (False, True))
@pytest.mark.parametrize("descriptors", (False, True))
def test_kernels_equal_the_reference_on_many_readers(
    pieces: int | None, prerotate: bool, descriptors: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """12 requests x 3 of 6 chunks at GQA 7 (a chunk's queries span several 64-item blocks), a 2-row prefill,
    queries strided in memory; queries rotated in the tiles or before them; K/V by pointers or a descriptor."""
    monkeypatch.setattr(segment_launch, "PREROTATE", prerotate)
    monkeypatch.setattr(segment_launch, "KV_DESCRIPTORS", descriptors)
    rotary = rotary_for("llama3", KERNEL_DEVICE)
    batch, (arena_slots, pool_slots) = random_batch(requests=12, chunks=6, reads=3, seed=1)
    gen = torch.Generator().manual_seed(2)
    arena = torch.randn((2, 2, arena_slots + 64, HEAD_DIM), generator=gen)
    pool = torch.randn((2, 2, pool_slots + 64, HEAD_DIM), generator=gen)
    arena[:, :, arena_slots:] = float("nan")
    pool[:, :, pool_slots:] = float("nan")
    wide = torch.randn((len(batch.rows), 14 + 4, HEAD_DIM), generator=gen)
    wide, arena, pool = (t.to(KERNEL_DEVICE) for t in (wide, arena, pool))
    q = wide[:, :14]  # strided, as the query slice of the fused q/k/v projection
    want = reference_attention(q, batch, arena, pool, rotary, SCALE)
    plan = SegmentPlan.build(batch, 7, 2, torch.device(KERNEL_DEVICE), pieces)
    got = SegmentAttention(plan, rotary)(q, arena, pool, SCALE)
    assert (got - want).abs().max().item() < 2e-5


CAPACITY = PlanCapacity(rows=16, entries=80, pairs=120, chunk_tiles=24, tail_tiles=16)


def test_a_padded_plan_has_fixed_shapes_and_refuses_a_batch_too_large() -> None:
    shapes = []
    for seed in (3, 4):
        batch, _ = random_batch(requests=6, chunks=5, reads=3, seed=seed)
        plan = SegmentPlan.build(batch, 7, 2, torch.device("cpu"), pieces=2, capacity=CAPACITY)
        assert plan.pairs == 120 and plan.row_tail.shape == (16,) and (plan.row_tail[len(batch.rows) :] == -1).all()
        assert [launch.block_m for launch in plan.chunks] == [16, 32, 64]
        shapes.append(plan.shape)
    assert shapes[0] == shapes[1]
    with pytest.raises(ValueError, match=r"pairs \d+ > 20"):
        SegmentPlan.build(batch, 7, 2, torch.device("cpu"), pieces=2, capacity=dataclasses.replace(CAPACITY, pairs=20))


def test_a_padded_plan_counts_its_live_tiles_and_bounds_its_grid(monkeypatch: pytest.MonkeyPatch) -> None:
    """A padded plan's launches run at most PADDED_PROGRAMS programs per KV head, looping over the live tiles the
    plan counts (on the device: a graph replays each step's count); an unpadded plan, a program per tile."""
    monkeypatch.setattr(segment_launch, "PADDED_PROGRAMS", 3)
    batch, _ = random_batch(requests=6, chunks=5, reads=3, seed=3)
    cpu = torch.device("cpu")
    exact = SegmentPlan.build(batch, 7, 2, cpu, pieces=2)
    padded = SegmentPlan.build(batch, 7, 2, cpu, pieces=2, capacity=CAPACITY)
    live = {launch.block_m: launch.tiles.shape[0] for launch in exact.chunks}
    assert [launch.programs for launch in exact.chunks] == [live[w] for w in sorted(live)]
    for launch in padded.chunks:
        assert int(launch.count) == live.get(launch.block_m, 0) and launch.programs == 3
        assert (launch.tiles[int(launch.count) :] == 0).all() and (launch.tiles[: int(launch.count), 3] > 0).all()
    assert [int(launch.count) for launch in padded.tails] == [6, 0, 0]
    assert padded.counts.tolist() == [int(launch.count) for launch in (*padded.chunks, *padded.tails)]


class _LaunchRecorder:
    """Stands in for a Triton kernel: `kernel[grid](*args, **options)` records the options of each launch."""

    def __init__(self, name: str, launches: list[tuple[str, dict[str, Any]]]) -> None:
        self._name, self._launches = name, launches

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        def launch(*args: Any, **options: Any) -> None:
            self._launches.append((self._name, options))

        return launch


@pytest.mark.parametrize(("chunks", "requests"), [(None, None), (128, 168)])
def test_register_caps_reach_each_partials_launch(
    chunks: int | None, requests: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PARTIALS_MAXNREG caps the by-chunk kernel's registers a thread and REQUEST_MAXNREG the by-request one's (the
    launch option `maxnreg`); unset, no cap is asked for. The kernels are recorded, not run (the CPU has none)."""
    launches: list[tuple[str, dict[str, Any]]] = []
    monkeypatch.setattr(
        segment_launch,
        "_kernels",
        lambda: (_LaunchRecorder("chunks", launches), _LaunchRecorder("merge", launches)),
    )
    monkeypatch.setattr(segment_launch, "_request_kernel", lambda: _LaunchRecorder("request", launches))
    monkeypatch.setattr(segment_launch, "_rotate_kernel", lambda: _LaunchRecorder("rotate", launches))
    monkeypatch.setattr(segment_launch, "PARTIALS_MAXNREG", chunks)
    monkeypatch.setattr(segment_launch, "REQUEST_MAXNREG", requests)
    rotary = rotary_for("default", "cpu")
    s = scenario(rotary, 4, 2, torch.float32, "cpu")
    for by_request in (False, True):
        plan = SegmentPlan.build(s.batch, 2, 2, torch.device("cpu"), 1, by_request=by_request)
        SegmentAttention(plan, rotary)(s.q, s.arena, s.pool, SCALE)
    caps = {name: {o.get("maxnreg") for n, o in launches if n == name} for name in ("chunks", "request")}
    assert caps == {"chunks": {chunks}, "request": {requests}}
    assert all("maxnreg" not in o for n, o in launches if n in ("merge", "rotate"))
    if chunks is None:
        assert all("maxnreg" not in o for _, o in launches)


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or INTERPRETER or torch.cuda.is_available(),
    reason="a CPU check: needs triton importable, no interpreter, no CUDA",
)
def test_a_register_cap_compiles_into_the_partials_kernel() -> None:
    """`maxnreg` reaches ptxas as the kernel's .maxnreg directive (sm_90, 64 query items, 8 warps)."""
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from service.engine import _segment_kernel

    kernel = _segment_kernel.segment_partials_kernel
    pointers = {"q_ptr": "bf16", "kv_ptr": "bf16", "cos_ptr": "fp32", "sin_ptr": "fp32", "out_ptr": "bf16"}
    pointers |= {"lse_ptr": "fp32", "tiles_ptr": "i64", "count_ptr": "i64", "q_rows_ptr": "i64"}
    pointers |= {"pair_q_ptr": "i64", "pair_visible_ptr": "i64"}
    constants = {"group": 7, "head_dim": 128, "dim_p2": 128, "block_m": 64, "block_n": 64, "ieee": False}
    constants |= {"prerotated": True, "kv_desc": None}
    source = ASTSource(kernel, _signature(kernel.arg_names, pointers, {"qk_scale": "fp32"}, constants), constants)
    options = {"num_warps": 8, "maxnreg": 128}
    ptx = triton_compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
    assert ".maxnreg 128" in ptx


@pytest.mark.gpu
@NEEDS_KERNELS
@pytest.mark.parametrize(
    ("programs", "prerotate", "descriptors"), [(None, False, False), (2, False, False), (2, True, True)]
)
def test_one_padded_plan_replays_two_batches_and_zeroes_dead_rows(
    programs: int | None, prerotate: bool, descriptors: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a program per tile, and with two programs per KV head looping over every live tile; and with every
    padded entry rotated before the partials, K/V through a descriptor."""
    monkeypatch.setattr(segment_launch, "PADDED_PROGRAMS", programs)
    monkeypatch.setattr(segment_launch, "PREROTATE", prerotate)
    monkeypatch.setattr(segment_launch, "KV_DESCRIPTORS", descriptors)
    device = torch.device(KERNEL_DEVICE)
    batches = [random_batch(requests=6, chunks=5, reads=3, seed=3)[0], random_batch(4, 5, 2, seed=4)[0]]
    assert_one_plan_replays(batches, lambda b: host_layout(b, 7, 2, 2, CAPACITY), CAPACITY.rows, device)


def test_a_layout_loaded_into_a_padded_plan_gives_the_plan_built_for_its_batch() -> None:
    """What a graph's captured plan takes each step: one batch's host layout loaded into a plan built for another
    holds, field by field, the plan built for it; a layout of another shape is refused and changes nothing."""
    cpu = torch.device("cpu")
    first, second = random_batch(requests=6, chunks=5, reads=3, seed=3)[0], random_batch(4, 5, 2, seed=4)[0]
    static = SegmentPlan.upload(host_layout(first, 7, 2, 2, CAPACITY), cpu)
    static.load(host_layout(second, 7, 2, 2, CAPACITY))
    built = SegmentPlan.build(second, 7, 2, cpu, 2, CAPACITY)
    fields = ("q_rows", "q_positions", "pair_q", "pair_visible", "row_ptr", "row_parts", "row_tail", "segments")
    assert all(torch.equal(getattr(static, name), getattr(built, name)) for name in (*fields, "counts"))
    launches = zip((*static.chunks, *static.tails), (*built.chunks, *built.tails), strict=True)
    assert all(torch.equal(a.tiles, b.tiles) and torch.equal(a.count, b.count) for a, b in launches)
    assert static.reach == built.reach == second.reach() != first.reach()
    before = static.flat.clone()
    other = PlanCapacity(rows=16, entries=96, pairs=120, chunk_tiles=24, tail_tiles=16)
    with pytest.raises(ValueError, match="different capacities"):
        static.load(host_layout(first, 7, 2, 2, other))
    assert torch.equal(static.flat, before) and static.reach == built.reach


def assert_one_plan_replays(
    batches: Sequence[SegmentBatch], layout: Callable[[SegmentBatch], HostLayout], rows: int, device: torch.device
) -> None:
    """The CUDA-graph shape: a plan padded to a capacity (`layout`), each batch's host layout loaded into its
    tensors in place and the same call object refreshed: each batch gets its own reference answer (GQA 7, yarn
    RoPE); the padding rows of the `rows` queries come out zero."""
    rotary = rotary_for("yarn", KERNEL_DEVICE)
    gen = torch.Generator().manual_seed(5)
    arena = torch.randn((2, 2, 400, HEAD_DIM), generator=gen).to(KERNEL_DEVICE)
    pool = torch.randn((2, 2, 100, HEAD_DIM), generator=gen).to(KERNEL_DEVICE)
    q = torch.randn((rows, 14, HEAD_DIM), generator=gen).to(KERNEL_DEVICE)
    static = SegmentPlan.upload(layout(batches[0]), device)
    attend = SegmentAttention(static, rotary)
    for batch in batches:
        static.load(layout(batch))
        attend.refresh()
        got = attend(q, arena, pool, SCALE)
        live = len(batch.rows)
        want = reference_attention(q[:live], batch, arena, pool, rotary, SCALE)
        assert (got[:live] - want).abs().max().item() < 2e-5
        assert (got[live:] == 0).all()


# Where CUDA exists the kernels run for real (above); the ahead-of-time API also differs between triton versions.
@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or INTERPRETER or torch.cuda.is_available(),
    reason="a CPU check: needs triton importable, no interpreter, no CUDA",
)
@pytest.mark.parametrize("dtype", ("bf16", "fp16", "fp32"))
def test_kernels_compile_for_an_h100_without_one(dtype: str) -> None:
    """Ahead-of-time compilation for sm_90 (ptxas ships with triton): catches what the interpreter lets through
    (globals a jitted function may not read, types the GPU compiler refuses) on a machine with no GPU."""
    from service.engine import _segment_kernel

    pointers = {"q_ptr": dtype, "kv_ptr": dtype, "cos_ptr": "fp32", "sin_ptr": "fp32", "out_ptr": dtype}
    pointers |= {"lse_ptr": "fp32", "tiles_ptr": "i64", "count_ptr": "i64", "q_rows_ptr": "i64", "pair_q_ptr": "i64"}
    pointers |= {"pair_visible_ptr": "i64"}
    for block_m, prerotated, described in (
        (16, False, False),
        (32, False, False),
        (64, False, False),
        (64, True, True),
    ):
        constants = {"group": 7, "head_dim": 128, "dim_p2": 128, "block_m": block_m, "block_n": 64}
        constants |= {"ieee": dtype == "fp32", "prerotated": prerotated}
        # KV_DESCRIPTORS: K/V tiles through a tensor descriptor (TMA on sm_90), else no descriptor (None).
        descriptor = {"kv_desc": f"tensordesc<{dtype}[64, 128]>"} if described else {}
        constants |= {} if described else {"kv_desc": None}
        kernel = _segment_kernel.segment_partials_kernel
        floats = {"qk_scale": "fp32", **descriptor}
        assert compiles_for_sm90(kernel, pointers, floats, constants, segment_launch._warps(block_m))
    rotate = _segment_kernel.rotate_entries_kernel
    pointers = {"q_ptr": dtype, "cos_ptr": "fp32", "sin_ptr": "fp32", "q_rows_ptr": "i64", "out_ptr": dtype}
    assert compiles_for_sm90(rotate, pointers, {}, {"head_dim": 128, "dim_p2": 128, "block_e": 16})
    merge = _segment_kernel.segment_merge_kernel
    pointers = {"part_out_ptr": dtype, "part_lse_ptr": "fp32", "out_ptr": dtype}
    pointers |= {"row_ptr_ptr": "i64", "row_parts_ptr": "i64", "row_tail_ptr": "i64"}
    constants = {"head_dim": 128, "dim_p2": 128, "block_h": 8}
    assert compiles_for_sm90(merge, pointers, {"context_scale": "fp32"}, constants)


def compiles_for_sm90(
    kernel: Any, pointers: dict[str, str], floats: dict[str, str], constants: dict[str, object], warps: int = 4
) -> bool:
    """Whether `kernel` compiles ahead of time to an sm_90 cubin (`_signature`'s kinds; `warps` per program)."""
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = _signature(kernel.arg_names, pointers, floats, constants)
    source = ASTSource(kernel, signature, constants)
    return bool(triton_compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}).asm["cubin"])


def _signature(
    names: list[str], pointers: dict[str, str], floats: dict[str, str], constants: dict[str, object]
) -> dict[str, str]:
    """Triton's signature of a kernel: pointer element types, fp32 scalars, constexprs, i32 for the rest."""
    kinds = {name: f"*{kind}" for name, kind in pointers.items()} | floats
    return {name: "constexpr" if name in constants else kinds.get(name, "i32") for name in names}


@pytest.mark.parametrize("arch", ("llama", "qwen2", "mistral"))
@pytest.mark.parametrize("positions", ("reordered", "composite"))
def test_reference_equals_attention_over_the_engines_own_stitched_buffers(
    get_engine: Callable[[str, str], StitchEngine], arch: str, positions: str
) -> None:
    """Real layouts end to end: a tiny model's precomputed chunk KV (keys un-roped, kv_layout), each chunk rotated
    once at local positions into an arena; two requests reading the chunks in different orders are stitched by the
    engine (its rotary: llama3 scaling for llama) and their questions prefilled. Segment attention over (arena,
    prefix + question as the tail) equals plain attention over each stitched buffer, for every layer."""
    engine = get_engine(arch, "cpu")
    rotary, spec = engine.forward.rotary, engine.spec
    chunk_ids = synthetic_ids(engine, [9, 14, 6], seed=11)
    kv = engine.precompute([engine.template.chunk_block(ids) for ids in chunk_ids])
    question = synthetic_ids(engine, [5], seed=12)[0]
    base, rows = 3, 3  # local positions base..; the last 3 question tokens are the query rows
    for layer in range(spec.num_layers):
        arena, chunks = _arena_of(kv, layer, rotary, base)
        for order in ((0, 1, 2), (2, 0)):
            buffer, plan = engine.stitch([kv[c] for c in order], positions, room=len(question))
            engine.prefill_question(buffer, question)
            prefix = plan.lengths[0]
            segments = tuple(Segment(c, plan.starts[i + 1]) for i, c in enumerate(order))
            # The tail: the prefix's slots, then the question's (keys at absolute positions, as the buffer holds them).
            live = buffer.data[layer, :, :, : buffer.length]
            tail_kv = torch.cat((live[:, :, :prefix], live[:, :, plan.context_tokens :]), dim=2)
            pool = torch.full((2, spec.num_kv_heads, tail_kv.shape[2] + 4, spec.head_dim), float("nan"))
            pool[:, :, 2 : 2 + tail_kv.shape[2]] = tail_kv
            request = RequestSegments(segments, Tail(2, tail_kv.shape[2]))
            first = buffer.next_position - rows
            batch = SegmentBatch(chunks, (request,), (0,) * rows, tuple(range(first, first + rows)))
            q = torch.randn((rows, spec.num_heads, spec.head_dim), generator=torch.Generator().manual_seed(layer))
            scale = spec.head_dim**-0.5
            got = reference_attention(q, batch, arena, pool, rotary, scale)
            q_rot = rotary.rotate(q.transpose(0, 1), torch.arange(first, first + rows)).unsqueeze(0)
            keys, values = live[0].unsqueeze(0), live[1].unsqueeze(0)
            want = attend_causal_end(q_rot, keys, values, scale)[0]
            assert (got - want).abs().max().item() < 2e-5


def _arena_of(kv: list[KVBlock], layer: int, rotary: Rotary, base: int) -> tuple[torch.Tensor, tuple[ChunkRange, ...]]:
    """One layer's arena: every chunk's keys rotated once at local positions base.., values as stored, NaN between."""
    _, _, heads, _, dim = kv[0].kv.shape
    arena = torch.full((2, heads, sum(b.num_tokens + 5 for b in kv), dim), float("nan"))
    chunks, start = [], 1
    for block in kv:
        n = block.num_tokens
        arena[0, :, start : start + n] = rotary.rotate(block.kv[layer, 0], torch.arange(base, base + n))
        arena[1, :, start : start + n] = block.kv[layer, 1]
        chunks.append(ChunkRange(start, n, base))
        start += n + 5
    return arena, tuple(chunks)
