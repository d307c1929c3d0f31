"""Stitch position-independent blocks into one KV buffer, rotating keys once at their planned positions.

Positions follow TurboRAG section 3.2:
- `reordered` (default): prefix, chunk 1, ..., chunk k take contiguous positions, as in one causal prompt.
- `composite`: every chunk keeps the positions it was precomputed at (0..len-1 alone, P..P+len-1 after the
  prefix); the prefix sits at 0..P-1 and the question at its true index P + sum(len).
The question and every decoded token continue at the true index in both modes.

Blocks may still be arriving on the device when stitching starts (the KV cache copies them on its own stream).
Each block can come with a `BlockReady`: a callable that makes the current stream wait for that block's copy.
It is called just before the block's rotate-and-place, so block 0 is rotated while later blocks still copy,
instead of the whole stitch waiting for the last copy.

On CUDA with triton the engine hands in a `FusedStitch` (fused_stitch.py): the same rotate-and-place as one
Triton launch per group of ready blocks, bit-identical to the torch path below, which stays the fallback (CPU,
no triton, an unsupported dtype).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol, runtime_checkable

import torch

from service.engine.fused_stitch import FusedStitch
from service.engine.kv_buffer import KVBuffer
from service.engine.kv_layout import KEYS, VALUES, KVBlock
from service.engine.rotary import Rotary

# Orders the current stream after one block's arrival (device-side; the host does not block). The engine
# knows nothing of where it comes from: the KV cache hands in `Arrival` objects.
BlockReady = Callable[[], None]


@runtime_checkable
class LayeredReady(Protocol):
    """A `BlockReady` whose block arrives layer group by layer group (the KV cache's pipelined host copies):
    calling it waits for the whole block, `layers(start, end)` gives the wait for layers start..end-1 alone."""

    def __call__(self) -> None: ...

    def layers(self, start: int, end: int) -> BlockReady: ...


def layer_wait(ready: BlockReady | None, start: int, end: int) -> BlockReady | None:
    """The wait for layers [start, end) of a block: its layer group's wait when it arrives by layers, else the
    whole block's (the same object for every range, so a waited block is waited for once per range)."""
    if ready is None:
        return None
    return ready.layers(start, end) if isinstance(ready, LayeredReady) else ready


class PositionMode(StrEnum):
    REORDERED = "reordered"
    COMPOSITE = "composite"


@dataclass(frozen=True)
class StitchPlan:
    """Where each block goes: its slot in the buffer and the position of its first token."""

    mode: PositionMode
    lengths: tuple[int, ...]
    slots: tuple[int, ...]
    starts: tuple[int, ...]
    # Factor on each block's rotated keys: 1 for the prefix, 1/T for chunks under a context temperature T.
    key_scales: tuple[float, ...] = ()

    def key_scale(self, block: int) -> float:
        return self.key_scales[block] if self.key_scales else 1.0

    @property
    def context_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def question_start(self) -> int:
        """Position of the first question token: its true index in the joined prompt."""
        return self.context_tokens

    def positions(self) -> torch.Tensor:
        """Position of every context slot, in slot order."""
        parts = [torch.arange(s, s + n) for s, n in zip(self.starts, self.lengths, strict=True)]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)


def plan_positions(
    mode: PositionMode | str, lengths: Sequence[int], chunk_start: int = 0, context_temperature: float = 1.0
) -> StitchPlan:
    """Plan a prefix (lengths[0]) followed by chunk blocks (lengths[1:]) in retrieval order; `chunk_start` is the
    position a chunk's first token had when it was precomputed (`composite` keeps it).

    `context_temperature` T (APE): every later query's scores against chunk keys are divided by T. Scores are
    linear in the keys, so dividing the chunks' rotated keys by T once, at the stitch, does it for every
    attention kernel that reads the buffer, with nothing changed in them."""
    mode = PositionMode(mode)
    if not lengths or any(n <= 0 for n in lengths):
        raise ValueError("every block in a stitch plan needs at least one token")
    if not context_temperature > 0:
        raise ValueError(f"a context temperature must be positive, not {context_temperature}")
    slots, offset = [], 0
    for n in lengths:
        slots.append(offset)
        offset += n
    starts = slots if mode is PositionMode.REORDERED else [0, *[chunk_start] * (len(lengths) - 1)]
    scales = () if context_temperature == 1.0 else (1.0, *[1.0 / context_temperature] * (len(lengths) - 1))
    return StitchPlan(mode, tuple(lengths), tuple(slots), tuple(starts), scales)


def stitch_into(
    buffer: KVBuffer,
    rotary: Rotary,
    blocks: Sequence[KVBlock],
    plan: StitchPlan,
    ready: Sequence[BlockReady | None] | None = None,
    fused: FusedStitch | None = None,
) -> None:
    """Copy blocks into an empty buffer, keys rotated in fp32 to the plan's positions, values as they are.

    `ready`, one entry per block (None: already there), is called right before that block is read.
    `fused`: place through the Triton kernel where it supports the buffer, else the torch path.
    """
    if buffer.length != 0:
        raise ValueError("stitching needs an empty buffer")
    if [b.num_tokens for b in blocks] != list(plan.lengths):
        raise ValueError("blocks do not match the stitch plan")
    waits = list(ready) if ready is not None else [None] * len(blocks)
    if len(waits) != len(blocks):
        raise ValueError(f"{len(waits)} ready entries for {len(blocks)} blocks")
    buffer.reserve(plan.context_tokens)
    if fused is not None and fused.supports(buffer, blocks):
        fused.place(buffer, blocks, plan.slots, plan.starts, waits, key_scales=plan.key_scales)
        buffer.commit(plan.context_tokens, plan.question_start)
        return
    for index, (block, wait, slot, start) in enumerate(zip(blocks, waits, plan.slots, plan.starts, strict=True)):
        if wait is not None:
            wait()
        _place(buffer, rotary, block, slot, start, plan.key_scale(index))
    buffer.commit(plan.context_tokens, plan.question_start)


def stitch_layers(
    buffer: KVBuffer,
    rotary: Rotary,
    blocks: Sequence[KVBlock],
    plan: StitchPlan,
    ready: Sequence[BlockReady | None] | None,
    fused: FusedStitch | None,
    layers: tuple[int, int],
) -> None:
    """Place layers [start, end) of every block, waiting for just those layers (`layer_wait`).

    One layer group of a pipelined stitch: the caller reserved the context's slots beforehand, stitches each
    group right before the prefill segment that reads it, and commits the context once (`stitch_into` checks and
    commits a whole stitch; this only writes).
    """
    start, end = layers
    waits = [layer_wait(r, start, end) for r in ready] if ready is not None else [None] * len(blocks)
    if len(waits) != len(blocks):
        raise ValueError(f"{len(waits)} ready entries for {len(blocks)} blocks")
    if fused is not None and fused.supports(buffer, blocks):
        fused.place(buffer, blocks, plan.slots, plan.starts, waits, layers, plan.key_scales)
        return
    issued: set[int] = set()
    for index, (block, wait, slot, first) in enumerate(zip(blocks, waits, plan.slots, plan.starts, strict=True)):
        if wait is not None and id(wait) not in issued:
            issued.add(id(wait))
            wait()
        _place(buffer, rotary, block, slot, first, plan.key_scale(index), layers)


def _place(
    buffer: KVBuffer,
    rotary: Rotary,
    block: KVBlock,
    slot: int,
    start: int,
    key_scale: float = 1.0,
    layers: tuple[int, int] | None = None,
) -> None:
    """One block's keys rotated to positions start.. (times `key_scale`) and its values, written at slots slot..
    (only layers [first, end) of `layers` when given)."""
    device = buffer.data.device
    first, last = (0, buffer.data.shape[0]) if layers is None else layers
    kv = block.kv[first:last].to(device, non_blocking=True)
    end = slot + block.num_tokens
    keys = rotary.rotate(kv[:, KEYS], torch.arange(start, start + block.num_tokens, device=device), key_scale)
    buffer.data[first:last, KEYS, :, slot:end].copy_(keys)
    buffer.data[first:last, VALUES, :, slot:end].copy_(kv[:, VALUES])
