"""Plain helpers of the fleet tests: a small KV store on the CPU whose misses are random blocks (no model needed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from service.devtools.tiny_spec import TINY_SPEC
from service.engine.kv_layout import KVBlock, TokenIds, block_shape
from service.kvcache.index import SQLITE_FILENAME, SqliteIndex
from service.kvcache.store import KVStore, TierBudgets
from service.kvcache.tiers import TierListener

SPEC = TINY_SPEC
BLOCK_TOKENS = 24
BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * BLOCK_TOKENS  # layers x (k, v) x kv heads x head dim x fp32 bytes x tokens


def random_blocks(token_id_blocks: Sequence[TokenIds]) -> list[KVBlock]:
    """The store's precompute: any KV of the right shape does (routing never reads it)."""
    return [KVBlock(tuple(ids), torch.randn(block_shape(SPEC, len(ids)))) for ids in token_id_blocks]


def chunk(n: int) -> tuple[int, ...]:
    """The token ids of test chunk n (distinct per n)."""
    return tuple(range(n * 100 + 1, n * 100 + 1 + BLOCK_TOKENS))


def open_store(
    cache_dir: Path,
    gpu_blocks: int,
    host_blocks: int,
    listener: TierListener | None = None,
    fingerprint: str = "fp-test",
) -> KVStore:
    """A store whose GPU tier (CPU tensors) holds `gpu_blocks` test chunks and whose host pool `host_blocks`."""
    index = SqliteIndex(cache_dir / SQLITE_FILENAME)
    budgets = TierBudgets(gpu_blocks * BLOCK_BYTES, host_blocks * BLOCK_BYTES, 64 << 20)
    return KVStore(SPEC, fingerprint, "tpl-1", cache_dir, index, budgets, random_blocks, tier_listener=listener)
