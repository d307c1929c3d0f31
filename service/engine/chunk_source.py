"""The port through which the scheduler gets a request's chunk KV at admission.

The composition root hands the scheduler an object with `fetch(blocks)` (the KV store in the server); the
scheduler never reaches the store through the request or the use case that made it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from service.engine.kv_layout import KVBlock
from service.engine.stitch import BlockReady


class ChunkFetch(Protocol):
    """Chunk KV on the engine's device, in request order; `ready[i]` makes the stream wait for block i's copy
    (None: no wait), an empty list when nothing is in flight."""

    @property
    def blocks(self) -> Sequence[KVBlock]: ...

    @property
    def ready(self) -> Sequence[BlockReady | None]: ...


class ChunkSource(Protocol):
    def fetch(self, blocks: Sequence[Sequence[int]]) -> ChunkFetch:
        """The KV of every block, from whichever tier holds it (misses computed); copies may still be landing."""
        ...


@runtime_checkable
class PinningChunkSource(Protocol):
    """A source whose device-resident blocks a request can hold in place while it runs (the KV store's GPU tier):
    `fetch(blocks, pin=True)` pins them, `release(fetched)` unpins them (once; a second call does nothing)."""

    def fetch(self, blocks: Sequence[Sequence[int]], pin: bool = False) -> ChunkFetch: ...

    def release(self, fetched: ChunkFetch) -> None: ...
