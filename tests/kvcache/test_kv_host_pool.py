"""The host pool: a first-fit free list that coalesces, never exceeds its capacity, and evicts whole blocks LRU."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from service.kvcache.host_pool import ALIGNMENT, ByteRange, FreeList, HostPool

A = ALIGNMENT


def check_invariants(ranges: list[ByteRange], allocated: list[ByteRange], capacity: int, used: int) -> None:
    """Free ranges sorted, disjoint, never adjacent (coalesced), disjoint from allocations; bytes add up."""
    for left, right in itertools.pairwise(ranges):
        assert left.end < right.offset, f"{left} and {right} touch or overlap: not coalesced"
    everything = sorted([*ranges, *allocated], key=lambda r: r.offset)
    for left, right in itertools.pairwise(everything):
        assert left.end <= right.offset, f"{left} overlaps {right}"
    assert sum(r.size for r in ranges) == capacity - used
    assert sum(r.size for r in allocated) == used <= capacity
    assert all(r.offset % A == 0 and r.end <= capacity for r in everything)


def check_free_list(free: FreeList, allocated: list[ByteRange]) -> None:
    check_invariants(free.free_ranges(), allocated, free.capacity, free.used_bytes)


# ---- free list ---------------------------------------------------------------------------------------------


def test_first_fit_takes_the_lowest_hole_that_fits() -> None:
    free = FreeList(10 * A)
    a, b, c, d = (free.allocate(n * A) for n in (1, 2, 1, 3))
    assert [r.offset if r else None for r in (a, b, c, d)] == [0, A, 3 * A, 4 * A]
    assert a is not None and b is not None and c is not None
    free.release(a)
    free.release(c)

    small = free.allocate(A)  # fits the first hole (at 0)
    bigger = free.allocate(2 * A)  # holes at 0 (taken) and 3A (1 page) are too small: the tail at 7A

    assert small == ByteRange(0, A)
    assert bigger == ByteRange(7 * A, 2 * A)


def test_release_coalesces_with_both_neighbours() -> None:
    free = FreeList(4 * A)
    a, b, c, d = (free.allocate(A) for _ in range(4))
    assert a is not None and b is not None and c is not None and d is not None
    assert free.largest_free() == 0 and free.allocate(1) is None

    free.release(a)
    free.release(c)
    assert free.free_ranges() == [ByteRange(0, A), ByteRange(2 * A, A)]  # fragmented: 2 pages, none of 2
    assert free.allocate(2 * A) is None

    free.release(b)  # joins both holes into one

    assert free.free_ranges() == [ByteRange(0, 3 * A)]
    assert free.allocate(3 * A) == ByteRange(0, 3 * A)


def test_sizes_round_up_to_the_alignment() -> None:
    free = FreeList(3 * A + 100)  # the unaligned tail is never handed out
    assert free.capacity == 3 * A
    r = free.allocate(1)
    assert r == ByteRange(0, A) and free.used_bytes == A
    assert free.allocate(2 * A + 1) is None


def test_double_release_and_foreign_ranges_are_refused() -> None:
    free = FreeList(4 * A)
    r = free.allocate(A)
    assert r is not None
    free.release(r)
    with pytest.raises(ValueError, match="overlaps free space"):
        free.release(r)
    with pytest.raises(ValueError, match="not handed out"):
        free.release(ByteRange(3, A))
    with pytest.raises(ValueError, match="not handed out"):
        free.release(ByteRange(4 * A, A))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5 * A), st.integers(0, 1000)), max_size=60))
def test_random_allocations_keep_every_invariant(ops: list[tuple[bool, int, int]]) -> None:
    free = FreeList(16 * A)
    allocated: list[ByteRange] = []
    for do_allocate, nbytes, pick in ops:
        if do_allocate or not allocated:
            r = free.allocate(nbytes)
            if r is None:
                # first fit fails only when no single free range is large enough
                assert free.largest_free() < free.rounded(nbytes)
            else:
                assert r.size == free.rounded(nbytes)
                allocated.append(r)
        else:
            free.release(allocated.pop(pick % len(allocated)))
        check_free_list(free, allocated)
    for r in allocated:
        free.release(r)
    assert free.free_ranges() == [ByteRange(0, 16 * A)]  # fully coalesced once everything is back


# ---- pool --------------------------------------------------------------------------------------------------


def reserve(pool: HostPool, key: str, pages: int) -> bool:
    """Reserve a float32 block of `pages` pages; True when it fits."""
    return pool.reserve(key, (1,), torch.float32, (pages * A // 4,)) is not None


def test_pool_is_one_aligned_allocation_and_views_are_typed() -> None:
    pool = HostPool(8 * A, pinned=False)
    shape = (2, 2, 3, 5, 4)
    slot = pool.reserve("k", (7, 8, 9), torch.bfloat16, shape)
    assert slot is not None and slot.nbytes == 2 * 2 * 3 * 5 * 4 * 2
    view = pool.view(slot)
    assert view.dtype == torch.bfloat16 and tuple(view.shape) == shape
    assert view.data_ptr() % A == 0
    view.fill_(1.5)
    assert torch.equal(pool.bytes_of(slot), view.reshape(-1).view(torch.uint8))
    assert (pool.used_bytes, pool.capacity_bytes) == (A, 8 * A)
    assert pool.view(slot, torch.int32, (slot.nbytes // 4,)).numel() == slot.nbytes // 4


def test_span_of_a_slot_is_its_whole_aligned_range() -> None:
    pool = HostPool(8 * A, pinned=False)
    pool.reserve("first", (1,), torch.uint8, (A + 1,))  # two pages
    slot = pool.reserve("k", (1,), torch.float32, (1000,))  # 4000 bytes: one page
    assert slot is not None
    span = pool.span_of(slot)
    assert span.data_ptr() % A == 0 and span.numel() == A and span.dtype == torch.uint8
    assert span.data_ptr() == pool.bytes_of(slot).data_ptr() == pool.view(slot).data_ptr()
    assert pool.bytes_of(slot).numel() == 4000  # the block's view stops at its bytes


def test_pool_evicts_least_recently_used_whole_blocks_until_one_fits() -> None:
    pool = HostPool(6 * A, pinned=False)
    for key in "abc":
        assert reserve(pool, key, 2)
    assert pool.get("a") is not None  # a is now the most recently used

    assert reserve(pool, "d", 3)  # needs 3 contiguous pages: b (2 pages) alone leaves a 2-page hole

    assert sorted(pool.keys_by_age()) == ["a", "d"]
    assert pool.evictions == 2 and pool.used_bytes == 5 * A
    assert list(pool.keys_by_age()) == ["a", "d"]  # LRU order


def test_pool_refuses_a_block_larger_than_itself_and_keeps_its_contents() -> None:
    pool = HostPool(4 * A, pinned=False)
    assert reserve(pool, "a", 2)
    assert not reserve(pool, "huge", 5)
    assert list(pool.keys_by_age()) == ["a"] and pool.evictions == 0


def test_a_zero_budget_pool_holds_nothing() -> None:
    pool = HostPool(0, pinned=True)
    assert not pool.pinned and pool.capacity_bytes == 0
    assert not reserve(pool, "a", 1)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 9), st.integers(1, 7), st.booleans()), max_size=80))
def test_pool_never_exceeds_its_capacity(ops: list[tuple[int, int, bool]]) -> None:
    pool = HostPool(12 * A, pinned=False)
    for key_number, pages, drop in ops:
        key = f"k{key_number}"
        if drop:
            pool.discard(key)
        else:
            fitted = reserve(pool, key, pages)
            assert fitted == (pages <= 12)
            assert not fitted or key in pool
        assert pool.used_bytes <= pool.capacity_bytes
        spans = [s.span for k in pool.keys_by_age() if (s := pool.peek(k)) is not None]
        check_invariants(pool.free_ranges(), spans, pool.capacity_bytes, pool.used_bytes)


def test_busy_slots_are_never_evicted() -> None:
    pool = HostPool(4 * A, pinned=False)
    busy = pool.reserve("reading", (1,), torch.float32, (2 * A // 4,), busy=True)
    assert busy is not None and reserve(pool, "idle", 2)

    assert reserve(pool, "new", 2)  # evicts the idle block, not the one a reader is filling
    assert sorted(pool.keys_by_age()) == ["new", "reading"]
    assert not reserve(pool, "more", 3)  # evicting every idle block still leaves no 3 pages around the busy one
    assert "reading" in pool

    pool.release_busy(busy)
    assert reserve(pool, "more", 3) and "reading" not in pool
