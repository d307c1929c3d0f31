"""8-bit stored forms of a block's KV: half the bytes of bf16 on disk, in the host pool and over PCIe.

A block `[layers, 2, kv_heads, tokens, head_dim]` is stored as one 8-bit tensor of the same shape plus float32
scales, and turned back into the compute dtype on the device after the H2D copy, so the copy also moves half
the bytes. Two schemes:

- `int8`: symmetric int8. Keys get one scale per (layer, head, channel), taken over the block's tokens: pre-RoPE
  keys have a few outlier channels (large in every token), which a per-token scale would let crush all the
  other channels of that token. Values get one scale per (layer, head, token), over the channels: values have
  no channel outliers, and a token with a large value vector then costs only itself precision.
- `fp8`: float8 e4m3 with one scale per (layer, k/v, head). Floating point keeps relative precision for small
  and large entries alike, so coarse scales suffice, but e4m3 has 3 mantissa bits against int8's ~7 bits at the
  top of a channel's range.

int8 with these scales stays inside the bf16 gate's bound where fp8, a few times further from the bf16 logits,
would fail it (tests/kvcache/test_kv_quant.py checks the order), so int8 is the recommended form.
Scales are float32 (a few KB per block), stored after the 8-bit payload; a zero-range group gets scale 1 so
dequantisation never divides by or multiplies with anything odd. Non-finite KV cannot be stored 8-bit (the
writer refuses it; the block is then kept native in memory and not written).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

DiskFormat = Literal["native", "int8", "fp8"]
DISK_FORMATS: tuple[DiskFormat, ...] = ("native", "int8", "fp8")
QUANT_FORMATS: tuple[DiskFormat, ...] = ("int8", "fp8")
SCALE_DTYPE = torch.float32
INT8_MAX = 127.0
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448


def storage_dtype(fmt: DiskFormat) -> torch.dtype:
    """The dtype of the 8-bit payload of a quantised form."""
    if fmt == "int8":
        return torch.int8
    if fmt == "fp8":
        return FP8_DTYPE
    raise ValueError(f"{fmt!r} is not an 8-bit form")


def scale_count(fmt: DiskFormat, shape: tuple[int, ...]) -> int:
    """How many float32 scales a block of this KV shape carries in this form."""
    layers, _, heads, tokens, dim = shape
    if fmt == "int8":
        return layers * heads * (dim + tokens)  # keys per channel, then values per token
    if fmt == "fp8":
        return layers * 2 * heads
    raise ValueError(f"{fmt!r} is not an 8-bit form")


@dataclass(frozen=True)
class QuantizedKV:
    """One block's 8-bit KV and its scales (on any device), and the dtype it dequantises to."""

    fmt: DiskFormat
    data: torch.Tensor  # [layers, 2, kv_heads, tokens, head_dim] of `storage_dtype(fmt)`
    scales: torch.Tensor  # flat float32, `scale_count(fmt, data.shape)` of them
    compute_dtype: torch.dtype

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scales.numel() * self.scales.element_size()


def quantize(kv: torch.Tensor, fmt: DiskFormat) -> QuantizedKV:
    """The 8-bit form of a block's KV (computed in float32 on the tensor's device)."""
    if kv.dim() != 5 or kv.shape[1] != 2:
        raise ValueError(f"KV of shape {tuple(kv.shape)} is not in the 5-axis block layout")
    x = kv.detach().float()
    if not bool(torch.isfinite(x).all()):
        raise ValueError("non-finite KV cannot be stored in an 8-bit form")
    if fmt == "int8":
        key_scale = _scale(x[:, 0].abs().amax(dim=2), INT8_MAX)  # [L, H, D]: over tokens
        value_scale = _scale(x[:, 1].abs().amax(dim=3), INT8_MAX)  # [L, H, T]: over channels
        scales = torch.cat([key_scale.reshape(-1), value_scale.reshape(-1)])
        data = torch.empty(kv.shape, dtype=torch.int8, device=kv.device)
        data[:, 0] = (x[:, 0] / key_scale[:, :, None, :]).round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
        data[:, 1] = (x[:, 1] / value_scale[:, :, :, None]).round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    elif fmt == "fp8":
        head_scale = _scale(x.abs().amax(dim=(3, 4)), FP8_MAX)  # [L, 2, H]
        data = (x / head_scale[:, :, :, None, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        scales = head_scale.reshape(-1)
    else:
        raise ValueError(f"{fmt!r} is not an 8-bit form")
    return QuantizedKV(fmt, data, scales.to(SCALE_DTYPE).contiguous(), kv.dtype)


def _scale(amax: torch.Tensor, top: float) -> torch.Tensor:
    """Scale mapping each group's largest magnitude to the top code; 1 for an all-zero group."""
    return torch.where(amax > 0, amax / top, torch.ones_like(amax))


def dequantize(q: QuantizedKV) -> torch.Tensor:
    """The block's KV in its compute dtype, on the device `q` lives on (float32 arithmetic, one rounding)."""
    layers, _, heads, tokens, dim = q.data.shape
    x = q.data.float()
    if q.fmt == "int8":
        split = layers * heads * dim
        key_scale = q.scales[:split].view(layers, heads, 1, dim)
        value_scale = q.scales[split:].view(layers, heads, tokens, 1)
        x[:, 0] *= key_scale
        x[:, 1] *= value_scale
    elif q.fmt == "fp8":
        x *= q.scales.view(layers, 2, heads, 1, 1)
    else:
        raise ValueError(f"{q.fmt!r} is not an 8-bit form")
    return x.to(q.compute_dtype)


def stored_nbytes(fmt: DiskFormat, shape: tuple[int, ...], native_element_size: int) -> int:
    """Bytes of a block's payload in a form (the 8-bit data and its scales; native: the tensor)."""
    if fmt == "native":
        return math.prod(shape) * native_element_size
    return payload_nbytes(fmt, shape)


# ---- the stored payload: 8-bit data, zero padding, scales -------------------------------------------------

# The scales start on a page boundary after the data, so the data stays a whole-page prefix of the payload and
# the float32 scales are aligned wherever the (page-aligned) payload lands: a host slot, a device copy.
PAYLOAD_ALIGNMENT = 4096


def scales_offset(shape: tuple[int, ...]) -> int:
    """Where the scales start in a quantised payload: the 8-bit data's size rounded up to whole pages."""
    return -(-math.prod(shape) // PAYLOAD_ALIGNMENT) * PAYLOAD_ALIGNMENT


def payload_nbytes(fmt: DiskFormat, shape: tuple[int, ...]) -> int:
    """Bytes of a quantised block's stored payload: data, padding, scales."""
    return scales_offset(shape) + scale_count(fmt, shape) * SCALE_DTYPE.itemsize


def pack(q: QuantizedKV) -> torch.Tensor:
    """The payload bytes of a quantised block as one flat uint8 CPU tensor (data, zero padding, scales)."""
    shape = tuple(q.data.shape)
    flat = torch.zeros(payload_nbytes(q.fmt, shape), dtype=torch.uint8)
    data = q.data.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    flat[: data.numel()] = data
    flat[scales_offset(shape) :] = q.scales.detach().to("cpu", SCALE_DTYPE).contiguous().view(torch.uint8)
    return flat


def unpack(flat: torch.Tensor, fmt: DiskFormat, shape: tuple[int, ...], compute_dtype: torch.dtype) -> QuantizedKV:
    """Views of a payload's data and scales (no copy), on whatever device `flat` lives."""
    n, offset, count = math.prod(shape), scales_offset(shape), scale_count(fmt, shape)
    if flat.dtype != torch.uint8 or flat.dim() != 1 or flat.numel() < offset + count * SCALE_DTYPE.itemsize:
        raise ValueError(f"a flat uint8 payload of {payload_nbytes(fmt, shape)} bytes is needed for {shape}")
    data = flat[:n].view(storage_dtype(fmt)).view(shape)
    scales = flat[offset : offset + count * SCALE_DTYPE.itemsize].view(SCALE_DTYPE)
    return QuantizedKV(fmt, data, scales, compute_dtype)
