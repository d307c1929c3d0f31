"""The host tier's memory: one pinned buffer sized once at start, carved into blocks by a first-fit free list.

Pinning is slow (it maps and locks pages) and pinned memory cannot be swapped, so the pool takes its whole
byte budget in one allocation when the cache starts and never grows or shrinks per request. Blocks differ in
size (the prefix block, chunks of different token counts, other models' shapes), so the allocator is a
first-fit free list over byte ranges, coalescing neighbours on release, rather than fixed-size slabs, which
would waste up to a slab per block or need one slab size per shape. Every range starts on a 4096-byte
boundary so a later O_DIRECT read can target it and every dtype view is aligned. When a block does not fit,
whole blocks are evicted least recently used first until a contiguous range does; with everything evicted
the free list is one range again, so any block no larger than the pool fits, unless slots still being filled
by reader threads (`busy`) are in the way: those are never evicted, and the caller reads elsewhere instead.
"""

from __future__ import annotations

import bisect
import logging
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from service.kvcache import device
from service.kvcache.device import CopyEvent
from service.kvcache.quant import DiskFormat

log = logging.getLogger(__name__)

ALIGNMENT = 4096


@dataclass(frozen=True)
class ByteRange:
    """A half-open range [offset, offset + size) of the pool."""

    offset: int
    size: int

    @property
    def end(self) -> int:
        return self.offset + self.size


class FreeList:
    """First-fit allocator over [0, capacity); sizes are rounded up to `alignment`, free neighbours merge.

    Free ranges are kept sorted by offset in two parallel lists, so release finds its neighbours by bisection.
    """

    def __init__(self, capacity: int, alignment: int = ALIGNMENT) -> None:
        if capacity < 0 or alignment <= 0:
            raise ValueError("capacity must be >= 0 and alignment > 0")
        self.alignment = alignment
        self.capacity = capacity - capacity % alignment
        self._offsets: list[int] = [0] if self.capacity else []
        self._sizes: list[int] = [self.capacity] if self.capacity else []
        self.used_bytes = 0

    def rounded(self, nbytes: int) -> int:
        """The bytes an allocation of `nbytes` really takes."""
        return -(-nbytes // self.alignment) * self.alignment

    def allocate(self, nbytes: int) -> ByteRange | None:
        """The lowest free range that fits `nbytes` (rounded up), or None when none does."""
        if nbytes <= 0:
            raise ValueError("an allocation needs at least one byte")
        size = self.rounded(nbytes)
        for i, free in enumerate(self._sizes):
            if free >= size:
                offset = self._offsets[i]
                if free == size:
                    del self._offsets[i], self._sizes[i]
                else:
                    self._offsets[i], self._sizes[i] = offset + size, free - size
                self.used_bytes += size
                return ByteRange(offset, size)
        return None

    def release(self, allocated: ByteRange) -> None:
        """Give a range back, merging it with free neighbours; a range that overlaps free space is refused."""
        start, end = allocated.offset, allocated.end
        if allocated.size <= 0 or start % self.alignment or end > self.capacity:
            raise ValueError(f"{allocated} was not handed out by this free list")
        i = bisect.bisect_left(self._offsets, start)
        prev_end = self._offsets[i - 1] + self._sizes[i - 1] if i > 0 else 0
        next_start = self._offsets[i] if i < len(self._offsets) else self.capacity
        if prev_end > start or next_start < end:
            raise ValueError(f"{allocated} overlaps free space (double release?)")
        self.used_bytes -= allocated.size
        if i > 0 and prev_end == start:
            i -= 1
            start = self._offsets[i]
            del self._offsets[i], self._sizes[i]
        if i < len(self._offsets) and self._offsets[i] == end:
            end += self._sizes[i]
            del self._offsets[i], self._sizes[i]
        self._offsets.insert(i, start)
        self._sizes.insert(i, end - start)

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used_bytes

    def largest_free(self) -> int:
        return max(self._sizes, default=0)

    def free_ranges(self) -> list[ByteRange]:
        return [ByteRange(o, s) for o, s in zip(self._offsets, self._sizes, strict=True)]


@dataclass
class HostSlot:
    """One block's bytes in the pool.

    `pending` marks the last queued copy that reads or writes them; a `busy` slot is being filled by a reader
    thread and is never evicted (eviction would hand its bytes to another block mid-read).
    """

    key: str
    span: ByteRange
    nbytes: int
    token_ids: tuple[int, ...]
    dtype: torch.dtype
    shape: tuple[int, ...]
    pending: CopyEvent | None = None
    busy: bool = False
    # "native": the slot holds the block's tensor; an 8-bit form ("int8", "fp8"): its stored payload (flat
    # bytes, `dtype` uint8), dequantised on the device after each copy.
    fmt: DiskFormat = "native"
    kv_shape: tuple[int, ...] = ()  # the block's KV shape when `fmt` is an 8-bit form
    compute_dtype: torch.dtype | None = None  # what an 8-bit form dequantises to


class HostPool:
    """A fixed host buffer holding whole blocks by key, evicting the least recently used to make room."""

    def __init__(self, capacity_bytes: int, pinned: bool, alignment: int = ALIGNMENT) -> None:
        self._free = FreeList(capacity_bytes, alignment)
        self.pinned = pinned and self._free.capacity > 0
        self._buffer = _aligned_buffer(self._free.capacity, alignment, self.pinned)
        self._slots: OrderedDict[str, HostSlot] = OrderedDict()
        self.evictions = 0
        self.on_evict: Callable[[str], None] | None = None  # told of each block LRU pressure evicts

    @property
    def capacity_bytes(self) -> int:
        return self._free.capacity

    @property
    def used_bytes(self) -> int:
        return self._free.used_bytes

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, key: object) -> bool:
        return key in self._slots

    def keys_by_age(self) -> Iterator[str]:
        """Keys from least to most recently used."""
        return iter(list(self._slots))

    def free_ranges(self) -> list[ByteRange]:
        return self._free.free_ranges()

    def peek(self, key: str) -> HostSlot | None:
        """The slot of `key` without changing its LRU position."""
        return self._slots.get(key)

    def get(self, key: str) -> HostSlot | None:
        """The slot of `key`, now the most recently used; None when absent."""
        slot = self._slots.get(key)
        if slot is not None:
            self._slots.move_to_end(key)
        return slot

    def reserve(
        self, key: str, token_ids: tuple[int, ...], dtype: torch.dtype, shape: tuple[int, ...], busy: bool = False
    ) -> HostSlot | None:
        """A slot for a block of this dtype and shape, evicting idle LRU blocks as needed; None when busy
        slots leave no room or the block is larger than the pool.

        The slot is registered at once (most recently used); a caller whose fill fails must `discard` it, and
        one that reserved it `busy` must `release_busy` it once filled.
        """
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if nbytes <= 0 or self._free.rounded(nbytes) > self.capacity_bytes:
            return None
        self.discard(key)
        span = self._free.allocate(nbytes)
        while span is None:
            if not self._evict_oldest_idle():
                return None
            span = self._free.allocate(nbytes)
        slot = HostSlot(key, span, nbytes, tuple(token_ids), dtype, tuple(shape), busy=busy)
        self._slots[key] = slot
        return slot

    def release_busy(self, slot: HostSlot) -> None:
        """The slot is filled; it may be evicted from now on."""
        slot.busy = False

    def bytes_of(self, slot: HostSlot) -> torch.Tensor:
        """The slot's memory as flat uint8 (exactly the block's bytes)."""
        return self._buffer[slot.span.offset : slot.span.offset + slot.nbytes]

    def span_of(self, slot: HostSlot) -> torch.Tensor:
        """The slot's whole range as flat uint8: starts page-aligned, the block's bytes rounded up to the
        alignment (what an O_DIRECT read of whole pages may write; the bytes past the block are its own)."""
        return self._buffer[slot.span.offset : slot.span.end]

    def view(
        self, slot: HostSlot, dtype: torch.dtype | None = None, shape: tuple[int, ...] | None = None
    ) -> torch.Tensor:
        """The slot's memory typed as the block it holds (or as the given dtype and shape)."""
        return self.bytes_of(slot).view(dtype or slot.dtype).view(shape or slot.shape)

    def discard(self, key: str) -> bool:
        """Drop a block (after its pending copy finished); False when it was not held."""
        slot = self._slots.pop(key, None)
        if slot is None:
            return False
        device.wait_host(slot.pending)  # a copy may still be reading or writing these bytes
        self._free.release(slot.span)
        return True

    def _evict_oldest_idle(self) -> bool:
        """Evict the least recently used slot that is not busy; False when every slot is busy."""
        key = next((k for k, slot in self._slots.items() if not slot.busy), None)
        if key is None:
            return False
        log.debug("host pool full: evicting block %s", key)
        self.discard(key)
        self.evictions += 1
        if self.on_evict is not None:
            self.on_evict(key)
        return True


def _aligned_buffer(capacity: int, alignment: int, pinned: bool) -> torch.Tensor:
    """`capacity` bytes starting on an `alignment` boundary, taken in one allocation."""
    if capacity == 0:
        return device.allocate_host(0, pinned=False)
    raw = device.allocate_host(capacity + alignment, pinned)
    start = -raw.data_ptr() % alignment
    return raw[start : start + capacity]
