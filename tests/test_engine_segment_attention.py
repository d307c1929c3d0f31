"""Segment attention (segment_attention.py, segment_launch.py): shared chunks with RoPE deferred to the query.

The torch reference is held to plain attention over the stitched copy each request would get today (every chunk's
keys rotated at its absolute positions o + j, then the request's tail, causal), in fp32 on the CPU, for default,
llama3- and yarn-scaled RoPE (the models' own rotary modules), GQA, chunks shared by some requests and not others,
a chunk read at two offsets, a multi-row prefill, APE's temperature and scale, and NaN in every arena and pool slot
the call does not name. The Triton kernels are held to the reference on CUDA (bf16, fp16, fp32); on the CPU they run
under Triton's interpreter when the test run sets TRITON_INTERPRET=1 and triton imports (skipped otherwise).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import pytest
import torch
from transformers import LlamaConfig, PretrainedConfig, Qwen2Config
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

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

HEAD_DIM = 16
SCALE = HEAD_DIM**-0.5


def _config(rope: str) -> PretrainedConfig:
    common = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096}
    if rope == "llama3":
        scaling = {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        return LlamaConfig(**common, rope_scaling=scaling)
    if rope == "yarn":
        scaling = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 256}
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
            _rotated(rotary, s.raw_chunks[seg.chunk], list(range(seg.offset, seg.offset + s.raw_chunks[seg.chunk].shape[2])))
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


ROPES = ("default", "llama3", "yarn")


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


def test_math_sanity_of_the_direct_formula() -> None:
    """The float64 helper itself: two keys with scores 0 and log 3 weigh 1 : 3."""
    q = torch.tensor([[1.0] + [0.0] * (HEAD_DIM - 1)], dtype=torch.float64)
    kv = torch.zeros((2, 1, 2, HEAD_DIM))
    kv[0, 0, 1, 0] = math.log(3) / SCALE
    kv[1, 0, 0, 0], kv[1, 0, 1, 0] = 4.0, 8.0
    z, num = _exp_sums(q, [kv], SCALE)
    assert torch.allclose(num / z.unsqueeze(-1), torch.tensor([[7.0] + [0.0] * (HEAD_DIM - 1)], dtype=torch.float64))


INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
