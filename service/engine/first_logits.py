"""The first token's logits of the requests that keep them (`BatchRequest.keep_first_logits`): an fp32 copy on the
host, for comparisons made after the answer (the shadow answers of `service/serving/shadow.py`).

On CUDA the copy goes to pinned memory without waiting: the stream runs it before any later step, and the
request's later tokens (or its first, read after these logits were picked) reach the host only after it, so the
copy has landed by the time its request has ended. No step waits for it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from service.engine.batch_request import BatchRequest


def keep_first_logits(group: Sequence[BatchRequest], logits: torch.Tensor) -> None:
    """For each request of `group` (row r of `logits` [len(group), vocab]) that asks and has none yet, its row."""
    for row, request in enumerate(group):
        if request.keep_first_logits and request.first_logits is None:
            request.first_logits = host_copy(logits[row])


def host_copy(row: torch.Tensor) -> torch.Tensor:
    """`row` as fp32 on the host: queued behind the device's work on CUDA, copied now elsewhere."""
    row = row.detach().float()
    if row.device.type != "cuda":
        return row.clone()
    host = torch.empty(row.shape, dtype=torch.float32, pin_memory=True)
    host.copy_(row, non_blocking=True)
    return host
