"""Plain helpers of the KV cache tests (fixtures live in conftest.py; this module is importable by name)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from service.devtools.tiny_spec import TINY_SPEC
from service.engine.kv_layout import KVBlock, ModelSpec

if TYPE_CHECKING:  # a runtime import would pull Redis into the file-format tests' writer processes
    from service.kvcache.index import KVIndex

BASE_SPEC = TINY_SPEC

SpecFactory = Callable[..., ModelSpec]
BlockFactory = Callable[..., KVBlock]
IndexOpener = Callable[[], "KVIndex"]  # opens the same index again on every call


def random_kv(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random KV of any storable dtype; float blocks also carry NaN, ±inf and -0.0 to test bit-exactness."""
    gen = torch.Generator().manual_seed(seed)
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        return torch.randint(info.min, info.max + 1, shape, generator=gen, dtype=torch.int64).to(dtype)
    kv = torch.randn(shape, generator=gen).to(dtype)
    flat = kv.view(-1)
    flat[:4] = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0]).to(dtype)
    return kv


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor, so NaN payloads and -0.0 compare exactly."""
    return t.contiguous().reshape(-1).view(torch.uint8)


class FakeEvent:
    """Stands in for a CUDA copy event on the CPU: pending until `done` is set (or someone synchronizes)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True
