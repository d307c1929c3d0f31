"""Which KV path serves turbo answers, chosen once at start: the shared chunk arena (zero copy, `shared_chunks.py`)
or the copy path (each answer's context stitched into its own slab).

The shared path needs segment attention for the model on its device: the Triton kernels on CUDA, the torch
reference on the CPU (fp32, per row: a development and test path). `KVSTITCH_SHARED_CHUNKS=auto` (the default)
serves it where the kernels run (CUDA with Triton, an even head size) and the copy path elsewhere; `on` asks for
it anywhere segment attention runs, the CPU's reference included; `off` never. Where the engine cannot serve what
was asked (another device, CUDA without Triton, an odd head size the rotation cannot split, or a start-up gate that
found the zero-copy attention off the reference), the copy path serves instead, and the reason is logged (for
`on`), shown on `/readyz` and exported as a metric.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from service.engine.fused_stitch import triton_runs_on
from service.engine.kv_layout import ModelSpec


class KVPathMode(StrEnum):
    SHARED = "shared"
    COPY = "copy"


class KVPathReason(StrEnum):
    """Why the path is what it is (a metric label: a fixed, small set)."""

    ON = "on"  # asked for and served
    OFF = "off"  # not asked for
    DEVICE = "device"  # a device segment attention does not run on
    TRITON = "triton"  # CUDA without Triton: no kernels, and the per-row reference is far too slow to serve
    HEAD_DIM = "head_dim"  # RoPE rotates head halves: an odd head size has none
    GATE = "gate"  # the start-up gate found the zero-copy attention off the reference
    AUTO = "auto"  # `auto` and the kernels do not run here (the CPU's torch reference is too slow to serve)


@dataclass(frozen=True)
class KVPath:
    """The chosen path, why, and (shared) which segment attention runs it: `triton` or `torch`."""

    mode: KVPathMode
    reason: KVPathReason
    detail: str
    attention: str | None = None

    @property
    def shared(self) -> bool:
        return self.mode is KVPathMode.SHARED

    def fallback(self, reason: KVPathReason, detail: str) -> KVPath:
        """The copy path instead of this one, for `reason`."""
        return replace(self, mode=KVPathMode.COPY, reason=reason, detail=detail, attention=None)

    def as_json(self) -> dict[str, Any]:
        """What `/readyz` shows under `kv_path`."""
        mode, reason = self.mode.value, self.reason.value
        return {"mode": mode, "reason": reason, "detail": self.detail, "attention": self.attention}


COPY_PATH = KVPath(KVPathMode.COPY, KVPathReason.OFF, "KVSTITCH_SHARED_CHUNKS=off")


def choose_kv_path(requested: str, spec: ModelSpec) -> KVPath:
    """The path for a model of `spec` under `KVSTITCH_SHARED_CHUNKS=requested` (auto, on, off): shared where asked
    for and segment attention serves it (for auto: its Triton kernels), else the copy path with the reason."""
    if requested == "off":
        return COPY_PATH
    if requested not in ("auto", "on"):
        raise ValueError(f"KVSTITCH_SHARED_CHUNKS must be auto, on or off, not {requested!r}")
    asked = KVPath(KVPathMode.SHARED, KVPathReason.ON, f"KVSTITCH_SHARED_CHUNKS={requested}")
    served = _served(asked, spec)
    if requested == "on" or served.attention == "triton":
        return served
    # auto: the CPU's torch reference is a development path, too slow to serve by default.
    why = "the torch reference is too slow to serve" if served.shared else served.detail
    return asked.fallback(KVPathReason.AUTO, f"{asked.detail}: {why}; the copy path serves on {spec.device.type}")


def _served(asked: KVPath, spec: ModelSpec) -> KVPath:
    """`asked` with the segment attention that serves it for `spec`, or the copy path naming why none does."""
    device = spec.device.type
    if spec.head_dim % 2:
        return asked.fallback(KVPathReason.HEAD_DIM, f"segment attention needs an even head size, not {spec.head_dim}")
    if device == "cuda":
        if not triton_runs_on(spec.device):
            return asked.fallback(KVPathReason.TRITON, "the segment attention kernels need Triton, not installed")
        return replace(asked, attention="triton")
    if device == "cpu":
        return replace(asked, attention="torch")
    return asked.fallback(KVPathReason.DEVICE, f"segment attention runs on CUDA or the CPU, not {device}")
