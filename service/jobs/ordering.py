"""Per-document order of jobs: a delete sent right after an ingest of the same document must win.

Jobs go through a queue that several workers read at once (Redis Streams hands messages to any consumer), so
the queue alone cannot keep two jobs for one document in order. Instead each job carries, for each of its
documents, a sequence number taken at submit (`claim`, an atomic increment per document). A worker applies a
job to a document while holding that document's lock (`hold`) and only if no later job for it was submitted
since (`superseded`); otherwise it skips the document. Whatever order the workers run in, the last effective
operation on a document is its latest submitted job, so the outcome is that of running the jobs in submit order.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

import redis

DEFAULT_ORDER_PREFIX = "kvstitch:doc"
# The lock's expiry frees a document whose holder died; a live holder renews it (every third of the TTL) however
# long it holds it. So the TTL bounds only how long a dead worker's document stays locked: the settings tie it to
# the claim idle time (KVSTITCH_DOC_LOCK_TTL_MS), so that a job claimed from a dead worker finds the lock gone.
DEFAULT_LOCK_TTL_MS = 30_000
LOCK_WAIT_S = 300.0
_RELEASE_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
_RENEW_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""


class DocumentOrder(Protocol):
    """Submit order and exclusive application of jobs, per document id."""

    def claim(self, doc_ids: Sequence[str]) -> dict[str, int]:
        """The next sequence number of each document (at submit)."""
        ...

    def latest(self, doc_id: str) -> int:
        """The last sequence number handed out for a document; 0 when none was."""
        ...

    def hold(self, doc_id: str) -> contextlib.AbstractContextManager[None]:
        """Exclusive use of a document while a job changes it."""
        ...

    def applied(self, doc_id: str, sequence: int) -> None:
        """Record that the job with this sequence number was applied to the document (under `hold`)."""
        ...

    def pending(self, doc_id: str) -> bool:
        """Whether a job submitted for the document has not been applied yet."""
        ...

    def close(self) -> None: ...


def superseded(order: DocumentOrder, doc_id: str, sequence: Mapping[str, int]) -> bool:
    """True when a job for `doc_id` was submitted after the one whose `sequence` this is (it must not apply)."""
    mine = sequence.get(doc_id)
    return mine is not None and order.latest(doc_id) > mine


@contextlib.contextmanager
def applying(order: DocumentOrder, doc_id: str, sequence: Mapping[str, int]) -> Iterator[bool]:
    """Hold the document; yields whether the job may change it (False: superseded). When the block ends without
    an error the job counts as applied."""
    with order.hold(doc_id):
        if superseded(order, doc_id, sequence):
            yield False
            return
        yield True
        if doc_id in sequence:
            order.applied(doc_id, sequence[doc_id])


class InMemoryDocumentOrder:
    """Counters and locks in this process, lost on restart (the embedded form uses `SqliteDocumentOrder`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._latest: dict[str, int] = {}
        self._applied: dict[str, int] = {}
        self._held: dict[str, threading.Lock] = {}

    def claim(self, doc_ids: Sequence[str]) -> dict[str, int]:
        with self._lock:
            for doc_id in doc_ids:
                self._latest[doc_id] = self._latest.get(doc_id, 0) + 1
            return {doc_id: self._latest[doc_id] for doc_id in doc_ids}

    def latest(self, doc_id: str) -> int:
        with self._lock:
            return self._latest.get(doc_id, 0)

    @contextlib.contextmanager
    def hold(self, doc_id: str) -> Iterator[None]:
        with self._lock:
            lock = self._held.setdefault(doc_id, threading.Lock())
        with lock:
            yield

    def applied(self, doc_id: str, sequence: int) -> None:
        with self._lock:
            self._applied[doc_id] = max(sequence, self._applied.get(doc_id, 0))

    def pending(self, doc_id: str) -> bool:
        with self._lock:
            return self._latest.get(doc_id, 0) > self._applied.get(doc_id, 0)

    def close(self) -> None:
        """Nothing to release; here for the protocol."""


class RedisDocumentOrder:
    """Counters `{prefix}:seq:{id}`, the last applied `{prefix}:applied:{id}` and locks `{prefix}:lock:{id}` (SET
    NX PX with a token, released only by its holder), shared by the gateways and every worker."""

    def __init__(self, url: str, prefix: str = DEFAULT_ORDER_PREFIX, lock_ttl_ms: int = DEFAULT_LOCK_TTL_MS) -> None:
        self.prefix = prefix
        self.lock_ttl_ms = lock_ttl_ms
        self._redis: Any = redis.Redis.from_url(url, decode_responses=True)
        self._release = self._redis.register_script(_RELEASE_SCRIPT)
        self._renew = self._redis.register_script(_RENEW_SCRIPT)

    def claim(self, doc_ids: Sequence[str]) -> dict[str, int]:
        with self._redis.pipeline(transaction=True) as pipe:
            for doc_id in doc_ids:
                pipe.incr(self._seq_key(doc_id))
            numbers = pipe.execute()
        return {doc_id: int(n) for doc_id, n in zip(doc_ids, numbers, strict=True)}

    def latest(self, doc_id: str) -> int:
        return int(self._redis.get(self._seq_key(doc_id)) or 0)

    def applied(self, doc_id: str, sequence: int) -> None:
        # Written under the document's lock, and later jobs carry larger numbers: a plain SET keeps the maximum.
        self._redis.set(self._applied_key(doc_id), sequence)

    def pending(self, doc_id: str) -> bool:
        latest, applied = self._redis.mget(self._seq_key(doc_id), self._applied_key(doc_id))
        return int(latest or 0) > int(applied or 0)

    @contextlib.contextmanager
    def hold(self, doc_id: str) -> Iterator[None]:
        key, token = self._lock_key(doc_id), uuid.uuid4().hex
        deadline = time.monotonic() + LOCK_WAIT_S
        while not self._redis.set(key, token, nx=True, px=self.lock_ttl_ms):
            if time.monotonic() > deadline:  # the job fails and is retried later; nothing was changed
                raise TimeoutError(f"document {doc_id!r} stayed locked for {LOCK_WAIT_S:.0f} s")
            time.sleep(0.05)
        released = threading.Event()
        renewer = threading.Thread(target=self._keep, args=(key, token, released), name="doc-lock", daemon=True)
        renewer.start()
        try:
            yield
        finally:
            released.set()
            renewer.join()
            self._release(keys=[key], args=[token])

    def _keep(self, key: str, token: str, released: threading.Event) -> None:
        """Renew the held lock until it is released; a renewal that fails (Redis away) is tried again next time,
        and the lock may expire meanwhile, as it would for a dead holder."""
        while not released.wait(self.lock_ttl_ms / 3000):
            with contextlib.suppress(redis.RedisError):
                self._renew(keys=[key], args=[token, self.lock_ttl_ms])

    def close(self) -> None:
        self._redis.close()

    def _seq_key(self, doc_id: str) -> str:
        return f"{self.prefix}:seq:{doc_id}"

    def _applied_key(self, doc_id: str) -> str:
        return f"{self.prefix}:applied:{doc_id}"

    def _lock_key(self, doc_id: str) -> str:
        return f"{self.prefix}:lock:{doc_id}"
