"""Fused rotate-and-place: the whole stitch as one Triton launch per group of ready blocks.

The torch stitch issues per block and layer a handful of copies plus fp32 temporaries for the rotation, some
400 launches at 8K tokens. Here one kernel reads every block's un-roped keys and values and writes them
into the buffer at their slots, keys rotated in fp32 by the model's own cos/sin rows of their new positions and
cast once. The math is the torch path's, in the same order, so the two agree bit for bit.

Readiness: a block with a `BlockReady` may still be copying. Waiting on every copy before one launch would put
the whole stitch behind the last copy; instead blocks are cut into groups at each new wait, the wait is issued
and the group launched, so earlier blocks are placed while later ones still copy (as the torch path does), at
one launch per waited block instead of ~25 torch ops per block. Blocks with no wait (GPU tier, prefix) join the
current group, so a GPU-tier stitch is one launch. On the host tier the copies dominate either way; grouping is
kept because it can only cost a few launches, while one launch always waits for the last copy.

cos/sin come from `Rotary.cos_sin` (the model's rotary module, scaled RoPE included) for positions 0..N-1 and are
cached, N growing by powers of two: every supported rope type (model.SUPPORTED_ROPE_TYPES) gives a position the
same values whatever other positions are asked with it.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Sequence
from typing import Any

import torch

from service.engine.device_copy import to_device
from service.engine.kv_buffer import KVBuffer
from service.engine.kv_layout import KVBlock
from service.engine.rotary import Rotary

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_BLOCK_T = 32  # tokens per program: 32 x 128 bf16 keys + values = 16 KiB moved, enough programs at 4K+
_MIN_TABLE = 4096


# log2(e): the attention kernels take their softmax scale in base 2.
LOG2E = 1.4426950408889634


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_runs_on(device: torch.device, interpreter: bool = False) -> bool:
    """Whether the project's Triton kernels run for tensors on `device`: CUDA with triton. `interpreter` (tests only,
    with TRITON_INTERPRET=1 set before triton imports) lets CPU tensors through Triton's interpreter."""
    if not triton_available():
        return False
    return device.type == "cuda" or (interpreter and device.type == "cpu")


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): Triton's block sizes."""
    return 1 << max(n - 1, 0).bit_length()


def fused_stitch_enabled(flag: bool | None, device: torch.device) -> bool:
    """None (auto): on wherever triton imports and the model is on CUDA; False: never; True: required."""
    usable = triton_runs_on(device)
    if flag and not usable:
        raise ValueError("the fused stitch needs a CUDA device and triton")
    return usable if flag is None else bool(flag)


@functools.cache
def _kernel() -> Any:
    from service.engine import _stitch_kernel

    return _stitch_kernel.rotate_place_kernel


class FusedStitch:
    """Rotate-and-place into a `KVBuffer` with the Triton kernel; `supports` says when it applies."""

    def __init__(self, rotary: Rotary, head_dim: int) -> None:
        # False: issue every wait, then one launch for all blocks (kept to measure what grouping buys).
        self.overlap = True
        self._rotary = rotary
        self._head_dim = head_dim
        self._cos: torch.Tensor | None = None
        self._sin: torch.Tensor | None = None

    def supports(self, buffer: KVBuffer, blocks: Sequence[KVBlock]) -> bool:
        """A contiguous CUDA buffer of a supported dtype, and blocks the kernel can read in place (contiguous
        where they are already on the device: a strided one would need a copy before its wait was issued)."""
        data = buffer.data
        return (
            data.device.type == "cuda"
            and data.dtype in _DTYPES
            and data.is_contiguous()
            and self._head_dim % 2 == 0
            and all(b.kv.device.type == "cpu" or (b.kv.device == data.device and b.kv.is_contiguous()) for b in blocks)
        )

    def cos_sin(self, positions: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 [N >= positions, head_dim] tables of the model's cos and sin for positions 0..N-1."""
        if self._cos is None or self._sin is None or self._cos.shape[0] < positions or self._cos.device != device:
            size = max(_MIN_TABLE, 1 << max(positions - 1, 1).bit_length())
            cos, sin = self._rotary.cos_sin(torch.arange(size, device=device))
            self._cos, self._sin = cos.contiguous(), sin.contiguous()
        return self._cos, self._sin

    def place(
        self,
        buffer: KVBuffer,
        blocks: Sequence[KVBlock],
        slots: Sequence[int],
        starts: Sequence[int],
        waits: Sequence[Any],
        layers: tuple[int, int] | None = None,
        key_scales: Sequence[float] = (),
    ) -> None:
        """Write every block at its slot, keys rotated to positions start.. (times the block's `key_scales`
        entry; none given: 1), in one launch per wait group; only layers [first, end) of `layers` when given (one
        layer group of a pipelined stitch)."""
        if not blocks:
            return
        data = buffer.data
        device = data.device
        kernel = _kernel()
        num_layers, _, heads, _, head_dim = data.shape
        first_layer, end_layer = (0, num_layers) if layers is None else layers
        if not 0 <= first_layer < end_layer <= num_layers:
            raise ValueError(f"layer range {layers} outside 0..{num_layers}")
        # Host-resident blocks (a pinned plain copy) go over first, as the torch path would copy them.
        sources = [_device_source(block.kv, device) for block in blocks]
        rows = [
            [src.data_ptr(), block.num_tokens, slot, start]
            for src, block, slot, start in zip(sources, blocks, slots, starts, strict=True)
        ]
        cos, sin = self.cos_sin(max(s + b.num_tokens for s, b in zip(starts, blocks, strict=True)), device)
        table = to_device(torch.tensor(rows, dtype=torch.int64), device)
        scales = to_device(torch.tensor(list(key_scales) or [1.0] * len(blocks), dtype=torch.float32), device)
        strides = data.stride()
        half_p2 = max(1, 1 << (head_dim // 2 - 1).bit_length())
        if not self.overlap:
            for wait in waits:
                if wait is not None:
                    wait()
        for first, end in _groups(waits) if self.overlap else [(0, len(blocks))]:
            wait = waits[first]
            if wait is not None and self.overlap:
                wait()
            longest = max(b.num_tokens for b in blocks[first:end])
            grid = ((longest + _BLOCK_T - 1) // _BLOCK_T, end - first, (end_layer - first_layer) * heads)
            kernel[grid](
                table[first:end],
                scales[first:end],
                data,
                cos,
                sin,
                heads,
                first_layer,
                strides[0],
                strides[1],
                strides[2],
                head_dim=head_dim,
                half_p2=half_p2,
                block_t=_BLOCK_T,
                enable_fp_fusion=False,
            )
        # Dropping `sources` (host blocks copied above) and `table` here is safe: the caching allocator hands
        # their memory only to later work on this same stream, which runs after these launches.


def _device_source(kv: torch.Tensor, device: torch.device) -> torch.Tensor:
    return kv.to(device, non_blocking=True).contiguous()


def _groups(waits: Sequence[Any]) -> list[tuple[int, int]]:
    """[first, end) ranges of blocks launched together: a new group at each block with a wait not yet issued
    (the same `BlockReady` object for consecutive blocks is one wait)."""
    groups: list[tuple[int, int]] = []
    first = 0
    for i in range(1, len(waits)):
        if waits[i] is not None and waits[i] is not waits[first]:
            groups.append((first, i))
            first = i
    groups.append((first, len(waits)))
    return groups
