"""The three places a block's KV can be found, fastest first: device memory, the pinned host pool, disk files.

Each tier owns its own budget and LRU order and knows nothing of the others; `KVStore` moves blocks between
them (promotion on a hit, demotion on pressure). Tiers are not thread-safe on their own except `DiskTier`,
whose state lives in the (process- and thread-safe) index and the files.

Every tier tells an optional `TierListener` of each block that enters or leaves it (`TierMove`), whatever caused
it: promotion, LRU pressure, a corrupt file, a removal. That is the port a fleet's router learns placement through
(`service/fleet/`): the tiers never know who listens, and with no listener (the default) they do nothing more.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import torch

from service.engine.kv_layout import KVBlock, ModelSpec
from service.kvcache import device, quant
from service.kvcache.device import CopyEvent, CopyStream
from service.kvcache.fileformat import (
    CorruptBlockError,
    DirectReads,
    MissingBlockError,
    QuantBlock,
    block_relpath,
    read_block,
    read_quant_block,
    write_block,
    write_block_bytes,
)
from service.kvcache.host_pool import HostPool, HostSlot
from service.kvcache.index import IndexEntry, KVIndex

log = logging.getLogger(__name__)

# How many LRU entries one eviction round asks the index for.
EVICTION_BATCH = 32


class Tier(StrEnum):
    """Where a block came from; `miss` means it was computed."""

    GPU = "gpu"
    HOST = "host"
    DISK = "disk"
    MISS = "miss"


class TierChange(StrEnum):
    ADD = "add"
    EVICT = "evict"


@dataclass(frozen=True, slots=True)
class TierMove:
    """A block entered (`add`) or left (`evict`) one tier; `tokens` is its token count (0 on an eviction)."""

    change: TierChange
    tier: Tier
    key: str
    tokens: int = 0


# Called on the thread that moved the block (the engine's, or the disk writer's): it must be quick and thread-safe.
TierListener = Callable[[TierMove], None]


def _tell(listener: TierListener | None, change: TierChange, tier: Tier, key: str, tokens: int = 0) -> None:
    if listener is not None:
        listener(TierMove(change, tier, key, tokens))


# ---- device ------------------------------------------------------------------------------------------------


class GpuTier:
    """Blocks resident in device memory, least recently used evicted first, within a byte budget.

    It only holds references: the tensors live wherever the engine's device is, so on a CPU-only host the
    same class is exercised with CPU tensors (a budget of 0 disables it). Blocks handed out are shared with
    the tier and must be treated as read-only, which the stitcher does. A block put while its H2D copy may
    still be running keeps that copy's event until it completed, so a later hit is never read too early, even
    when the fetch that copied it did not order any stream after it.

    Pins: a request that reads a block where it lies (rather than copying it) pins it for as long as it runs.
    Eviction passes over pinned blocks, and a pinned block that is discarded (its document deleted) leaves the
    lookup at once but keeps its bytes counted until the last reader unpins it: the budget always covers what is
    held, and no reader's memory is handed to another block under it.
    """

    def __init__(self, budget_bytes: int, listener: TierListener | None = None) -> None:
        if budget_bytes < 0:
            raise ValueError("the GPU tier budget must be >= 0")
        self.budget_bytes = budget_bytes
        self.listener = listener
        self.used_bytes = 0
        self.evictions = 0
        self._blocks: OrderedDict[str, KVBlock] = OrderedDict()
        self._arriving: dict[str, CopyEvent] = {}
        self._pins: dict[str, int] = {}
        self._pinned_bytes = 0
        self._discarded: dict[str, KVBlock] = {}  # discarded while pinned: dropped at the last unpin

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: object) -> bool:
        return key in self._blocks

    def peek(self, key: str) -> KVBlock | None:
        """The block without changing its LRU position."""
        return self._blocks.get(key)

    def held(self) -> list[tuple[str, int]]:
        """(key, token count) of every block held, least recently used first."""
        return [(key, block.num_tokens) for key, block in self._blocks.items()]

    def get(self, key: str) -> KVBlock | None:
        """The block, now the most recently used; None when absent."""
        block = self._blocks.get(key)
        if block is not None:
            self._blocks.move_to_end(key)
        return block

    def arrival(self, key: str) -> CopyEvent | None:
        """The event the held block's copy lands on while it may still be running; None once it completed."""
        event = self._arriving.get(key)
        if event is not None and device.is_done(event):
            del self._arriving[key]
            return None
        return event

    def put(self, key: str, block: KVBlock, arriving: CopyEvent | None = None) -> list[tuple[str, KVBlock]]:
        """Hold a block (whose copy lands on `arriving`); returns what no longer fits (LRU entries, or the
        block itself when over budget).

        The caller may demote the returned blocks to the host tier.
        """
        if key in self._blocks:
            self._blocks.move_to_end(key)
            return []
        size = block.nbytes()
        # A key discarded while pinned is not rewritten under its readers: it comes back after they are done.
        if key in self._discarded:
            return [(key, block)]
        # Only unpinned blocks can make room; when they cannot make enough, nothing is evicted for nothing.
        if self._pinned_bytes + size > self.budget_bytes:
            return [(key, block)]
        evicted = []
        while self.used_bytes + size > self.budget_bytes:
            old_key = next(k for k in self._blocks if k not in self._pins)
            old = self._blocks.pop(old_key)
            self._drop(old_key, old)
            self.evictions += 1
            evicted.append((old_key, old))
        self._blocks[key] = block
        self.used_bytes += size
        if arriving is not None:
            self._arriving[key] = arriving
        _tell(self.listener, TierChange.ADD, Tier.GPU, key, block.num_tokens)
        return evicted

    def discard(self, key: str) -> bool:
        """Drop a block from the tier (a pinned one leaves the lookup now, its bytes at the last unpin)."""
        block = self._blocks.pop(key, None)
        if block is None:
            return False
        if key in self._pins:
            self._discarded[key] = block
            _tell(self.listener, TierChange.EVICT, Tier.GPU, key)  # no new reader can have it from now on
            return True
        self._drop(key, block)
        return True

    def pin(self, key: str) -> KVBlock | None:
        """The block, held in place until as many `unpin(key)` calls; None (nothing pinned) when absent."""
        block = self._blocks.get(key)
        if block is None:
            return None
        count = self._pins.get(key, 0)
        if count == 0:
            self._pinned_bytes += block.nbytes()
        self._pins[key] = count + 1
        return block

    def unpin(self, key: str) -> None:
        count = self._pins.get(key, 0)
        if count == 0:
            raise ValueError(f"unpin of {key}, which is not pinned")
        if count > 1:
            self._pins[key] = count - 1
            return
        del self._pins[key]
        discarded = self._discarded.pop(key, None)
        block = discarded if discarded is not None else self._blocks[key]
        self._pinned_bytes -= block.nbytes()
        if discarded is not None:
            self._drop(key, block, told=True)

    def pins(self, key: str) -> int:
        """How many readers hold the block in place."""
        return self._pins.get(key, 0)

    @property
    def pinned_bytes(self) -> int:
        return self._pinned_bytes

    def _drop(self, key: str, block: KVBlock, told: bool = False) -> None:
        self.used_bytes -= block.nbytes()
        self._arriving.pop(key, None)
        if not told:
            _tell(self.listener, TierChange.EVICT, Tier.GPU, key)


# ---- host --------------------------------------------------------------------------------------------------


class HostTier:
    """Blocks in the pinned host pool, copied to the device on the cache's copy stream.

    One stream carries both directions, so a block demoted from the device (D2H) and promoted again (H2D)
    is ordered without extra waits; every slot remembers its last copy so the pool waits before reuse.
    """

    def __init__(
        self, pool: HostPool, target: torch.device, stream: CopyStream | None, listener: TierListener | None = None
    ) -> None:
        self.pool = pool
        self.target = target
        self.stream = stream
        self.listener = listener
        pool.on_evict = self._evicted  # LRU pressure evicts inside the pool

    def _evicted(self, key: str) -> None:
        _tell(self.listener, TierChange.EVICT, Tier.HOST, key)

    @property
    def enabled(self) -> bool:
        return self.pool.capacity_bytes > 0

    def __contains__(self, key: object) -> bool:
        return key in self.pool

    def get(self, key: str) -> HostSlot | None:
        return self.pool.get(key)

    def reserve(
        self,
        key: str,
        token_ids: tuple[int, ...],
        dtype: torch.dtype,
        shape: tuple[int, ...],
        fmt: quant.DiskFormat = "native",
    ) -> HostSlot | None:
        """A busy slot for a block about to be read from disk; None when the pool cannot hold it now.

        With an 8-bit `fmt` the slot holds the stored payload (half the bytes) and every copy to the device
        dequantises it into `dtype`. The caller calls `filled` once the read succeeded, or `discard` when it
        failed.
        """
        if fmt == "native":
            slot = self.pool.reserve(key, token_ids, dtype, shape, busy=True)
        else:
            nbytes = quant.payload_nbytes(fmt, shape)
            slot = self.pool.reserve(key, token_ids, torch.uint8, (nbytes,), busy=True)
            if slot is not None:
                slot.fmt, slot.kv_shape, slot.compute_dtype = fmt, shape, dtype
        if slot is not None:
            _tell(self.listener, TierChange.ADD, Tier.HOST, key, len(token_ids))
        return slot

    def filled(self, slot: HostSlot) -> None:
        self.pool.release_busy(slot)

    def buffer(self, slot: HostSlot) -> torch.Tensor:
        """The slot's whole page-aligned range as flat uint8, for `read_block(into=...)`: the block's bytes
        rounded up to whole pages, so an O_DIRECT read of whole pages fits."""
        return self.pool.span_of(slot)

    def to_device(self, slot: HostSlot) -> tuple[KVBlock, CopyEvent | None]:
        """Start the H2D copy of a held block; the slot stays busy until the returned event completed.

        An 8-bit slot copies its payload and is dequantised on the copy stream; the event marks the result.
        """
        dequantize = _dequantizer(slot)
        if dequantize is None:
            kv, event = device.copy_to_device(self.pool.view(slot), self.target, self.stream)
        else:
            kv, event = device.copy_to_device(self.pool.view(slot), self.target, self.stream, dequantize)
        if event is not None:
            slot.pending = event  # queued after any earlier copy of this slot, on the same stream
        return KVBlock(slot.token_ids, kv), event

    def to_device_by_layers(
        self, slots: list[HostSlot], groups: tuple[tuple[int, int], ...]
    ) -> tuple[list[KVBlock], list[CopyEvent]] | None:
        """Start the H2D copies of held blocks layer group by layer group (`device.copy_layers_to_device`);
        returns the blocks and one event per group, or None where copies are plain (a CPU device: use
        `to_device`). Every slot stays busy until the last group's event completed."""
        if self.stream is None or not device.uses_cuda(self.target):
            return None
        if any(slot.fmt != "native" for slot in slots):
            raise ValueError("8-bit slots are copied whole (to_device), not by layer groups")
        hosts = [self.pool.view(slot) for slot in slots]
        kvs, events = device.copy_layers_to_device(hosts, self.target, groups, self.stream)
        for slot in slots:
            slot.pending = events[-1]
        return [KVBlock(slot.token_ids, kv) for slot, kv in zip(slots, kvs, strict=True)], events

    def store(self, key: str, block: KVBlock) -> bool:
        """Copy a block in (demotion from the device, or a computed block); False when it cannot be held."""
        if self.pool.get(key) is not None:
            return True
        slot = self.pool.reserve(key, block.token_ids, block.kv.dtype, tuple(block.kv.shape))
        if slot is None:
            return False
        slot.pending = device.copy_to_host(block.kv, self.pool.view(slot), self.stream)
        _tell(self.listener, TierChange.ADD, Tier.HOST, key, block.num_tokens)
        return True

    def held(self) -> list[tuple[str, int]]:
        """(key, token count) of every block in the pool, least recently used first."""
        slots = (self.pool.peek(key) for key in self.pool.keys_by_age())
        return [(slot.key, len(slot.token_ids)) for slot in slots if slot is not None]

    def discard(self, key: str) -> bool:
        dropped = self.pool.discard(key)
        if dropped:
            _tell(self.listener, TierChange.EVICT, Tier.HOST, key)
        return dropped


def _dequantizer(slot: HostSlot) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """What turns a copied 8-bit payload into the block's KV (None for a native slot)."""
    fmt, shape, dtype = slot.fmt, slot.kv_shape, slot.compute_dtype
    if fmt == "native" or dtype is None:
        return None
    return lambda flat: quant.dequantize(quant.unpack(flat, fmt, shape, dtype))


# ---- disk --------------------------------------------------------------------------------------------------


class DiskTier:
    """Block files under `cache_dir` at `block_relpath(key)`, listed in a `KVIndex`, within a byte budget.

    A budget of 0 disables writing. The index's byte total is the tier's size; when a write pushes it over the
    budget, the least recently used files go, entry first so no reader is sent to a vanishing file. A file
    that fails any check is deleted with its entry and reported to the caller, who recomputes it. With
    `direct_io`, payloads are read with O_DIRECT into page-aligned buffers (the host pool's slots) where the
    filesystem allows it; directories that refuse it are remembered and read buffered.
    """

    def __init__(
        self,
        cache_dir: Path,
        index: KVIndex,
        fingerprint: str,
        spec: ModelSpec,
        budget_bytes: int,
        direct_io: bool = False,
        fmt: quant.DiskFormat = "native",
        listener: TierListener | None = None,
    ) -> None:
        if budget_bytes < 0:
            raise ValueError("the disk tier budget must be >= 0")
        self.listener = listener
        if fmt not in quant.DISK_FORMATS:
            raise ValueError(f"unknown disk format {fmt!r}; one of {', '.join(quant.DISK_FORMATS)}")
        self.fmt = fmt
        self.cache_dir = Path(cache_dir)
        self.index = index
        self.fingerprint = fingerprint
        self.spec = spec
        self.budget_bytes = budget_bytes
        self.direct = DirectReads() if direct_io else None
        self.evictions = 0
        self._lock = threading.Lock()  # counters only; files and index are safe on their own

    def path_of(self, key: str) -> Path:
        return self.cache_dir / block_relpath(key)

    def contains(self, key: str) -> bool:
        """True when the index lists the block (the file is checked only when read)."""
        return self.index.get(key) is not None

    def used_bytes(self) -> int:
        return self.index.total_bytes()

    def read(self, key: str, token_ids: tuple[int, ...], into: torch.Tensor | None) -> KVBlock | QuantBlock:
        """The checked block, read straight into `into` when given; in an 8-bit form, still quantised.

        Raises `CorruptBlockError` after deleting a bad file and its entry, and `MissingBlockError` after
        dropping an entry whose file is gone; both mean: recompute.
        """
        path = self.path_of(key)
        try:
            if self.fmt != "native":
                return read_quant_block(
                    path,
                    key,
                    self.fingerprint,
                    self.spec,
                    self.fmt,
                    into,
                    expected_token_ids=token_ids,
                    direct=self.direct,
                )
            return read_block(
                path, key, self.fingerprint, self.spec, into=into, expected_token_ids=token_ids, direct=self.direct
            )
        except CorruptBlockError as err:
            log.warning("corrupt KV block, deleting it: %s", err)
            self.remove(key)
            raise
        except MissingBlockError:
            log.warning("KV block %s is indexed but its file is gone; dropping the entry", key)
            if self.index.remove(key):
                _tell(self.listener, TierChange.EVICT, Tier.DISK, key)
            raise

    def wants(self, key: str, nbytes: int) -> bool:
        """True when a block of `nbytes` would be written: it fits the budget and is not stored yet."""
        if nbytes > self.budget_bytes:
            return False
        return self.index.get(key) is None or not self.path_of(key).is_file()

    def write(self, key: str, block: KVBlock) -> int:
        """Store a block unless it already is; returns the bytes written (0 when stored already or too big).

        Room is made first (least recently used blocks evicted down to the budget less this block), so a full
        budget, or a disk that filled up before its budget did, does not fail every later write. A write that
        fails leaves nothing behind: no temp file, no file without an index entry."""
        return self._store(
            key,
            self.stored_nbytes(block),
            block.num_tokens,
            lambda path: write_block(path, key, self.fingerprint, block, self.fmt),
        )

    def write_bytes(self, key: str, data: bytes, num_tokens: int) -> int:
        """Store a block file's checked bytes as they are (the shared tier's copy), like `write`."""
        return self._store(key, len(data), num_tokens, lambda path: write_block_bytes(path, key, data))

    def _store(self, key: str, nbytes: int, num_tokens: int, write: Callable[[Path], int]) -> int:
        if not self.wants(key, nbytes):
            return 0
        self.enforce_budget(limit=self.budget_bytes - nbytes)
        path = self.path_of(key)
        try:
            size = write(path)
            now = time.time()
            self.index.put(IndexEntry(key, block_relpath(key), size, num_tokens, now, now))
        except BaseException:
            self._drop_unindexed(path, key)
            raise
        _tell(self.listener, TierChange.ADD, Tier.DISK, key, num_tokens)
        self.enforce_budget(keep=key)  # the header may have pushed it a page past
        return size

    def trim(self) -> int:
        """At start: evict down to the budget (it may be lower than the last run's); how many blocks went.
        A budget of 0 means the tier is off, not empty: nothing is deleted then."""
        return self.enforce_budget() if self.budget_bytes > 0 else 0

    def _drop_unindexed(self, path: Path, key: str) -> None:
        """After a failed write: a file the rename put in place but the index does not list goes (a file that is
        listed is a complete one, written before); an index that cannot even be asked leaves the file to
        `repair` at the next start."""
        try:
            listed = self.index.get(key) is not None
        except Exception:
            log.warning("KV index unreachable after a failed write of %s; repair at start will reconcile", key)
            return
        if not listed:
            path.unlink(missing_ok=True)

    def stored_nbytes(self, block: KVBlock) -> int:
        """The payload bytes a block takes in this tier's form."""
        return quant.stored_nbytes(self.fmt, tuple(block.kv.shape), block.kv.element_size())

    def touch(self, keys: Iterable[str], now: float) -> None:
        for key in keys:
            self.index.touch(key, now)

    def remove(self, key: str) -> None:
        listed = self.index.remove(key)
        self.path_of(key).unlink(missing_ok=True)
        if listed:
            _tell(self.listener, TierChange.EVICT, Tier.DISK, key)

    def enforce_budget(self, keep: str | None = None, limit: int | None = None) -> int:
        """Evict least recently used blocks (never `keep`) until the total is within `limit` (default: the
        budget); returns how many went."""
        limit = self.budget_bytes if limit is None else max(0, limit)
        removed = 0
        while self.index.total_bytes() > limit:
            victims = [e for e in self.index.lru(EVICTION_BATCH) if e.key != keep]
            if not victims:
                # Only the new block is left and it alone is over budget (its header pushed it past): drop it.
                if keep is not None and self.index.get(keep) is not None:
                    self.remove(keep)
                    removed += 1
                break
            for entry in victims:
                self.remove(entry.key)
                removed += 1
                if self.index.total_bytes() <= limit:
                    break
        with self._lock:
            self.evictions += removed
        return removed
