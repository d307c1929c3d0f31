"""Background work of the store that a request must not wait for: writing computed blocks, touching the index.

One worker thread does it all, in submission order, so writes never compete with each other for the disk and
the disk budget is enforced by one writer per process. Device tensors are copied to the host on the worker's
own copy stream (after the compute that produced them, via an event recorded at submission), so the
request's compute stream never waits for a write.
"""

from __future__ import annotations

import concurrent.futures
import errno
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable

import torch

from service.engine.kv_layout import KVBlock
from service.kvcache import device
from service.kvcache.device import CopyEvent
from service.kvcache.index import INDEX_ERRORS
from service.kvcache.tiers import DiskTier
from service.outage import OutageLog

log = logging.getLogger(__name__)

# Why a write failed: the index (Redis or SQLite) is away, the disk is full (or over quota), the disk refused the
# file otherwise, or anything else (a bug: logged with its traceback every time).
WRITE_ERROR_REASONS = ("index", "disk", "no_space", "other")
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class WriteBack:
    """A single-thread queue of disk writes and index touches; `flush` waits until it is empty."""

    def __init__(
        self, disk: DiskTier, source_device: torch.device, on_written: Callable[[str], None] | None = None
    ) -> None:
        self._disk = disk
        self._on_written = on_written  # told of each computed block written (the shared tier uploads it)
        self._device = source_device
        self._stream = device.new_copy_stream(source_device)
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-writeback")
        self._lock = threading.Lock()
        self._pending: set[concurrent.futures.Future[None]] = set()
        self._queued_keys: set[str] = set()
        self.blocks_written = 0
        self.bytes_written = 0
        self.errors: Counter[str] = Counter()
        # An unreachable index fails every queued touch and write: logged once per outage, counted each time.
        self._outages = {
            "index": OutageLog(log, "KV index update"),
            "disk": OutageLog(log, "KV block write"),
            "no_space": OutageLog(log, "KV block write (disk full)"),
        }

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def error_counts(self) -> dict[str, int]:
        """Failed background writes and touches so far, by reason (every reason present, 0 when none)."""
        with self._lock:
            return {reason: self.errors[reason] for reason in WRITE_ERROR_REASONS}

    def write(self, key: str, block: KVBlock) -> bool:
        """Queue a block for the disk tier; False when the same key is already queued."""
        with self._lock:
            if key in self._queued_keys:
                return False
            self._queued_keys.add(key)
        ready = device.record_event(self._device)
        self._submit(lambda: self._write(key, block, ready))
        return True

    def write_bytes(self, key: str, data: bytes, num_tokens: int) -> bool:
        """Queue a block file's checked bytes for the disk tier as they are (a copy of the shared tier's object,
        never shared again); False when the same key is already queued."""
        with self._lock:
            if key in self._queued_keys:
                return False
            self._queued_keys.add(key)
        self._submit(lambda: self._write_bytes(key, data, num_tokens))
        return True

    def touch(self, keys: Iterable[str]) -> None:
        """Queue an LRU refresh of the blocks just used (stamped now, applied later)."""
        keys, now = list(keys), time.time()
        if keys:
            self._submit(lambda: self._touch(keys, now))

    def flush(self, timeout: float | None = None) -> None:
        """Wait for everything queued so far (tests, shutdown, benchmarks)."""
        with self._lock:
            pending = list(self._pending)
        concurrent.futures.wait(pending, timeout=timeout)

    def close(self) -> None:
        self.flush()
        self._executor.shutdown(wait=True)

    def _submit(self, job: Callable[[], None]) -> None:
        future = self._executor.submit(self._guarded, job)
        with self._lock:
            self._pending.add(future)
        future.add_done_callback(self._done)

    def _done(self, future: concurrent.futures.Future[None]) -> None:
        with self._lock:
            self._pending.discard(future)

    def record_failure(self, err: Exception) -> None:
        """Count a failed write or touch by reason and log it (once per outage; a bug with its traceback).
        Also called for the ingest's own synchronous writes (`KVStore.put`), so every failed write is counted."""
        reason = write_error_reason(err)
        with self._lock:
            self.errors[reason] += 1
        if reason in self._outages:
            self._outages[reason].failed(err)
        else:
            log.error("KV cache write failed", exc_info=err)

    def _guarded(self, job: Callable[[], None]) -> None:
        # A failed write only costs a later recompute; count it, log it (once per outage) and keep the worker alive.
        try:
            job()
        except Exception as err:
            self.record_failure(err)

    def _touch(self, keys: list[str], now: float) -> None:
        self._disk.touch(keys, now)
        self._outages["index"].succeeded()

    def _write(self, key: str, block: KVBlock, ready: CopyEvent | None) -> None:
        try:
            if not self._disk.wants(key, self._disk.stored_nbytes(block)):
                self._outages["index"].succeeded()
                return  # stored meanwhile (another worker) or over budget: skip the device-to-host copy
            host = _to_host(block.kv, self._stream, ready)
            written = self._disk.write(key, KVBlock(block.token_ids, host))
            self._written(written)
            if written and self._on_written is not None:
                self._on_written(key)
        finally:
            with self._lock:
                self._queued_keys.discard(key)

    def _write_bytes(self, key: str, data: bytes, num_tokens: int) -> None:
        try:
            self._written(self._disk.write_bytes(key, data, num_tokens))
        finally:
            with self._lock:
                self._queued_keys.discard(key)

    def _written(self, nbytes: int) -> None:
        for outage in self._outages.values():
            outage.succeeded()
        with self._lock:
            self.blocks_written += nbytes > 0
            self.bytes_written += nbytes


def write_error_reason(error: Exception) -> str:
    """The `reason` label of a failed background write (one of WRITE_ERROR_REASONS)."""
    if isinstance(error, INDEX_ERRORS):
        return "index"
    if isinstance(error, OSError):
        return "no_space" if error.errno in _NO_SPACE else "disk"
    return "other"


def _to_host(kv: torch.Tensor, stream: device.CopyStream | None, ready: CopyEvent | None) -> torch.Tensor:
    """A CPU copy of a device tensor made on the write-back stream; CPU tensors pass through unchanged."""
    if kv.device.type == "cpu":
        return kv
    host = torch.empty(kv.shape, dtype=kv.dtype)
    device.copy_to_host(kv, host, stream, blocking=True, after=ready)
    return host
