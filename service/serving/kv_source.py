"""The KV store for one engine: its model fingerprint, template version and dtype key the blocks, its forward
computes the misses, its layer groups shape the overlapped copies. And the scheduler's KV source over it
(`StoreChunks`): the fetch a request's admission runs.

The store itself never imports the engine (it takes a precompute callable); this is where the two meet. It
imports only the engine and the KV cache, so the GPU benchmarks and the engine/cache tests use it without the
retrieval stack.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import redis

from service.engine.chunk_source import ChunkFetch
from service.engine.engine import StitchEngine
from service.errors import UnavailableError
from service.kvcache.index import KVIndex
from service.kvcache.keys import model_fingerprint
from service.kvcache.precompute import DEFAULT_MAX_PRECOMPUTE_TOKENS, Precompute
from service.kvcache.quant import DiskFormat
from service.kvcache.shared import SharedTier
from service.kvcache.store import DEFAULT_READ_THREADS, FetchResult, KVStore, TierBudgets


def kv_store_for(
    engine: StitchEngine,
    cache_dir: Path,
    index: KVIndex,
    budgets: TierBudgets,
    *,
    precompute: Precompute | None = None,
    read_threads: int = DEFAULT_READ_THREADS,
    max_precompute_tokens: int = DEFAULT_MAX_PRECOMPUTE_TOKENS,
    direct_io: bool = False,
    disk_format: DiskFormat = "native",
    shared: SharedTier | None = None,
) -> KVStore:
    """A store keyed for `engine`; misses go to `precompute` (default: the engine's own, on the caller's thread —
    the runtime passes one that runs on its engine loop)."""
    return KVStore(
        engine.spec,
        model_fingerprint(engine.model),
        engine.kv_version,
        cache_dir,
        index,
        budgets,
        precompute or engine.precompute,
        engine.pipeline_layers,
        read_threads=read_threads,
        max_precompute_tokens=max_precompute_tokens,
        direct_io=direct_io,
        disk_format=disk_format,
        shared=shared,
    )


class StoreChunks:
    """The scheduler's KV source over a store: a request's chunk KV at its admission (on the engine thread, before
    its prefill), from whichever tier holds it (misses computed). Copies may still run when `fetch` returns: the
    stitch waits for each block. `UnavailableError` when the KV index is away."""

    def __init__(self, store: KVStore) -> None:
        self.store = store

    def fetch(self, blocks: Sequence[Sequence[int]], pin: bool = False) -> FetchResult:
        """`pin`: the GPU tier's blocks stay in place until `release` (shared-chunk mode pins what it reads)."""
        try:
            return self.store.fetch(blocks, overlap=True, pin=pin)
        except (redis.RedisError, ConnectionError, TimeoutError) as err:
            raise UnavailableError("the KV index", err) from err

    def release(self, fetched: ChunkFetch) -> None:
        """Unpin what a pinned `fetch` held."""
        if isinstance(fetched, FetchResult):
            self.store.release(fetched)
