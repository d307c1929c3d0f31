"""The job contract made durable for the embedded form: queue, statuses and document order in one SQLite file.

`kvstitch serve` without Redis runs its producer (the HTTP facade) and its consumer (the in-process worker) in
one process, and only one process may use a data dir (embedded Qdrant locks its folder). So the three stores
share `DATA_DIR/jobs.sqlite3` (WAL, fsync on every commit: an accepted job survives a SIGKILL or a power cut),
and at open every message that was delivered but never acked belongs to a process that is gone: it is made
claimable at once, so the worker's first `claim_stale` resumes it (or dead-letters it after `max_attempts`).

The semantics are those of `InProcessQueue` and the Redis stream: at-least-once delivery, attempts counted per
delivery, retries at the end of the queue, dead letters with the error.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from service.jobs.job_status import JobStatus
from service.jobs.queue import (
    DEFAULT_MAX_ATTEMPTS,
    DeadLetter,
    DeadLetterHook,
    Delivery,
    _abandoned,
    _check_count,
    _check_max_attempts,
    _notify,
    decode_payload,
    encode_payload,
    reencode_payload,
)
from service.jobs.status import (
    ACTIVE_STATES,
    COUNT_FIELDS,
    DEFAULT_JOB_TTL_S,
    _check_counts,
    _check_kind,
    status_changes,
)

JOBS_FILE = "jobs.sqlite3"
# A blocked consumer is woken by an enqueue of this process at once; the poll catches writers of other handles.
POLL_S = 0.05
BUSY_TIMEOUT_S = 30.0

_QUEUE_SCHEMA = """
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    data TEXT NOT NULL,
    prior_attempts INTEGER NOT NULL DEFAULT 0,
    last_error TEXT,
    deliveries INTEGER NOT NULL DEFAULT 0,
    consumer TEXT,
    delivered_at REAL NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS dead_letters (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    original_id TEXT NOT NULL,
    payload TEXT NOT NULL,
    error TEXT NOT NULL,
    attempts INTEGER NOT NULL,
    failed_at REAL NOT NULL
);
"""
_STATUS_COLUMNS = tuple(f.name for f in fields(JobStatus))
_STATUS_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS job_status (
    job_id TEXT PRIMARY KEY,
    status TEXT NOT NULL, kind TEXT NOT NULL, error TEXT,
    created_at REAL NOT NULL, updated_at REAL NOT NULL, started_at REAL, finished_at REAL,
    {", ".join(f"{name} INTEGER NOT NULL DEFAULT 0" for name in COUNT_FIELDS)}
);
CREATE INDEX IF NOT EXISTS job_status_finished ON job_status (finished_at);
"""
_ORDER_SCHEMA = """
CREATE TABLE IF NOT EXISTS document_order (
    doc_id TEXT PRIMARY KEY,
    latest INTEGER NOT NULL DEFAULT 0,
    applied INTEGER NOT NULL DEFAULT 0
);
"""


def jobs_path(data_dir: Path) -> Path:
    return data_dir / JOBS_FILE


class _Database:
    """One connection to the jobs file, shared by the threads of this process under a lock."""

    def __init__(self, path: Path, schema: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._connection = sqlite3.connect(
            str(path), timeout=BUSY_TIMEOUT_S, check_same_thread=False, isolation_level=None
        )
        self._connection.row_factory = sqlite3.Row
        self.lock = threading.RLock()
        with self.lock:
            self._connection.execute("PRAGMA journal_mode=WAL")
            # FULL: a job answered 202 must survive a power cut too, not only a killed process.
            self._connection.execute("PRAGMA synchronous=FULL")
            self._connection.executescript(schema)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """Exclusive use of the connection in one write transaction (IMMEDIATE: no lock upgrade deadlocks)."""
        with self.lock:
            self._connection.execute("BEGIN IMMEDIATE")
            try:
                yield self._connection
            except BaseException:
                self._connection.execute("ROLLBACK")
                raise
            self._connection.execute("COMMIT")

    def read(self, sql: str, args: Sequence[Any] = ()) -> list[sqlite3.Row]:
        with self.lock:
            return self._connection.execute(sql, args).fetchall()

    def close(self) -> None:
        with self.lock:
            self._connection.close()


# ---- the queue -----------------------------------------------------------------------------------------------


class SqliteJobQueue:
    """`JobQueue` in the jobs file: what was enqueued and not acked survives a restart and is handed out again."""

    def __init__(
        self,
        path: Path,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.max_attempts = _check_max_attempts(max_attempts)
        self.on_dead_letter: DeadLetterHook | None = None
        self._clock = clock
        self._db = _Database(path, _QUEUE_SCHEMA)
        self._changed = threading.Condition(self._db.lock)
        self._closed = False
        self.resumed = self._make_stale()

    def enqueue(self, payload: Mapping[str, Any]) -> str:
        data = encode_payload(payload)
        with self._db.transaction() as db:
            message_id = _insert(db, data, prior_attempts=0, last_error=None)
            self._changed.notify_all()
        return message_id

    def consume(self, consumer_name: str, block_ms: int = 1000, count: int = 1) -> list[Delivery]:
        _check_count(count)
        deadline = time.monotonic() + max(0, block_ms) / 1000
        with self._changed:
            while True:
                taken = self._take_ready(consumer_name, count)
                left = deadline - time.monotonic()
                if taken or self._closed or left <= 0:
                    return taken
                self._changed.wait(min(left, POLL_S))

    def ack(self, delivery: Delivery) -> None:
        with self._db.transaction() as db:
            db.execute("DELETE FROM messages WHERE id = ?", (_row_id(delivery.message_id),))

    def fail(self, delivery: Delivery, error: str) -> bool:
        data = reencode_payload(delivery.payload)
        with self._db.transaction() as db:
            if not _delete(db, delivery.message_id):
                return False  # acked meanwhile by a consumer that had claimed it: nothing to retry
            if delivery.attempt >= self.max_attempts:
                self._bury(db, delivery.message_id, data, error, delivery.attempt)
                return True
            _insert(db, data, prior_attempts=delivery.attempt, last_error=error)
            self._changed.notify_all()
            return False

    def reject(self, delivery: Delivery, error: str) -> bool:
        with self._db.transaction() as db:
            if not _delete(db, delivery.message_id):
                return False
            self._bury(db, delivery.message_id, reencode_payload(delivery.payload), error, delivery.attempt)
            return True

    def release(self, delivery: Delivery, payload: Mapping[str, Any] | None = None) -> None:
        """Hand the message back unfinished (its worker is stopping, or it gives other jobs a turn): queued again
        at the end, as `payload` when given, this delivery not counted."""
        data = reencode_payload(delivery.payload if payload is None else payload)
        with self._db.transaction() as db:
            if _delete(db, delivery.message_id):
                _insert(db, data, delivery.attempt - 1, delivery.last_error)
                self._changed.notify_all()

    def keep_alive(self, delivery: Delivery) -> None:
        with self._db.transaction() as db:
            db.execute(
                "UPDATE messages SET delivered_at = ? WHERE id = ? AND consumer = ?",
                (self._clock(), _row_id(delivery.message_id), delivery.consumer),
            )

    def claim_stale(self, consumer_name: str, min_idle_ms: int, count: int = 16) -> list[Delivery]:
        _check_count(count)
        idle_since = self._clock() - max(0, min_idle_ms) / 1000
        buried: list[tuple[str, str]] = []
        deliveries: list[Delivery] = []
        with self._db.transaction() as db:
            rows = db.execute(
                "SELECT * FROM messages WHERE consumer IS NOT NULL AND delivered_at <= ? ORDER BY id LIMIT ?",
                (idle_since, count),
            ).fetchall()
            for row in rows:
                delivered = row["prior_attempts"] + row["deliveries"]
                if delivered >= self.max_attempts:  # this would be one attempt too many
                    error = _abandoned(delivered + 1, row["last_error"])
                    db.execute("DELETE FROM messages WHERE id = ?", (row["id"],))
                    self._bury(db, _message_id(row["id"]), row["data"], error, delivered)
                    buried.append((row["data"], error))
                else:
                    deliveries.append(self._deliver(db, row, consumer_name))
        for data, error in buried:  # outside the transaction: the hook writes job statuses
            _notify(self.on_dead_letter, data, error)
        return deliveries

    def pending_count(self) -> int:
        return int(self._db.read("SELECT COUNT(*) FROM messages")[0][0])

    def waiting_count(self) -> int:
        return int(self._db.read("SELECT COUNT(*) FROM messages WHERE consumer IS NULL")[0][0])

    def pending_payloads(self) -> list[dict[str, Any]]:
        """Every job not yet acked or dead-lettered, oldest first (what a start-up sweep must not undo)."""
        rows = self._db.read("SELECT data FROM messages ORDER BY id")
        payloads = []
        for row in rows:
            with contextlib.suppress(ValueError):  # a malformed one is dead-lettered when delivered
                payloads.append(decode_payload(row["data"]))
        return payloads

    def dead_letters(self, limit: int = 100) -> list[DeadLetter]:
        rows = self._db.read("SELECT * FROM dead_letters ORDER BY id LIMIT ?", (limit,))
        return [
            DeadLetter(
                f"dead-{row['id']}", row["original_id"], row["payload"], row["error"], row["attempts"], row["failed_at"]
            )
            for row in rows
        ]

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()  # blocked consumers return at once
        self._db.close()

    # ---- internals -----------------------------------------------------------------------------------------

    def _make_stale(self) -> int:
        """Messages delivered to a consumer of a process that is gone become claimable now; how many."""
        with self._db.transaction() as db:
            return db.execute("UPDATE messages SET delivered_at = 0 WHERE consumer IS NOT NULL").rowcount

    def _take_ready(self, consumer: str, count: int) -> list[Delivery]:
        if self._closed:
            return []
        with self._db.transaction() as db:
            rows = db.execute("SELECT * FROM messages WHERE consumer IS NULL ORDER BY id LIMIT ?", (count,)).fetchall()
            return [self._deliver(db, row, consumer) for row in rows]

    def _deliver(self, db: sqlite3.Connection, row: sqlite3.Row, consumer: str) -> Delivery:
        deliveries = row["deliveries"] + 1
        db.execute(
            "UPDATE messages SET deliveries = ?, consumer = ?, delivered_at = ? WHERE id = ?",
            (deliveries, consumer, self._clock(), row["id"]),
        )
        attempt = row["prior_attempts"] + deliveries
        return Delivery(_message_id(row["id"]), decode_payload(row["data"]), attempt, consumer, row["last_error"])

    def _bury(self, db: sqlite3.Connection, message_id: str, data: str, error: str, attempts: int) -> None:
        db.execute(
            "INSERT INTO dead_letters (original_id, payload, error, attempts, failed_at) VALUES (?, ?, ?, ?, ?)",
            (message_id, data, error, attempts, time.time()),
        )


def _message_id(row_id: int) -> str:
    return f"{row_id}-0"  # shaped like a stream id, as the other queues hand out


def _row_id(message_id: str) -> int:
    try:
        return int(message_id.split("-", 1)[0])
    except ValueError:
        return -1  # never a row: a foreign id matches nothing


def _insert(db: sqlite3.Connection, data: str, prior_attempts: int, last_error: str | None) -> str:
    cursor = db.execute(
        "INSERT INTO messages (data, prior_attempts, last_error) VALUES (?, ?, ?)", (data, prior_attempts, last_error)
    )
    assert cursor.lastrowid is not None
    return _message_id(cursor.lastrowid)


def _delete(db: sqlite3.Connection, message_id: str) -> bool:
    return db.execute("DELETE FROM messages WHERE id = ?", (_row_id(message_id),)).rowcount > 0


# ---- job statuses --------------------------------------------------------------------------------------------


class SqliteJobStatusStore:
    """`JobStatusStore` in the jobs file. Finished jobs are dropped `ttl_s` after they finished (as Redis
    expires them); a job not finished is kept however old, so an accepted job never reads as unknown."""

    def __init__(self, path: Path, ttl_s: int = DEFAULT_JOB_TTL_S, clock: Callable[[], float] = time.time) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._db = _Database(path, _STATUS_SCHEMA)
        self._add_missing_counts()

    def create(self, job_id: str, documents: int, kind: str = "ingest") -> JobStatus:
        now = self._clock()
        status_changes(now, {"documents": documents})  # validates the count
        _check_kind(kind)
        job = JobStatus(job_id, "queued", created_at=now, updated_at=now, documents=documents, kind=kind)
        with self._db.transaction() as db:
            db.execute("DELETE FROM job_status WHERE finished_at < ?", (now - self.ttl_s,))
            if db.execute("SELECT 1 FROM job_status WHERE job_id = ?", (job_id,)).fetchone():
                raise ValueError(f"job {job_id!r} already exists")
            marks = ", ".join("?" for _ in _STATUS_COLUMNS)
            db.execute(
                f"INSERT INTO job_status ({', '.join(_STATUS_COLUMNS)}) VALUES ({marks})",
                [getattr(job, name) for name in _STATUS_COLUMNS],
            )
        return job

    def update(self, job_id: str, **fields: Any) -> JobStatus:
        changes = status_changes(self._clock(), fields)
        # A cancelled job keeps its status and times (cancelled is final); its counts still change.
        final = ("status", "started_at", "finished_at")
        assignments = [
            f"{name} = CASE WHEN status = 'cancelled' THEN {name} ELSE ? END" if name in final else f"{name} = ?"
            for name in changes
        ]
        return self._write(job_id, ", ".join(assignments), list(changes.values()))

    def cancel(self, job_id: str) -> bool | None:
        changes = status_changes(self._clock(), {"status": "cancelled"})
        marks = ", ".join("?" for _ in ACTIVE_STATES)
        with self._db.transaction() as db:
            cursor = db.execute(
                f"UPDATE job_status SET {', '.join(f'{name} = ?' for name in changes)} "
                f"WHERE job_id = ? AND status IN ({marks})",
                [*changes.values(), job_id, *ACTIVE_STATES],
            )
            if cursor.rowcount:
                return True
            return (
                None if db.execute("SELECT 1 FROM job_status WHERE job_id = ?", (job_id,)).fetchone() is None else False
            )

    def increment(self, job_id: str, **counts: int) -> JobStatus:
        _check_counts(counts)
        assignments = ["updated_at = ?", *(f"{name} = {name} + ?" for name in counts)]
        return self._write(job_id, ", ".join(assignments), [self._clock(), *counts.values()])

    def get(self, job_id: str) -> JobStatus | None:
        rows = self._db.read("SELECT * FROM job_status WHERE job_id = ?", (job_id,))
        return _job_from_row(rows[0]) if rows else None

    def close(self) -> None:
        self._db.close()

    def _add_missing_counts(self) -> None:
        """A jobs file written by an older version lacks newer count columns (`chunks_done`): add them as 0."""
        present = {row["name"] for row in self._db.read("PRAGMA table_info(job_status)")}
        with self._db.transaction() as db:
            for name in COUNT_FIELDS:
                if name not in present:  # names come from COUNT_FIELDS, never from input
                    db.execute(f"ALTER TABLE job_status ADD COLUMN {name} INTEGER NOT NULL DEFAULT 0")

    def _write(self, job_id: str, assignments: str, values: list[Any]) -> JobStatus:
        # Column names come from `status_changes` / `_check_counts`, which refuse any name not a status field.
        with self._db.transaction() as db:
            db.execute(f"UPDATE job_status SET {assignments} WHERE job_id = ?", [*values, job_id])
            row = db.execute("SELECT * FROM job_status WHERE job_id = ?", (job_id,)).fetchone()
        if row is None:
            raise KeyError(f"unknown job {job_id!r}")
        return _job_from_row(row)


def _job_from_row(row: sqlite3.Row) -> JobStatus:
    return JobStatus(**{name: row[name] for name in _STATUS_COLUMNS})


# ---- document order ------------------------------------------------------------------------------------------


class SqliteDocumentOrder:
    """`DocumentOrder` in the jobs file: sequence numbers survive a restart, so a delete queued before it still
    applies after the ingest queued before it. The holds are locks of this process (the only one on the file)."""

    def __init__(self, path: Path) -> None:
        self._db = _Database(path, _ORDER_SCHEMA)
        self._held: dict[str, threading.Lock] = {}
        self._held_lock = threading.Lock()

    def claim(self, doc_ids: Sequence[str]) -> dict[str, int]:
        with self._db.transaction() as db:
            for doc_id in doc_ids:
                db.execute(
                    "INSERT INTO document_order (doc_id, latest) VALUES (?, 1) "
                    "ON CONFLICT (doc_id) DO UPDATE SET latest = latest + 1",
                    (doc_id,),
                )
            return {doc_id: _latest(db, doc_id) for doc_id in doc_ids}

    def latest(self, doc_id: str) -> int:
        rows = self._db.read("SELECT latest FROM document_order WHERE doc_id = ?", (doc_id,))
        return int(rows[0][0]) if rows else 0

    @contextlib.contextmanager
    def hold(self, doc_id: str) -> Iterator[None]:
        with self._held_lock:
            lock = self._held.setdefault(doc_id, threading.Lock())
        with lock:
            yield

    def applied(self, doc_id: str, sequence: int) -> None:
        with self._db.transaction() as db:
            db.execute(
                "INSERT INTO document_order (doc_id, applied) VALUES (?, ?) "
                "ON CONFLICT (doc_id) DO UPDATE SET applied = MAX(applied, excluded.applied)",
                (doc_id, sequence),
            )

    def pending(self, doc_id: str) -> bool:
        rows = self._db.read("SELECT latest > applied FROM document_order WHERE doc_id = ?", (doc_id,))
        return bool(rows and rows[0][0])

    def close(self) -> None:
        self._db.close()


def _latest(db: sqlite3.Connection, doc_id: str) -> int:
    row = db.execute("SELECT latest FROM document_order WHERE doc_id = ?", (doc_id,)).fetchone()
    return int(row[0]) if row else 0
