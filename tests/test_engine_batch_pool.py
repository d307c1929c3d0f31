"""The KV pool's allocator on tiny shapes: exact budget, first fit, coalescing, refusal, poisoning, usage."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from service.engine.kv_buffer import KVBuffer
from service.engine.kv_layout import ModelSpec
from service.engine.kv_pool import KVPool, PoolExhaustedError, Slab

# 1 layer x (K, V) x 1 head x 2 dims x 4 bytes: 16 bytes a token.
SPEC = ModelSpec(
    model_type="llama",
    num_layers=1,
    num_heads=1,
    num_kv_heads=1,
    head_dim=2,
    hidden_size=2,
    vocab_size=8,
    rope_type="default",
    max_positions=1024,
    sliding_window=None,
    dtype=torch.float32,
    device=torch.device("cpu"),
)
TOKEN = 16


def test_budget_rounds_down_to_whole_tokens_and_fills_exactly() -> None:
    assert SPEC.kv_bytes_per_token() == TOKEN
    pool = KVPool(SPEC, 10 * TOKEN + TOKEN - 1)
    assert (pool.slots, pool.capacity_bytes) == (10, 10 * TOKEN)
    assert tuple(pool.data.shape) == (1, 2, 1, 10, 2)
    slabs = [pool.allocate(3), pool.allocate(7)]
    assert slabs == [Slab(0, 3), Slab(3, 7)]
    assert (pool.used_bytes, pool.free_slots, pool.holes()) == (10 * TOKEN, 0, [])
    assert not pool.can_allocate(1)
    with pytest.raises(ValueError, match="no token"):
        KVPool(SPEC, TOKEN - 1)


def test_refuses_oversize_and_non_positive_requests() -> None:
    pool = KVPool(SPEC, 8 * TOKEN)
    assert not pool.can_allocate(9)
    with pytest.raises(PoolExhaustedError, match="9 slots"):
        pool.allocate(9)
    with pytest.raises(ValueError, match="at least one"):
        pool.allocate(0)
    assert pool.used_slots == 0


def test_first_fit_and_coalescing_in_any_order() -> None:
    pool = KVPool(SPEC, 20 * TOKEN)
    a, b, c, d = (pool.allocate(n) for n in (4, 5, 6, 5))
    assert [s.start for s in (a, b, c, d)] == [0, 4, 9, 15]
    pool.free(b)
    pool.free(d)
    assert pool.holes() == [(4, 5), (15, 5)]
    # 6 slots fit in no hole although 10 are free: fragmentation is refused, not split.
    assert pool.free_slots == 10 and pool.largest_free == 5 and not pool.can_allocate(6)
    assert pool.allocate(2) == Slab(4, 2)  # the first hole that fits, not the best one
    pool.free(Slab(4, 2))
    pool.free(a)  # merges with the hole after it
    assert pool.holes() == [(0, 9), (15, 5)]
    pool.free(c)  # bridges both neighbours
    assert pool.holes() == [(0, 20)] and pool.used_slots == 0
    assert pool.allocate(20) == Slab(0, 20)


def test_free_checks_ownership() -> None:
    pool = KVPool(SPEC, 8 * TOKEN)
    slab = pool.allocate(4)
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(Slab(0, 3))
    pool.free(slab)
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(slab)  # double free


@pytest.mark.parametrize(("poison", "check"), [("nan", torch.isnan), ("zero", lambda t: t == 0)])
def test_freed_slabs_are_poisoned_and_views_write_through(
    poison: str, check: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    pool = KVPool(SPEC, 8 * TOKEN, poison=poison)
    assert bool(check(pool.data).all())  # fresh memory is poisoned too
    first, second = pool.allocate(3), pool.allocate(5)
    buffer = pool.buffer(first)
    buffer.write(0, 0, torch.ones(1, 3, 2), torch.full((1, 3, 2), 2.0))
    pool.view(second).fill_(7.0)
    assert bool((pool.data[:, 0, :, :3] == 1).all()) and bool((pool.data[:, 1, :, :3] == 2).all())
    pool.free(first)
    assert bool(check(pool.data[:, :, :, :3]).all())
    assert bool((pool.data[:, :, :, 3:] == 7).all())  # the neighbour is untouched


def test_buffer_over_a_slab_refuses_a_wrong_shape() -> None:
    pool = KVPool(SPEC, 8 * TOKEN)
    with pytest.raises(ValueError, match="storage"):
        KVBuffer(SPEC, 4, data=pool.view(pool.allocate(3)))
