"""Attention kernels: flash-attn when it imports and fits, torch SDPA otherwise.

One shape of attention covers the whole engine: the queries are the last `Tq` of `Tk` keys and see every key up
to their own position ("causal, aligned to the end"). Precompute is the case Tq == Tk (right-padded batches
stay exact because padding only ever follows real tokens); question prefill over a stitched cache is Tq < Tk;
a decode step is Tq == 1.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F


def _import_flash() -> Callable[..., Any] | None:
    try:
        module = importlib.import_module("flash_attn")
    except Exception:  # flash-attn is optional; any import failure means "not available"
        return None
    return getattr(module, "flash_attn_func", None)


_FLASH_ATTN_FUNC = _import_flash()


def flash_available() -> bool:
    """Whether the flash-attn package imported in this process."""
    return _FLASH_ATTN_FUNC is not None


def backend_for(q: torch.Tensor) -> str:
    """The kernel `attend_causal_end` will use for tensors like q."""
    if _FLASH_ATTN_FUNC is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        return "flash_attn"
    return "sdpa"


def _end_aligned_mask(tq: int, tk: int, device: torch.device) -> torch.Tensor:
    """Bool [Tq, Tk]: query i may see key j iff j <= (Tk - Tq) + i."""
    rows = torch.arange(tq, device=device).unsqueeze(1) + (tk - tq)
    cols = torch.arange(tk, device=device).unsqueeze(0)
    return cols <= rows


def attend_causal_end(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of q [B, Hq, Tq, D] over k, v [B, Hkv, Tk, D], end-aligned causal; returns [B, Tq, Hq, D]."""
    tq, tk = q.shape[-2], k.shape[-2]
    if tq > tk:
        raise ValueError(f"{tq} queries cannot be the tail of {tk} keys")
    if backend_for(q) == "flash_attn":
        assert _FLASH_ATTN_FUNC is not None
        # flash-attn >= 2.1 aligns the causal mask to the bottom-right corner, which is exactly this shape.
        out = _FLASH_ATTN_FUNC(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True, softmax_scale=scale
        )
        return out  # type: ignore[no-any-return]
    gqa = q.shape[1] != k.shape[1]
    if tq == 1:
        out = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa)
    elif tq == tk:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        mask = _end_aligned_mask(tq, tk, q.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2)
