"""Grouping KV blocks into batches for the precompute forward.

Kept apart from `workers.ingest` so that what needs only the engine and the KV cache (the GPU precompute
benchmark) can import it without Qdrant, sentence-transformers or Redis.
"""

from __future__ import annotations

from collections.abc import Sequence

from service.engine.prompt import TokenIds


def precompute_batches(blocks: Sequence[TokenIds], max_tokens: int) -> list[list[TokenIds]]:
    """Blocks grouped for batched precompute: similar lengths together (little padding), each batch's padded
    size (blocks x longest) at most `max_tokens`; a block longer than that goes alone."""
    batches: list[list[TokenIds]] = []
    current: list[TokenIds] = []
    for block in sorted(blocks, key=len, reverse=True):
        longest = len(current[0]) if current else len(block)
        if current and (len(current) + 1) * longest > max_tokens:
            batches.append(current)
            current = []
        current.append(block)
    if current:
        batches.append(current)
    return batches
