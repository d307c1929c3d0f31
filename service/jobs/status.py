"""Job statuses (`queued`, `running`, `done`, `failed`, `cancelled`, with counts, an error and timestamps) behind one
protocol.

A job is an ingest or a delete (`kind`); a delete reports the chunks it removed and the KV blocks it released.
`cancel` moves a queued or running job to `cancelled` in one atomic step; `cancelled` is final: later writes (the
worker's last counts) keep it, so a worker that finishes its step after the cancel cannot turn it back to `done`.

The gateway creates a status when it enqueues a job, the worker updates and increments it, the gateway reads it.
`RedisJobStatusStore` keeps hashes with a TTL for deployments with separate workers; the embedded form keeps them
in SQLite (`service.jobs.sqlite`); `InMemoryJobStatusStore` is a dict (tests, throwaway runs).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, Protocol

import redis

from service.jobs.job_status import JobStatus

JOB_STATES = ("queued", "running", "done", "failed", "cancelled")
ACTIVE_STATES = ("queued", "running")  # what `cancel` may stop
FINISHED_STATES = ("done", "failed", "cancelled")
JOB_KINDS = ("ingest", "delete")
COUNT_FIELDS = (
    "documents",
    "documents_done",
    "chunks",
    "chunks_done",
    "chunks_precomputed",
    "chunks_reused",
    "chunks_deleted",
    "blocks_released",
)
DEFAULT_JOB_PREFIX = "kvstitch:job"
DEFAULT_JOB_TTL_S = 7 * 24 * 3600


class JobStatusStore(Protocol):
    """Job statuses, written by the gateway (create) and the worker (update, increment), read by the gateway."""

    def create(self, job_id: str, documents: int, kind: str = "ingest") -> JobStatus: ...

    def update(self, job_id: str, **fields: Any) -> JobStatus: ...

    def increment(self, job_id: str, **counts: int) -> JobStatus: ...

    def get(self, job_id: str) -> JobStatus | None: ...

    def cancel(self, job_id: str) -> bool | None:
        """Mark a queued or running job cancelled: True when it was, False when it had finished, None unknown."""
        ...

    def close(self) -> None: ...


def status_changes(now: float, fields: Mapping[str, Any]) -> dict[str, Any]:
    """Validated field changes plus the timestamps they imply (a start, a finish, always the update time)."""
    unknown = set(fields) - {"status", "error", *COUNT_FIELDS}
    if unknown:
        raise ValueError(f"unknown job status fields: {', '.join(sorted(unknown))}")
    changes: dict[str, Any] = {"updated_at": now}
    for name, value in fields.items():
        if name == "status" and value not in JOB_STATES:
            raise ValueError(f"job status must be one of {', '.join(JOB_STATES)}, got {value!r}")
        if name in COUNT_FIELDS and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        if name == "error" and value is not None and not isinstance(value, str):
            raise ValueError(f"error must be text or None, got {type(value).__name__}")
        changes[name] = value
    if fields.get("status") == "running":
        changes["started_at"] = now
    if fields.get("status") in FINISHED_STATES:
        changes["finished_at"] = now
    return changes


def keeping_cancelled(job: JobStatus, changes: Mapping[str, Any]) -> dict[str, Any]:
    """The changes a write may make to `job`: a cancelled job keeps its status and times (cancelled is final)."""
    if job.status != "cancelled":
        return dict(changes)
    return {k: v for k, v in changes.items() if k not in ("status", "started_at", "finished_at")}


def _check_kind(kind: str) -> None:
    if kind not in JOB_KINDS:
        raise ValueError(f"job kind must be one of {', '.join(JOB_KINDS)}, got {kind!r}")


def _check_counts(counts: Mapping[str, int]) -> None:
    unknown = set(counts) - set(COUNT_FIELDS)
    if unknown:
        raise ValueError(f"only {', '.join(COUNT_FIELDS)} can be incremented, not {', '.join(sorted(unknown))}")
    if any(not isinstance(v, int) or isinstance(v, bool) for v in counts.values()):
        raise ValueError(f"increments must be ints, got {dict(counts)!r}")


class InMemoryJobStatusStore:
    """Job statuses in a dict, lost on restart; safe across threads."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._jobs: dict[str, JobStatus] = {}

    def create(self, job_id: str, documents: int, kind: str = "ingest") -> JobStatus:
        now = self._clock()
        status_changes(now, {"documents": documents})  # validates the count
        _check_kind(kind)
        with self._lock:
            if job_id in self._jobs:
                raise ValueError(f"job {job_id!r} already exists")
            self._jobs[job_id] = JobStatus(
                job_id, "queued", created_at=now, updated_at=now, documents=documents, kind=kind
            )
            return self._jobs[job_id]

    def update(self, job_id: str, **fields: Any) -> JobStatus:
        changes = status_changes(self._clock(), fields)
        with self._lock:
            job = self._known(job_id)
            self._jobs[job_id] = replace(job, **keeping_cancelled(job, changes))
            return self._jobs[job_id]

    def cancel(self, job_id: str) -> bool | None:
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                return None
            if job.status not in ACTIVE_STATES:
                return False
            self._jobs[job_id] = replace(job, **status_changes(self._clock(), {"status": "cancelled"}))
            return True

    def increment(self, job_id: str, **counts: int) -> JobStatus:
        _check_counts(counts)
        now = self._clock()
        with self._lock:
            job = self._known(job_id)
            added = {name: getattr(job, name) + n for name, n in counts.items()}
            self._jobs[job_id] = replace(job, updated_at=now, **added)
            return self._jobs[job_id]

    def get(self, job_id: str) -> JobStatus | None:
        with self._lock:
            return self._jobs.get(job_id)

    def close(self) -> None:
        """Nothing to release; here for the protocol."""

    def _known(self, job_id: str) -> JobStatus:
        job = self._jobs.get(job_id)
        if job is None:
            raise KeyError(f"unknown job {job_id!r}")
        return job


# Each write checks that the job exists and refreshes the TTL in the same atomic step, so a late update from a
# slow worker never resurrects an expired job as a half-empty hash.
_CREATE_SCRIPT = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('EXPIRE', KEYS[1], ARGV[1])
return 1
"""
_UPDATE_SCRIPT = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local cancelled = redis.call('HGET', KEYS[1], 'status') == 'cancelled'
for i = 2, #ARGV, 2 do
  local name = ARGV[i]
  if not (cancelled and (name == 'status' or name == 'started_at' or name == 'finished_at')) then
    redis.call('HSET', KEYS[1], name, ARGV[i + 1])
  end
end
redis.call('EXPIRE', KEYS[1], ARGV[1])
return 1
"""
# Returns -1 for an unknown job, 0 for a finished one, 1 when it was queued or running and is cancelled now.
_CANCEL_SCRIPT = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return -1 end
if status ~= 'queued' and status ~= 'running' then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('EXPIRE', KEYS[1], ARGV[1])
return 1
"""
_INCREMENT_SCRIPT = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'updated_at', ARGV[2])
for i = 3, #ARGV, 2 do redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('EXPIRE', KEYS[1], ARGV[1])
return 1
"""


class RedisJobStatusStore:
    """Job statuses as Redis hashes `{prefix}:{job_id}`, expiring `ttl_s` after their last change."""

    def __init__(
        self,
        url: str,
        prefix: str = DEFAULT_JOB_PREFIX,
        ttl_s: int = DEFAULT_JOB_TTL_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.prefix, self.ttl_s = prefix, ttl_s
        self._clock = clock
        self._redis: Any = redis.Redis.from_url(url, decode_responses=True)
        self._create = self._redis.register_script(_CREATE_SCRIPT)
        self._update = self._redis.register_script(_UPDATE_SCRIPT)
        self._cancel = self._redis.register_script(_CANCEL_SCRIPT)
        self._increment = self._redis.register_script(_INCREMENT_SCRIPT)

    def create(self, job_id: str, documents: int, kind: str = "ingest") -> JobStatus:
        now = self._clock()
        _check_kind(kind)
        fields = status_changes(now, {"status": "queued", "documents": documents})
        fields.update({"created_at": now, "kind": kind, **dict.fromkeys(COUNT_FIELDS[1:], 0)})
        if not self._create(keys=[self._key(job_id)], args=[self.ttl_s, *_flatten(fields)]):
            raise ValueError(f"job {job_id!r} already exists")
        return self._get_known(job_id)

    def update(self, job_id: str, **fields: Any) -> JobStatus:
        changes = status_changes(self._clock(), fields)
        if not self._update(keys=[self._key(job_id)], args=[self.ttl_s, *_flatten(changes)]):
            raise KeyError(f"unknown job {job_id!r}")
        return self._get_known(job_id)

    def increment(self, job_id: str, **counts: int) -> JobStatus:
        _check_counts(counts)
        args: list[str | int] = [self.ttl_s, repr(self._clock())]
        for name, amount in counts.items():
            args += [name, amount]
        if not self._increment(keys=[self._key(job_id)], args=args):
            raise KeyError(f"unknown job {job_id!r}")
        return self._get_known(job_id)

    def get(self, job_id: str) -> JobStatus | None:
        return _job_from_hash(job_id, self._redis.hgetall(self._key(job_id)))

    def cancel(self, job_id: str) -> bool | None:
        changes = status_changes(self._clock(), {"status": "cancelled"})
        outcome = int(self._cancel(keys=[self._key(job_id)], args=[self.ttl_s, *_flatten(changes)]))
        return None if outcome < 0 else bool(outcome)

    def close(self) -> None:
        self._redis.close()

    def _key(self, job_id: str) -> str:
        return f"{self.prefix}:{job_id}"

    def _get_known(self, job_id: str) -> JobStatus:
        job = self.get(job_id)
        if job is None:  # expired between the write and this read
            raise KeyError(f"unknown job {job_id!r}")
        return job


def _flatten(fields: Mapping[str, Any]) -> list[str]:
    """Hash fields as strings; None (no error) is stored as an empty string."""
    pairs = ((k, "" if v is None else repr(v) if isinstance(v, float) else str(v)) for k, v in fields.items())
    return list(itertools.chain.from_iterable(pairs))


def _job_from_hash(job_id: str, fields: dict[str, str]) -> JobStatus | None:
    if not fields:
        return None

    def when(name: str) -> float | None:
        return float(fields[name]) if fields.get(name) else None

    return JobStatus(
        job_id=job_id,
        status=fields.get("status", "queued"),
        kind=fields.get("kind") or "ingest",
        created_at=when("created_at") or 0.0,
        updated_at=when("updated_at") or 0.0,
        error=fields.get("error") or None,
        started_at=when("started_at"),
        finished_at=when("finished_at"),
        **{name: _int(fields.get(name)) for name in COUNT_FIELDS},
    )


def _int(value: str | None) -> int:
    try:
        return max(0, int(value or 0))
    except ValueError:
        return 0
