"""`kv_write`: a layer's new keys rotated and its keys and values stored at their slots in one Triton kernel, the
same numbers as `LeanForward.layers_static`'s torch kernels.

The kernel runs on CUDA, or on the CPU under Triton's interpreter (TRITON_INTERPRET=1 with triton importable); the
CPU's own runs never take it (no GPU, `kv_write.applies` is False), which the last test checks.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import pytest
import torch

from service.engine import kv_write
from service.engine.batch_decode import LOOP, BatchDecoder, DecodeRows
from service.engine.engine import StitchEngine
from service.engine.kv_layout import KEYS, VALUES
from service.engine.kv_pool import KVPool
from tests.test_engine_segment_attention import (
    HEAD_DIM,
    INTERPRETER,
    KERNEL_DEVICE,
    NEEDS_KERNELS,
    compiles_for_sm90,
    rotary_for,
)
from tests.test_engine_shared_decode import nan_pool

HEADS, KV_HEADS, SLOTS = 6, 2, 64


def torch_write(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slots: torch.Tensor,
    data: torch.Tensor,
    first: int,
) -> torch.Tensor:
    """`layers_static`'s torch kernels, as they are there: the rotated queries ([T, Hq, D], first = 0) or keys."""
    half = HEAD_DIM // 2
    signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).unsqueeze(1)
    qk = qkv[:, first : HEADS + KV_HEADS].float()
    qk = torch.addcmul(qk * cos.unsqueeze(1), qk.roll(half, dims=-1), signed_sin).to(qkv.dtype)
    data[KEYS].index_copy_(1, slots, qk[:, HEADS - first :].transpose(0, 1))
    data[VALUES].index_copy_(1, slots, qkv[:, HEADS + KV_HEADS :].transpose(0, 1))
    return qk[:, :HEADS]


@pytest.mark.gpu
@NEEDS_KERNELS
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16))
@pytest.mark.parametrize("rope", ("default", "llama3", "yarn"))
@pytest.mark.parametrize("first", (0, HEADS))
@pytest.mark.parametrize("tokens", (1, 37))
def test_one_kernel_writes_what_torchs_kernels_write(
    dtype: torch.dtype, rope: str, first: int, tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Strided qkv (a slice of a wider projection), scattered slots in a NaN-filled buffer: the same keys and values
    at those slots (keys rotated by the model's own tables, yarn's factor included), every other slot untouched;
    the rotated queries where asked for (first = 0)."""
    gen = torch.Generator().manual_seed(tokens + first)
    rotary = rotary_for(rope, KERNEL_DEVICE)
    wide = torch.randn((tokens, HEADS + 2 * KV_HEADS + 3, HEAD_DIM), generator=gen).to(KERNEL_DEVICE, dtype)
    qkv = wide[:, : HEADS + 2 * KV_HEADS]
    positions = torch.randint(0, 4000, (tokens,), generator=gen).to(KERNEL_DEVICE)
    cos, sin = rotary.cos_sin(positions)
    slots = torch.randperm(SLOTS, generator=gen)[:tokens].to(KERNEL_DEVICE)
    want = torch.full((2, KV_HEADS, SLOTS, HEAD_DIM), float("nan"), dtype=dtype, device=KERNEL_DEVICE)
    got = want.clone()
    want_q = torch_write(qkv, cos, sin, slots, want, first)
    got_q = kv_write.rotate_and_write(qkv, cos, sin, slots, got[KEYS], got[VALUES], first, HEADS)
    written = torch.zeros(SLOTS, dtype=torch.bool)
    written[slots.cpu()] = True
    assert torch.isnan(got[:, :, ~written.to(KERNEL_DEVICE)]).all()  # no other slot touched
    assert torch.equal(got[VALUES][:, written], want[VALUES][:, written])  # copied as they are
    # Same fp32 order (x * cos, then + partner * signed sin, no fused multiply-add), one cast: equal, or one unit
    # in the last place where a platform's torch fused the sum anyway.
    ulp = {torch.float32: 2e-6, torch.float16: 2e-3}[dtype]
    keys_got, keys_want = got[KEYS][:, written], want[KEYS][:, written]
    assert float((keys_got.float() - keys_want.float()).abs().max()) <= ulp * 4
    if first == 0:
        assert got_q is not None and got_q.shape == (tokens, HEADS, HEAD_DIM)
        assert float((got_q.float() - want_q.float()).abs().max()) <= ulp * 4
    else:
        assert got_q is None
    # Keys moved by a wrong angle differ by the size of the values themselves (~1): the check can fail.
    assert float((keys_got.float() - qkv[:, HEADS : HEADS + KV_HEADS].transpose(0, 1).float()).abs().max()) > 0.1


def step_twice(
    engine: StitchEngine, switch_on: Callable[[], None]
) -> tuple[torch.Tensor, torch.Tensor, KVPool, KVPool]:
    """One batched decode step (the loop attention) over two pools holding the same random K/V: first with torch's
    kernels, then after `switch_on()`; both steps' logits and pools."""
    pools = [nan_pool(engine, 64), nan_pool(engine, 64)]
    filled = torch.randn(pools[0].data.shape, generator=torch.Generator().manual_seed(3)).to(pools[0].data)
    for pool in pools:
        pool.data.copy_(filled)
    rows = DecodeRows.build([5, 17], [30, 12], [(0, 20), (30, 9)], engine.spec.device)
    plain = BatchDecoder(engine.forward, pools[0], LOOP).step(rows)
    switch_on()
    return plain, BatchDecoder(engine.forward, pools[1], LOOP).step(rows), pools[0], pools[1]


@pytest.mark.gpu
@NEEDS_KERNELS
def test_a_decode_step_through_the_kernel_equals_torchs(
    get_engine: Callable[[str, str], StitchEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batched decode step of a tiny model with `FUSED_KV_WRITE` on gives the logits and the K/V of the step with
    torch's kernels (fp32, the loop attention over the rotated queries)."""

    def switch_on() -> None:
        monkeypatch.setattr(kv_write, "FUSED_KV_WRITE", True)
        monkeypatch.setattr(kv_write, "triton_runs_on", lambda device: True)  # the CPU's interpreter too

    plain, one_kernel, torchs, mine = step_twice(get_engine("qwen2", KERNEL_DEVICE), switch_on)
    assert float((one_kernel - plain).abs().max()) <= 1e-5
    assert float((torchs.data - mine.data).abs().max()) <= 1e-5
    assert torch.equal(torchs.data.isnan(), mine.data.isnan())


def test_the_cpu_keeps_torchs_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_write, "FUSED_KV_WRITE", True)
    assert not kv_write.applies(torch.device("cpu"))
    monkeypatch.setattr(kv_write, "FUSED_KV_WRITE", False)
    assert not kv_write.applies(torch.device("cuda"))


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or INTERPRETER or torch.cuda.is_available(),
    reason="a CPU check: needs triton importable, no interpreter, no CUDA",
)
@pytest.mark.parametrize("dtype", ("bf16", "fp16", "fp32"))
@pytest.mark.parametrize("first", (0, 28))
def test_the_kernel_compiles_for_an_h100_without_one(dtype: str, first: int) -> None:
    """Qwen2-7B's shape: 28 query heads, 4 KV heads, head size 128."""
    from service.engine import _kv_write_kernel

    pointers = {"qkv_ptr": dtype, "cos_ptr": "fp32", "sin_ptr": "fp32", "slots_ptr": "i64", "q_out_ptr": dtype}
    pointers |= {"keys_ptr": dtype, "values_ptr": dtype}
    constants = {"first": first, "num_heads": 28, "num_kv_heads": 4, "head_dim": 128, "dim_p2": 128, "block_t": 16}
    assert compiles_for_sm90(_kv_write_kernel.rotate_write_kernel, pointers, {}, constants)
