"""The one KV layout the engine produces, stitches and the cache stores, and the model shape it follows.

This module imports nothing else of the project: it is all the KV cache knows of the engine.

A block's KV is a single tensor `[layers, 2, kv_heads, tokens, head_dim]`: index 0 of the second axis holds the
keys *before* RoPE, index 1 the values. Because keys are stored un-rotated, one copy serves the block at any
position; the stitcher rotates them once, to wherever the plan puts the block.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import torch

# A block's token ids, as the template builds them and the cache keys them (one definition for every package).
TokenIds = tuple[int, ...]
LAYOUT_NAME = "layers,kv,heads,tokens,dim;keys-unroped"
LAYOUT_VERSION = 1
KEYS, VALUES = 0, 1


class ChunkContext(StrEnum):
    """What a chunk block attends to when its KV is precomputed (the same in the gate's reference mask).

    `alone`: only itself, from position 0 (TurboRAG): every chunk's first token becomes an attention sink of its
    own, which a full prefill never has. `prefix`: the template prefix (BOS, system turn) and then itself, from
    the position after the prefix (APE's shared prefix): each chunk is read the way the prompt's start is read in
    a full prefill, and the chunks share one sink, the prefix's.
    """

    ALONE = "alone"
    PREFIX = "prefix"


# The service's default (`KVSTITCH_CHUNK_CONTEXT`): measured to keep more of naive's answers at no cost
# (docs/quality.md). The engine class itself defaults to `alone`, TurboRAG's form.
SERVED_CHUNK_CONTEXT = ChunkContext.PREFIX


@dataclass(frozen=True)
class ModelSpec:
    """The shape facts the engine and the KV cache need, read once from the config."""

    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    rope_type: str
    max_positions: int
    sliding_window: int | None
    dtype: torch.dtype
    device: torch.device

    @property
    def max_context(self) -> int:
        """Longest sequence the lean forward computes exactly (a sliding window is not modelled)."""
        if self.sliding_window is None:
            return self.max_positions
        return min(self.max_positions, self.sliding_window)

    def kv_bytes_per_token(self) -> int:
        """Bytes of keys and values one token occupies across all layers."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.dtype.itemsize


@dataclass(frozen=True)
class KVBlock:
    """Position-independent KV of one block of token ids (prefix or wrapped chunk)."""

    token_ids: TokenIds
    kv: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


def block_shape(spec: ModelSpec, num_tokens: int) -> tuple[int, int, int, int, int]:
    """The shape a block of `num_tokens` tokens must have for this model."""
    return (spec.num_layers, 2, spec.num_kv_heads, num_tokens, spec.head_dim)


def check_block(spec: ModelSpec, block: KVBlock) -> None:
    """Raise ValueError when a block does not fit the model (shape or dtype)."""
    expected = block_shape(spec, block.num_tokens)
    if tuple(block.kv.shape) != expected:
        raise ValueError(f"KV block shape {tuple(block.kv.shape)} does not match the model's {expected}")
    if block.kv.dtype != spec.dtype:
        raise ValueError(f"KV block dtype {block.kv.dtype} does not match the model's {spec.dtype}")
