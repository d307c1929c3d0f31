"""One physical copy of every chunk's KV, shared read-only by every running answer (segment attention reads it).

The arena is one preallocated tensor `[layers, 2, kv_heads, slots, head_dim]`, sized once in bytes, carved by the
`KVPool` allocator (first fit, coalescing, freed ranges poisoned): a chunk is one contiguous range, which is all a
`ChunkRange` of segment attention names. Keys are rotated once, at LOCAL positions base .. base + L - 1, through
the model's own rotary (fp32, cast once), values kept as they are; segment attention rotates each query by the
chunk's offset in its request instead, so the same copy serves a chunk at any position in any request.

Chunks are keyed by (KV version, token ids), never by Python's `hash()`. A request pins the chunks it reads
(`pin_held` those resident, then `acquire` the others with their KV) and unpins them when it ends (`release`); a
full arena evicts the least recently used UNPINNED chunks and refuses (`ArenaFullError`, a `PoolExhaustedError`:
the request waits) when pinned chunks leave no room, so a chunk is never freed or rewritten while someone reads it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from service.engine.kv_layout import KEYS, VALUES, KVBlock, ModelSpec, TokenIds, check_block
from service.engine.kv_pool import KVPool, Poison, PoolExhaustedError, Slab
from service.engine.rotary import Rotary
from service.engine.segment_attention import ChunkRange


class ArenaFullError(PoolExhaustedError):
    """Pinned chunks leave no free range for a chunk (the request should wait for answers to end)."""


@dataclass(frozen=True)
class ChunkKey:
    """What a chunk's arena copy depends on: the KV version (template, chunk context) and its token ids.

    The hash is computed once: a key is hashed at every admission's lookups, and hashing a tuple of hundreds of
    token ids each time cost more than the lookups themselves."""

    version: str
    token_ids: TokenIds
    # hash(token_ids) when the caller has it already (`PromptIds.block_hashes`); None: computed here.
    token_hash: int | None = field(default=None, repr=False, compare=False)
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        token_hash = hash(self.token_ids) if self.token_hash is None else self.token_hash
        object.__setattr__(self, "_hash", hash((self.version, token_hash)))

    def __hash__(self) -> int:
        return self._hash


@dataclass
class _Entry:
    slab: Slab
    pins: int = 0


class ChunkArena:
    """Chunks held once at local positions `base ..`, pinned by their readers, evicted LRU when unpinned."""

    def __init__(
        self, spec: ModelSpec, rotary: Rotary, budget_bytes: int, base: int = 0, poison: Poison | str = Poison.ZERO
    ) -> None:
        self.spec = spec
        self.base = base
        self._rotary = rotary
        self._pool = KVPool(spec, budget_bytes, poison)
        # Least recently acquired first: eviction walks from the front, skipping pinned chunks.
        self._entries: OrderedDict[ChunkKey, _Entry] = OrderedDict()
        self._by_start: dict[int, ChunkKey] = {}
        self.evictions = 0
        # Kept as the pins change, not counted over the entries: the metrics read it from another thread.
        self._pinned = 0
        self._used = 0

    @property
    def data(self) -> torch.Tensor:
        """The arena tensor `[layers, 2, kv_heads, slots, head_dim]` (segment attention reads layer by layer)."""
        return self._pool.data

    # ---- pins ---------------------------------------------------------------------------------------------

    def acquire(self, blocks: Sequence[KVBlock], version: str) -> tuple[ChunkRange, ...]:
        """Pin every block's chunk (placing the missing ones), in order; raises `ArenaFullError`, having pinned
        nothing, when pinned chunks leave no room for a missing one."""
        ranges: list[ChunkRange] = []
        try:
            for block in blocks:
                ranges.append(self._pin(ChunkKey(version, block.token_ids), block))
        except ArenaFullError:
            self.release(ranges)
            raise
        return tuple(ranges)

    def pin_held(
        self, version: str, blocks: Sequence[Sequence[int]], hashes: Sequence[int] | None = None
    ) -> list[ChunkRange | None]:
        """Pin the chunks (by token ids) the arena holds now, in order, None for each one it lacks; places nothing,
        so it never evicts. A reader pins what it finds this way before `acquire` places the rest: placing may
        evict unpinned chunks, never then one it reads (and whose KV it did not fetch). `hashes`: each block's
        hash, where the caller has them (`PromptIds.block_hashes`)."""
        held: list[ChunkRange | None] = []
        for key in _keys(version, blocks, hashes):
            held.append(self._pin(key) if key in self._entries else None)
        return held

    def release(self, ranges: Sequence[ChunkRange]) -> None:
        """Unpin chunks `acquire` or `pin_held` returned (each range once per time it was returned)."""
        for chunk in ranges:
            key = self._by_start.get(chunk.start)
            entry = self._entries.get(key) if key is not None else None
            if entry is None or entry.slab.size != chunk.length or entry.pins == 0:
                raise ValueError(f"{chunk} is not a pinned chunk of this arena")
            entry.pins -= 1
            self._pinned -= entry.pins == 0

    def _pin(self, key: ChunkKey, block: KVBlock | None = None) -> ChunkRange:
        entry = self._entries.get(key)
        if entry is None:
            assert block is not None, "a chunk the arena lacks is pinned with its KV"
            entry = _Entry(self._place(block))
            self._used += entry.slab.size
            self._entries[key] = entry
            self._by_start[entry.slab.start] = key
        self._entries.move_to_end(key)
        self._pinned += entry.pins == 0
        entry.pins += 1
        return ChunkRange(entry.slab.start, entry.slab.size, self.base)

    # ---- placement and eviction ---------------------------------------------------------------------------

    def _place(self, block: KVBlock) -> Slab:
        """A range holding the block's keys rotated at base .. and its values (evicting unpinned chunks)."""
        check_block(self.spec, block)
        slab = self._allocate(block.num_tokens)
        device = self.data.device
        kv = block.kv.to(device, non_blocking=True)
        positions = torch.arange(self.base, self.base + block.num_tokens, device=device)
        with torch.inference_mode():
            view = self._pool.view(slab)
            view[:, KEYS].copy_(self._rotary.rotate(kv[:, KEYS], positions))
            view[:, VALUES].copy_(kv[:, VALUES])
        return slab

    def _allocate(self, tokens: int) -> Slab:
        while not self._pool.can_allocate(tokens):
            victim = next((k for k, e in self._entries.items() if e.pins == 0), None)
            if victim is None:
                raise ArenaFullError(
                    f"pinned chunks fill the arena: no free range of {tokens} slots "
                    f"({self.pinned_chunks} pinned, largest free {self._pool.largest_free})"
                )
            self._evict(victim)
        return self._pool.allocate(tokens)

    def _evict(self, key: ChunkKey) -> None:
        entry = self._entries.pop(key)
        del self._by_start[entry.slab.start]
        self._used -= entry.slab.size
        self._pool.free(entry.slab)  # poisons the range: a stale reader would see NaN (tests) or zeros
        self.evictions += 1

    def close(self) -> None:
        """Drop the arena's memory (its owner is closing); nothing may be acquired or read afterwards."""
        self._entries.clear()
        self._by_start.clear()
        self._pinned = self._used = 0
        self._pool.release()

    # ---- what it holds ------------------------------------------------------------------------------------

    def may_hold(self, version: str, blocks: Sequence[Sequence[int]], hashes: Sequence[int] | None = None) -> bool:
        """Whether `acquire` of chunks with these token ids could succeed now: the missing ones fit the free slots
        and those of unpinned chunks they do not include (a cheap check before fetching their KV; fragmentation
        aside, which `acquire` alone decides). `hashes`: as `pin_held`'s."""
        wanted = set(_keys(version, blocks, hashes))
        missing = sum(len(key.token_ids) for key in wanted if key not in self._entries)
        free = self.slots - self.used_slots
        if missing <= free:  # the usual case (chunks resident): no walk over every entry
            return True
        evictable = sum(e.slab.size for key, e in self._entries.items() if e.pins == 0 and key not in wanted)
        return missing <= free + evictable

    def holds(self, version: str, token_ids: Sequence[int]) -> bool:
        """Whether the arena holds the chunk now. Safe from another thread (one dict lookup; the answer may be
        stale by the time it is used): how the KV read ahead skips chunks the arena serves without a fetch."""
        return ChunkKey(version, tuple(token_ids)) in self._entries

    def pins(self, version: str, token_ids: Sequence[int]) -> int | None:
        """The chunk's pin count, or None when the arena does not hold it."""
        entry = self._entries.get(ChunkKey(version, tuple(token_ids)))
        return None if entry is None else entry.pins

    @property
    def chunks(self) -> int:
        return len(self._entries)

    @property
    def pinned_chunks(self) -> int:
        return self._pinned

    @property
    def used_slots(self) -> int:
        return self._used

    @property
    def used_bytes(self) -> int:
        return self._used * self.spec.kv_bytes_per_token()

    @property
    def capacity_bytes(self) -> int:
        return self._pool.capacity_bytes

    @property
    def slots(self) -> int:
        return self._pool.slots


def _keys(version: str, blocks: Sequence[Sequence[int]], hashes: Sequence[int] | None) -> list[ChunkKey]:
    """The blocks' keys, hashed with the callers' hashes where given."""
    if hashes is None:
        return [ChunkKey(version, tuple(ids)) for ids in blocks]
    if len(hashes) != len(blocks):
        raise ValueError(f"{len(hashes)} hashes for {len(blocks)} blocks")
    return [ChunkKey(version, tuple(ids), token_hash) for ids, token_hash in zip(blocks, hashes, strict=True)]
