"""Small host tensors onto the device without waiting for the GPU.

A plain `tensor.to("cuda")` from pageable memory is a synchronous copy: the host blocks until the stream has run
everything queued before it. The overlapped decode step (scheduler.py) launches a step while the previous one
still runs, so the few host-built tensors of a step (sampling settings, row indices) go through pinned memory
and an asynchronous copy instead; torch's pinned allocator keeps the staging block alive until the copy is done.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` on `device`; on CUDA an asynchronous copy from pinned memory (the host does not wait)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def copy_into(device_tensor: torch.Tensor, host: torch.Tensor) -> None:
    """Queue `host`'s values into `device_tensor` (a CUDA graph's static input, say) by an asynchronous copy from a
    fresh pinned staging block. Not one reused buffer: overwriting it would first wait for its last copy, i.e. for
    the device to reach that point, and a host that fills the next replay's inputs while the device still runs the
    previous ones must not wait there."""
    with torch.inference_mode():
        device_tensor.copy_(host.pin_memory(), non_blocking=True)


def pinned_copy(values: np.ndarray) -> torch.Tensor:
    """`values` in pinned host memory, copied by numpy on this thread: `Tensor.pin_memory()` copies a large array
    with torch's intra-op thread pool, whose threads then spin on every core for a copy of a few hundred KB."""
    source = torch.from_numpy(values)
    staged = torch.empty(source.shape, dtype=source.dtype, pin_memory=True)
    np.copyto(staged.numpy(), values)
    return staged
