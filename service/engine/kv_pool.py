"""One bounded KV pool for every running request: contiguous slabs carved from one preallocated tensor.

The pool is a single tensor `[layers, 2, kv_heads, slots, head_dim]` (the `KVBuffer` layout with every request
side by side on the token axis), sized once in bytes, so the server's KV memory is fixed at start-up and a
full pool makes requests wait instead of raising an out-of-memory error.

Why contiguous slabs (first-fit, coalescing free list) and not pages: a request's whole sequence (stitched
context, question, answer budget) is then one token range `start .. start + size`. That keeps every existing
single-sequence path working on a slab unchanged (`KVBuffer` over a view: the stitch, the question prefill, the
naive prefill write straight into the pool), and the batched decode attends with one offset per request
(flash varlen's `cu_seqlens_k` as slab starts plus `seqused_k` as live lengths on CUDA, a slice per request on
the CPU) instead of a block table. The price is external fragmentation: a request needs one hole as large as
its reservation. Requests here reserve their whole answer budget at admission (a running request never grows,
so none is ever preempted), and freed slabs merge with free neighbours at once, which keeps holes large.

Freed slabs are poisoned so that contamination is visible: NaN (tests, debugging) makes any read of memory the
reader did not write itself turn its logits NaN; zero (the serving default) keeps dead slots finite, which
kernels that weigh dead slots by a zero (masked SDPA) need, since 0 * NaN is NaN; "none" skips the fill.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from enum import StrEnum

import torch

from service.engine.kv_buffer import KVBuffer
from service.engine.kv_layout import ModelSpec

MIB = 1 << 20


class Poison(StrEnum):
    NAN = "nan"
    ZERO = "zero"
    NONE = "none"


class PoolExhaustedError(RuntimeError):
    """No free range of the requested size right now (the request should wait)."""


@dataclass(frozen=True)
class Slab:
    """Slots `start .. start + size` of the pool, owned by one request."""

    start: int
    size: int

    @property
    def end(self) -> int:
        return self.start + self.size


class KVPool:
    """Preallocated KV slots handed out as contiguous slabs, first fit; free slabs coalesce."""

    def __init__(self, spec: ModelSpec, budget_bytes: int, poison: Poison | str = Poison.ZERO) -> None:
        self.spec = spec
        self.bytes_per_token = spec.kv_bytes_per_token()
        self.slots = budget_bytes // self.bytes_per_token
        if self.slots <= 0:
            raise ValueError(f"a KV pool of {budget_bytes} bytes holds no token ({self.bytes_per_token} B each)")
        self.poison = Poison(poison)
        shape = (spec.num_layers, 2, spec.num_kv_heads, self.slots, spec.head_dim)
        self.data = torch.empty(shape, dtype=spec.dtype, device=spec.device)
        self._fill(0, self.slots)
        # Free holes as (start, size) sorted by start; allocated slabs by start.
        self._holes: list[tuple[int, int]] = [(0, self.slots)]
        self._owned: dict[int, int] = {}

    def release(self) -> None:
        """Drop the pool's memory (its owner is closing); nothing may be allocated or read afterwards."""
        self.data = torch.empty(0, dtype=self.spec.dtype, device=self.spec.device)
        self.slots = 0
        self._holes, self._owned = [], {}

    @classmethod
    def from_mib(cls, spec: ModelSpec, mib: float, poison: Poison | str = Poison.ZERO) -> KVPool:
        return cls(spec, int(mib * MIB), poison)

    # ---- allocation ---------------------------------------------------------------------------------------

    def can_allocate(self, tokens: int) -> bool:
        """Whether one free range of `tokens` slots exists now."""
        return self._first_fit(tokens) is not None

    def allocate(self, tokens: int) -> Slab:
        """The first free range of `tokens` slots; raises `PoolExhaustedError` when none is free."""
        index = self._first_fit(tokens)
        if index is None:
            raise PoolExhaustedError(f"no free range of {tokens} slots (largest free: {self.largest_free})")
        start, size = self._holes[index]
        if size == tokens:
            del self._holes[index]
        else:
            self._holes[index] = (start + tokens, size - tokens)
        self._owned[start] = tokens
        return Slab(start, tokens)

    def free(self, slab: Slab) -> None:
        """Return a slab: poison its memory, then merge it with the free ranges on either side."""
        if self._owned.get(slab.start) != slab.size:
            raise ValueError(f"slab {slab} is not allocated from this pool")
        del self._owned[slab.start]
        self._fill(slab.start, slab.end)
        index = bisect.bisect_left(self._holes, (slab.start, 0))
        start, size = slab.start, slab.size
        if index < len(self._holes) and self._holes[index][0] == slab.end:  # the hole right after
            size += self._holes.pop(index)[1]
        if index > 0 and sum(self._holes[index - 1]) == start:  # the hole right before
            index -= 1
            start, before = self._holes.pop(index)
            size += before
        self._holes.insert(index, (start, size))

    def _first_fit(self, tokens: int) -> int | None:
        if tokens <= 0:
            raise ValueError("a slab needs at least one slot")
        return next((i for i, (_, size) in enumerate(self._holes) if size >= tokens), None)

    def _fill(self, start: int, end: int) -> None:
        if self.poison is Poison.NONE:
            return
        value = float("nan") if self.poison is Poison.NAN else 0.0
        with torch.inference_mode():
            self.data[:, :, :, start:end].fill_(value)

    # ---- views --------------------------------------------------------------------------------------------

    def view(self, slab: Slab) -> torch.Tensor:
        """The slab's storage `[layers, 2, kv_heads, size, head_dim]` (a view: writes land in the pool)."""
        return self.data[:, :, :, slab.start : slab.end]

    def buffer(self, slab: Slab) -> KVBuffer:
        """An empty `KVBuffer` over the slab, so the single-sequence stitch and prefill write into the pool."""
        return KVBuffer(self.spec, slab.size, data=self.view(slab))

    # ---- usage --------------------------------------------------------------------------------------------

    @property
    def used_slots(self) -> int:
        return sum(self._owned.values())

    @property
    def free_slots(self) -> int:
        return self.slots - self.used_slots

    @property
    def largest_free(self) -> int:
        return max((size for _, size in self._holes), default=0)

    @property
    def used_bytes(self) -> int:
        return self.used_slots * self.bytes_per_token

    @property
    def capacity_bytes(self) -> int:
        """Bytes the pool holds (the budget rounded down to whole tokens)."""
        return self.slots * self.bytes_per_token

    def holes(self) -> list[tuple[int, int]]:
        """The free ranges as (start, size), by start (for tests and metrics)."""
        return list(self._holes)
