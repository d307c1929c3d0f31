"""A layer's new tokens into the KV buffer: keys rotated to their positions, keys and values stored at their slots.

`LeanForward.layers_static` does this with torch's elementwise kernels, seven a layer (the fp32 copy, the product
with cos, the roll, the sum with the signed sin, the cast, two index copies), each tiny at a decode step's size and
each a kernel node of the step's graph. `rotate_and_write` does the same in one Triton kernel, in the same fp32
order (FP fusion off), where `FUSED_KV_WRITE` is on and the kernels run on the device; the queries it rotates too
where the caller's attention wants them rotated (`first` = 0).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from service.engine.fused_stitch import next_power_of_2, triton_runs_on

# Module-level so a benchmark can compare (and `random_engine`'s BENCH_ENGINE_CONSTANTS); on: measured faster
# through the gateway (§13.14).
FUSED_KV_WRITE = True
_BLOCK_T = 16  # tokens a program takes


@functools.cache
def _kernel() -> Any:
    from service.engine import _kv_write_kernel

    return _kv_write_kernel.rotate_write_kernel


def applies(device: torch.device) -> bool:
    """Whether `rotate_and_write` serves layers on `device`: the flag is on and the kernels run there."""
    return FUSED_KV_WRITE and triton_runs_on(device)


def rotate_and_write(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slots: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    first: int,
    num_heads: int,
) -> torch.Tensor | None:
    """qkv [T, Hq + 2 Hkv, D] (unit stride on D): keys rotated by cos/sin [T, D] (fp32, the model's own, sin
    unsigned) into keys [Hkv, slots, D] at `slots` [T], values into values alike; with `first` = 0 the queries
    rotated too, returned [T, Hq, D] (else None: `first` = Hq, the caller's attention rotates them)."""
    tokens, heads, dim = qkv.shape
    kv_heads = (heads - num_heads) // 2
    if first not in (0, num_heads) or qkv.stride(-1) != 1 or keys.stride(-1) != 1 or values.stride() != keys.stride():
        raise ValueError("rotate_and_write: first is 0 or Hq, and every tensor has unit stride on the head size")
    q_out = torch.empty((tokens, num_heads, dim), dtype=qkv.dtype, device=qkv.device) if first == 0 else None
    if tokens == 0:
        return q_out
    target = q_out if q_out is not None else keys  # a pointer the kernel never writes through when first = Hq
    _kernel()[(-(-tokens // _BLOCK_T), heads - first)](
        qkv,
        cos,
        sin,
        slots,
        target,
        keys,
        values,
        tokens,
        qkv.stride(0),
        qkv.stride(1),
        cos.stride(0),
        target.stride(0),
        target.stride(1),
        keys.stride(0),
        keys.stride(1),
        first=first,
        num_heads=num_heads,
        num_kv_heads=kv_heads,
        head_dim=dim,
        dim_p2=next_power_of_2(dim),
        block_t=_BLOCK_T,
        num_warps=4,
        enable_fp_fusion=False,
    )
    return q_out
