"""A preallocated per-sequence KV buffer: stitched context, question and decoded tokens, never concatenated."""

from __future__ import annotations

import torch

from service.engine.kv_layout import KEYS, VALUES, ModelSpec


class KVBuffer:
    """Keys (already rotated) and values for one sequence, `[layers, 2, kv_heads, capacity, head_dim]`."""

    def __init__(
        self,
        spec: ModelSpec,
        capacity: int,
        device: torch.device | None = None,
        data: torch.Tensor | None = None,
    ) -> None:
        """`data`: existing storage of that shape to use instead of allocating (a slab of a `KVPool`)."""
        if capacity <= 0:
            raise ValueError("KV buffer capacity must be positive")
        if capacity > spec.max_context:
            raise ValueError(f"sequence of {capacity} tokens exceeds the model's context of {spec.max_context}")
        self.spec = spec
        self.capacity = capacity
        shape = (spec.num_layers, 2, spec.num_kv_heads, capacity, spec.head_dim)
        if data is not None and (tuple(data.shape) != shape or data.dtype != spec.dtype):
            raise ValueError(f"storage {tuple(data.shape)} {data.dtype} is not a {shape} {spec.dtype} buffer")
        self.data = torch.empty(shape, dtype=spec.dtype, device=device or spec.device) if data is None else data
        self.length = 0
        self.next_position = 0

    def reserve(self, num_tokens: int) -> int:
        """Check room for `num_tokens` more tokens and return the slot where they start."""
        if self.length + num_tokens > self.capacity:
            raise ValueError(f"KV buffer full: {self.length} + {num_tokens} > capacity {self.capacity}")
        return self.length

    def write(self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store rotated keys and values [kv_heads, T, D] of one layer at slots start..start+T."""
        end = start + keys.shape[-2]
        self.data[layer, KEYS, :, start:end].copy_(keys)
        self.data[layer, VALUES, :, start:end].copy_(values)

    def keys(self, layer: int, end: int) -> torch.Tensor:
        return self.data[layer, KEYS, :, :end]

    def values(self, layer: int, end: int) -> torch.Tensor:
        return self.data[layer, VALUES, :, :end]

    def commit(self, num_tokens: int, next_position: int) -> None:
        """Make the last written tokens visible and record where the next token's position is."""
        self.length += num_tokens
        self.next_position = next_position

    def copy_from(self, source: KVBuffer) -> None:
        """Take over another buffer's live tokens and length (a prefill staged in a graph's buffer, moved into a
        pool slab: a device-to-device copy of the live slots only)."""
        n = source.length
        if n > self.capacity:
            raise ValueError(f"{n} live tokens do not fit a buffer of {self.capacity}")
        with torch.inference_mode():
            self.data[:, :, :, :n].copy_(source.data[:, :, :, :n])
        self.truncate(0, 0)
        self.commit(n, source.next_position)

    def truncate(self, length: int, next_position: int) -> None:
        """Forget every token from slot `length` on (reuse a stitched context for another question)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a buffer of {self.length} tokens to {length}")
        self.length = length
        self.next_position = next_position
