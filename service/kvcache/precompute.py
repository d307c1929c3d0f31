"""Computing chunk KV in batches: the one grouping rule, and the ingest path's compute-then-write pipeline.

The KV store (misses of a request) and ingestion (every new chunk) both hand a list of blocks to a precompute
callable in batches of at most `max_tokens` padded tokens (blocks x longest block). Neither holds the engine: the
callable is whatever the composition root binds (the engine's forward, run by the one engine loop).
"""

from __future__ import annotations

import collections
import concurrent.futures
from collections.abc import Callable, Sequence

from service.engine.kv_layout import KVBlock, TokenIds

# Padded tokens (blocks x longest block) per batched precompute. Activations grow with it: at 16K tokens a
# 7B-class model needs a few GiB beyond its weights, and 32 chunks of 512 tokens still go in one call.
DEFAULT_MAX_PRECOMPUTE_TOKENS = 16_384
# Threads that write computed blocks while the next batch computes: a 7B forward on a large GPU makes KV at
# ~40K tokens/s, several GB/s, and one writer thread (copy, file, fsync, index) stores only ~1 GB/s.
DEFAULT_WRITERS = 4
# Computed blocks waiting for a writer hold device memory; this bounds it.
MAX_PENDING_WRITES = 128

# Position-independent KV of several blocks, batched in one forward, in the order given.
Precompute = Callable[[Sequence[TokenIds]], list[KVBlock]]


def precompute_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Indices of blocks grouped into batches of at most `max_tokens` padded tokens (count x longest).

    Everything in one batch, in order, when it fits. Otherwise blocks are taken longest first, so each batch
    holds blocks of similar length and pads little; a block longer than the cap goes alone. Within a batch
    indices stay in request order.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    if not lengths:
        return []
    if len(lengths) * max(lengths) <= max_tokens:
        return [list(range(len(lengths)))]
    batches: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        # Sorted longest first: a batch's first block is its longest, so the padded size is count x that.
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= max_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return [sorted(batch) for batch in batches]


def precompute_and_store(
    precompute: Precompute,
    put: Callable[[Sequence[KVBlock]], int],
    blocks: Sequence[TokenIds],
    max_tokens: int,
    writers: int = DEFAULT_WRITERS,
    on_batch: Callable[[Sequence[int]], None] | None = None,
) -> int:
    """Compute the KV of `blocks` in batches and `put` every block; returns the bytes written.

    Writing (device-to-host copy, file, fsync, index) runs on `writers` threads while the next batch computes;
    at most `MAX_PENDING_WRITES` computed blocks wait for a writer. `on_batch(indices)` is called after each batch of
    blocks is computed, with their indices in `blocks` (progress).
    """
    pending: collections.deque[concurrent.futures.Future[int]] = collections.deque()
    written = 0
    with concurrent.futures.ThreadPoolExecutor(max(1, writers), thread_name_prefix="kv-write") as pool:
        for batch in precompute_batches([len(b) for b in blocks], max_tokens):
            computed = precompute([blocks[i] for i in batch])
            pending.extend(pool.submit(put, [block]) for block in computed)
            if on_batch is not None:
                on_batch(batch)
            while len(pending) > MAX_PENDING_WRITES:
                written += pending.popleft().result()
        for future in pending:
            written += future.result()
    return written
