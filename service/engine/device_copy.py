"""Small host tensors onto the device without waiting for the GPU.

A plain `tensor.to("cuda")` from pageable memory is a synchronous copy: the host blocks until the stream has run
everything queued before it. The overlapped decode step (scheduler.py) launches a step while the previous one
still runs, so the few host-built tensors of a step (sampling settings, row indices) go through pinned memory
and an asynchronous copy instead; torch's pinned allocator keeps the staging block alive until the copy is done.
"""

from __future__ import annotations

import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` on `device`; on CUDA an asynchronous copy from pinned memory (the host does not wait)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
