"""A recompute's attention without a mask tensor: queries at scattered slots, each causal over the slots before it.

`attention.attend_at_slots` gives torch's SDPA a boolean mask [T, keys]; SDPA's masked kernels read it and run at
a fraction of the flash kernels' rate, and the recompute's attention was a third of its time on the GPU. Here one
Triton kernel (`_slot_kernel.py`) reads the ascending slots themselves: a program takes a block of consecutive
queries times the query heads of one KV head, loads each K/V tile up to the block's last slot once for all of
them, and masks only the tiles past the block's first slot.

It runs on CUDA with triton once a probe on random data agrees with masked SDPA for the model's head shape and
dtype (`slot_kernel_usable`); elsewhere the recompute keeps `attend_at_slots`.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any

import torch
import torch.nn.functional as F

from service.engine.fused_stitch import LOG2E, next_power_of_2, triton_runs_on

log = logging.getLogger(__name__)

# False: masked SDPA everywhere (kept so benchmarks can measure what the kernel buys).
ENABLED = True
# Items (query, head) a program holds and keys per K/V tile, Triton's warps and pipeline stages (None: its
# default): module-level so a benchmark can try others.
BLOCK_ITEMS = 128
BLOCK_N = 64
NUM_WARPS = 8
NUM_STAGES: int | None = None
# Largest |kernel - masked SDPA| the probe accepts (bf16 outputs of unit-scale inputs differ by a few ulps).
_PROBE_TOLERANCE = 2e-2


@functools.cache
def _kernel() -> Any:
    from service.engine import _slot_kernel

    return _slot_kernel.slot_attention_kernel


def attend_slots_kernel(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, scale: float
) -> torch.Tensor:
    """`attend_at_slots`'s result by the kernel: q [1, Hq, T, D] for tokens at `slots` [T] (ascending) over one
    layer's keys and values [Hkv, Tk, D] (the same strides, unit stride on D); returns [1, T, Hq, D]."""
    _, heads, tokens, dim = q.shape
    kv_heads = keys.shape[0]
    if heads % kv_heads or keys.stride() != values.stride() or keys.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("slot attention needs whole query groups and keys/values of one unit-stride layout")
    group = heads // kv_heads
    block_q = max(1, BLOCK_ITEMS // group)
    out = torch.empty((1, tokens, heads, dim), dtype=q.dtype, device=q.device)
    if tokens == 0:
        return out
    grid = (-(-tokens // block_q), kv_heads)
    _kernel()[grid](
        q,
        keys,
        values,
        slots,
        out,
        tokens,
        q.stride(2),
        q.stride(1),
        keys.stride(0),
        keys.stride(1),
        out.stride(1),
        out.stride(2),
        scale * LOG2E,
        group=group,
        head_dim=dim,
        dim_p2=next_power_of_2(dim),
        block_q=block_q,
        block_m=next_power_of_2(block_q * group),
        block_n=BLOCK_N,
        ieee=keys.dtype == torch.float32,
        num_warps=NUM_WARPS,
        **({} if NUM_STAGES is None else {"num_stages": NUM_STAGES}),
    )
    return out


def reference_at_slots(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, scale: float
) -> torch.Tensor:
    """The same attention by masked SDPA in fp32 (the probe's and the tests' reference): [1, T, Hq, D]. Keys
    past the last slot are cut off, not masked: a masked NaN would still poison SDPA's sums."""
    group = q.shape[1] // keys.shape[0]
    end = int(slots.max()) + 1
    k = keys[:, :end].float().repeat_interleave(group, dim=0).unsqueeze(0)
    v = values[:, :end].float().repeat_interleave(group, dim=0).unsqueeze(0)
    visible = torch.arange(end, device=q.device).unsqueeze(0) <= slots.unsqueeze(1)
    out = F.scaled_dot_product_attention(q.float(), k, v, attn_mask=visible, scale=scale)
    return out.transpose(1, 2).to(q.dtype)


_PROBED: dict[tuple[str, torch.dtype, int, int, int], bool] = {}


def slot_kernel_usable(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether the recompute uses the kernel for this head shape: it runs here and agrees with masked SDPA on a
    random probe (probed once per shape; a refusing compiler or a wrong answer only means "keep SDPA")."""
    if not ENABLED:
        return False
    key = (str(device), dtype, heads, kv_heads, head_dim)
    if key not in _PROBED:
        _PROBED[key] = triton_runs_on(device) and _probe_agrees(device, dtype, heads, kv_heads, head_dim)
    return _PROBED[key]


@torch.inference_mode()
def _probe_agrees(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> bool:
    try:
        diff = _probe(device, dtype, heads, kv_heads, head_dim)
    except Exception as err:  # a missing compiler or an unsupported shape only means "keep SDPA"
        log.info("recompute slot-attention kernel unavailable (%s); masked SDPA", err)
        return False
    if not diff <= _PROBE_TOLERANCE:
        log.warning("recompute slot-attention kernel differs from SDPA by %.4f; masked SDPA", diff)
        return False
    return True


def _probe(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> float:
    """Largest |kernel - reference| over scattered slots that start at 0 and at a tile edge, in a buffer whose
    dead tail (past the last slot) holds huge values the kernel must never read into a result."""
    generator = torch.Generator(device=device).manual_seed(0)
    capacity, live = 640, 600
    kv = torch.randn((2, kv_heads, capacity, head_dim), generator=generator, device=device).to(dtype)
    kv[:, :, live:] = 1e4
    worst = 0.0
    for picks in (torch.arange(0, live, 3, device=device), torch.arange(63, live, 7, device=device)):
        q = torch.randn((1, heads, picks.numel(), head_dim), generator=generator, device=device).to(dtype)
        got = attend_slots_kernel(q, kv[0], kv[1], picks, head_dim**-0.5)
        want = reference_at_slots(q, kv[0], kv[1], picks, head_dim**-0.5)
        worst = max(worst, float((got.float() - want.float()).abs().max()))
    return worst if math.isfinite(worst) else math.inf
