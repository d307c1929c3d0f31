"""The merge of a split prefill attention's partials as one Triton kernel.

A prefill over a long context splits the context into key ranges (flash-decoding's split-KV, `attention.py`)
and merges the ranges' outputs and the question's own causal part by their log-sum-exp. In torch that merge is
~10 small fp32 kernels a layer (a concatenation of the partials, their cast, max, exp, products, sums, division),
each reading and writing the partials again; this kernel reads each partial once and writes the merged output,
in one launch a layer.

It applies where flash returns its flat log-sum-exp layout [heads, queries] on a CUDA device with triton;
elsewhere `attention.py` keeps torch's merge.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from service.engine.fused_stitch import next_power_of_2, triton_available

# False: torch's merge everywhere (kept so benchmarks can measure what the kernel buys).
ENABLED = True
# Heads a program merges: 8 heads x 128 dims = 1,024 fp32 accumulators over 4 warps.
_BLOCK_H = 8


@functools.cache
def _kernel() -> Any:
    from service.engine import _merge_kernel

    return _merge_kernel.merge_split_kernel


def fused_merge_applies(
    context_out: torch.Tensor, context_lse: torch.Tensor, own_out: torch.Tensor, own_lse: torch.Tensor, splits: int
) -> bool:
    """Whether `fused_merge` takes these partials: CUDA tensors with triton, fp32 log-sum-exps in flash's flat
    layout (context [heads, splits * tokens], own [heads, tokens]), outputs [queries, heads, dim] with unit dim
    stride."""
    if not (ENABLED and own_out.is_cuda and triton_available()):
        return False
    tokens, heads, dim = own_out.shape
    return (
        context_out.shape == (splits * tokens, heads, dim)
        and context_lse.shape == (heads, splits * tokens)
        and own_lse.shape == (heads, tokens)
        and context_lse.dtype == own_lse.dtype == torch.float32
        and context_lse.stride(1) == own_lse.stride(1) == 1
        and context_out.stride(2) == own_out.stride(2) == 1
    )


def fused_merge(
    context_out: torch.Tensor, context_lse: torch.Tensor, own_out: torch.Tensor, own_lse: torch.Tensor, splits: int
) -> torch.Tensor:
    """The merged attention [tokens, heads, dim] of `splits` context partials and the own partial (see
    `fused_merge_applies` for the layouts), in the outputs' dtype."""
    tokens, heads, dim = own_out.shape
    out = torch.empty_like(own_out)
    block_h = min(_BLOCK_H, 1 << (heads - 1).bit_length())
    grid = (tokens, -(-heads // block_h))
    _kernel()[grid](
        context_out,
        context_lse,
        own_out,
        own_lse,
        out,
        tokens,
        heads,
        context_out.stride(0),
        context_out.stride(1),
        own_out.stride(0),
        own_out.stride(1),
        out.stride(0),
        out.stride(1),
        context_lse.stride(0),
        own_lse.stride(0),
        splits=splits,
        head_dim=dim,
        dim_p2=next_power_of_2(dim),
        block_h=block_h,
        num_warps=4,
    )
    return out
