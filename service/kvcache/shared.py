"""The shared tier: block files on an object store every node reads, behind each node's disk tier.

Read-through: a block the disk tier does not hold (not indexed, its file gone or damaged) is looked up here before
it is recomputed. The object is the block file itself, byte for byte, at `PREFIX/<block_relpath(key)>`; what comes
back is checked exactly as a local file is (size bound first, then preamble, header hash, fields, key, model, shape,
form, token ids, payload checksum), and a copy is written to the local disk tier so the next read is local.
Write-once: a block is uploaded after its local atomic write (a computed miss, an ingested chunk), unless the object
exists already; blocks read from here are never uploaded again.

Every failure is a miss: no object, a damaged or oversized object (logged, counted as corrupt, and deleted so a
recomputed copy replaces it), or an object store that cannot be reached. After an error the tier is skipped for
`retry_after_s`, so an outage costs one timeout, not one per block. Uploads and deletes run on the tier's own
threads, so neither a request nor the disk writer waits for the network.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from service.engine.kv_layout import KVBlock, ModelSpec, block_shape
from service.kvcache import quant
from service.kvcache.fileformat import (
    CorruptBlockError,
    QuantBlock,
    block_relpath,
    max_file_bytes,
    read_block_bytes,
    verify_block_bytes,
)
from service.kvcache.s3 import ObjectStore, ObjectStoreError, ObjectTooLargeError
from service.outage import OutageLog

log = logging.getLogger(__name__)

# Why a lookup missed: no object, an object that failed a check, an error of the store, or the store skipped
# after a recent error.
MISS_REASONS = ("absent", "corrupt", "error", "down")
# What became of an upload: stored, already there (written once), failed, or dropped (queue full, store down).
UPLOAD_RESULTS = ("stored", "exists", "failed", "dropped")
# Upper bounds (seconds) of the GET and PUT latency histograms; +Inf is implied. A few-MB block on a LAN S3
# takes milliseconds to tens of them; a 30-MB 7B block over a slow link, seconds.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
DEFAULT_RETRY_AFTER_S = 10.0
DEFAULT_UPLOAD_THREADS = 4
# Uploads waiting for a thread at most; one more is dropped (the block stays local and is recomputed elsewhere).
DEFAULT_MAX_PENDING_UPLOADS = 256


@dataclass
class Latency:
    """Calls of one kind: a cumulative count per bucket bound, their total seconds and count."""

    bucket_counts: list[int] = field(default_factory=lambda: [0] * len(LATENCY_BUCKETS))
    seconds: float = 0.0
    count: int = 0

    def observe(self, seconds: float) -> None:
        self.seconds += seconds
        self.count += 1
        for i, bound in enumerate(LATENCY_BUCKETS):
            if seconds <= bound:
                self.bucket_counts[i] += 1

    def copy(self) -> Latency:
        return Latency(list(self.bucket_counts), self.seconds, self.count)


@dataclass(frozen=True)
class SharedStats:
    """Counters since the tier opened (for metrics)."""

    hits: int
    misses: dict[str, int]  # by reason (MISS_REASONS)
    bytes_read: int
    bytes_written: int
    uploads: dict[str, int]  # by result (UPLOAD_RESULTS)
    pending_uploads: int
    latency: dict[str, Latency]  # "get", "put"


@dataclass(frozen=True)
class SharedRead:
    """A block found in the shared tier: checked, read into the caller's buffer, with the object's bytes (what the
    local disk tier stores as its copy)."""

    block: KVBlock | QuantBlock
    data: bytes


class SharedTier:
    """Block files of one model, template, dtype and stored form on an `ObjectStore`, under `prefix`."""

    def __init__(
        self,
        objects: ObjectStore,
        prefix: str,
        fingerprint: str,
        spec: ModelSpec,
        fmt: quant.DiskFormat = "native",
        retry_after_s: float = DEFAULT_RETRY_AFTER_S,
        upload_threads: int = DEFAULT_UPLOAD_THREADS,
        max_pending_uploads: int = DEFAULT_MAX_PENDING_UPLOADS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.objects = objects
        self.prefix = prefix.strip("/")
        self.fingerprint = fingerprint
        self.spec = spec
        self.fmt = fmt
        self.retry_after_s = retry_after_s
        self.max_pending_uploads = max_pending_uploads
        self._clock = clock
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._outage = OutageLog(log, "shared KV tier (object store)")
        self._uploader = concurrent.futures.ThreadPoolExecutor(max(1, upload_threads), thread_name_prefix="kv-s3")
        self._pending: dict[str, concurrent.futures.Future[None]] = {}  # the last job queued per key
        self._hits = 0
        self._misses: Counter[str] = Counter()
        self._uploads: Counter[str] = Counter()
        self._bytes_read = 0
        self._bytes_written = 0
        self._latency = {"get": Latency(), "put": Latency()}

    def name_of(self, key: str) -> str:
        """The object's name: the block file's path under the cache dir, below the prefix."""
        relpath = block_relpath(key)
        return f"{self.prefix}/{relpath}" if self.prefix else relpath

    # ---- reading -----------------------------------------------------------------------------------------

    def read(self, key: str, token_ids: Sequence[int], into: torch.Tensor | None = None) -> SharedRead | None:
        """The checked block, read into `into` when given; None on any miss (counted by reason, logged)."""
        if self._is_down():
            self._missed("down")
            return None
        name = self.objects.url(self.name_of(key))
        data = self._get(key, len(token_ids))
        if data is None:
            return None
        try:
            block = read_block_bytes(
                data, name, key, self.fingerprint, self.spec, self.fmt, into, expected_token_ids=token_ids
            )
        except CorruptBlockError as err:
            log.warning("corrupt KV object in the shared tier, recomputing the block and replacing it: %s", err)
            self._missed("corrupt")
            self.delete_later(key)
            return None
        with self._lock:
            self._hits += 1
            self._bytes_read += len(data)
        return SharedRead(block, data)

    def _get(self, key: str, num_tokens: int) -> bytes | None:
        """The object's bytes within the size bound; None (counted) when absent, oversized or unreachable."""
        name = self.name_of(key)
        start = time.perf_counter()
        try:
            data = self.objects.get(name, self.max_object_bytes(num_tokens))
        except ObjectTooLargeError as err:
            log.warning("corrupt KV object in the shared tier (too large), recomputing the block: %s", err)
            self._missed("corrupt")
            self.delete_later(key)
            return None
        except ObjectStoreError as err:
            self._failed(err)
            self._missed("error")
            return None
        finally:
            self._observe("get", time.perf_counter() - start)
        self._outage.succeeded()
        if data is None:
            self._missed("absent")
        return data

    def max_object_bytes(self, num_tokens: int) -> int:
        """The largest object a block of this many tokens can be: anything larger is refused unread."""
        shape = block_shape(self.spec, num_tokens)
        element = torch.empty((), dtype=self.spec.dtype).element_size()
        return max_file_bytes(quant.stored_nbytes(self.fmt, shape, element), num_tokens)

    # ---- writing -----------------------------------------------------------------------------------------

    def upload_later(self, key: str, path: Path) -> bool:
        """Queue the upload of a block file just written locally; False when it was dropped."""
        with self._lock:
            full = sum(not f.done() for f in self._pending.values()) >= self.max_pending_uploads
        if full or self._is_down():
            self._count_upload("dropped")
            return False
        self._queue(key, lambda: self._upload(key, Path(path)))
        return True

    def delete_later(self, key: str) -> None:
        """Queue the removal of a block's object (after any upload of it queued before)."""
        self._queue(key, lambda: self._delete(key))

    def _queue(self, key: str, job: Callable[[], None]) -> None:
        with self._lock:
            before = self._pending.get(key)
            # Jobs of one key run in the order queued: a later one waits for the earlier (queued ahead of it,
            # so already running or done: no thread waits on a job behind it).
            future = self._uploader.submit(self._guarded, job, before)
            self._pending[key] = future
        future.add_done_callback(lambda done: self._forget(key, done))

    def _forget(self, key: str, done: concurrent.futures.Future[None]) -> None:
        with self._lock:
            if self._pending.get(key) is done:
                del self._pending[key]

    def _guarded(self, job: Callable[[], None], before: concurrent.futures.Future[None] | None) -> None:
        if before is not None:
            concurrent.futures.wait([before])
        try:
            job()
        except Exception:  # a bug, not an outage (those are counted inside the job): keep the threads alive
            log.exception("shared KV tier: background job failed")

    def _upload(self, key: str, path: Path) -> None:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return  # evicted or removed locally before its turn: nothing to share
        name = self.name_of(key)
        try:
            verify_block_bytes(data, str(path), key)  # never share a file damaged since it was written
        except CorruptBlockError as err:
            log.warning("not uploading a KV block that fails its checks: %s", err)
            self._count_upload("failed")
            return
        start = time.perf_counter()
        try:
            if self.objects.exists(name):
                self._count_upload("exists")
                return
            self.objects.put(name, data)
        except ObjectStoreError as err:
            self._failed(err)
            self._count_upload("failed")
            return
        finally:
            self._observe("put", time.perf_counter() - start)
        self._outage.succeeded()
        with self._lock:
            self._bytes_written += len(data)
        self._count_upload("stored")

    def _delete(self, key: str) -> None:
        try:
            self.objects.delete(self.name_of(key))
        except ObjectStoreError as err:
            self._failed(err)

    # ---- state -------------------------------------------------------------------------------------------

    def _is_down(self) -> bool:
        with self._lock:
            return self._clock() < self._down_until

    def _failed(self, err: ObjectStoreError) -> None:
        self._outage.failed(err)
        with self._lock:
            self._down_until = self._clock() + self.retry_after_s

    def _missed(self, reason: str) -> None:
        with self._lock:
            self._misses[reason] += 1

    def _count_upload(self, result: str) -> None:
        with self._lock:
            self._uploads[result] += 1

    def _observe(self, op: str, seconds: float) -> None:
        with self._lock:
            self._latency[op].observe(seconds)

    def stats(self) -> SharedStats:
        with self._lock:
            return SharedStats(
                hits=self._hits,
                misses={reason: self._misses[reason] for reason in MISS_REASONS},
                bytes_read=self._bytes_read,
                bytes_written=self._bytes_written,
                uploads={result: self._uploads[result] for result in UPLOAD_RESULTS},
                pending_uploads=sum(not f.done() for f in self._pending.values()),
                latency={op: latency.copy() for op, latency in self._latency.items()},
            )

    def flush(self, timeout: float | None = None) -> None:
        """Wait for the uploads and deletes queued so far."""
        with self._lock:
            pending = list(self._pending.values())
        concurrent.futures.wait(pending, timeout=timeout)

    def close(self) -> None:
        """Finish the queued uploads, stop the threads and close the store's connections."""
        self.flush()
        self._uploader.shutdown(wait=True)
        self.objects.close()
