"""The index of stored blocks: where each lives, its size, and when it was last used (for LRU eviction).

Two implementations sit behind the `KVIndex` protocol: Redis, shared by every worker of a deployment, and a
SQLite file for a single host without Redis. The block files are the truth; the index is a fast view of
them that `repair` rebuilds after a crash or a lost Redis.
"""

from __future__ import annotations

import logging
import math
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import redis

from service.kvcache.fileformat import (
    BLOCK_SUFFIX,
    CorruptBlockError,
    block_relpath,
    is_temp_file,
    read_header,
)
from service.kvcache.keys import is_block_key

log = logging.getLogger(__name__)

SQLITE_FILENAME = "kv_index.sqlite3"
DEFAULT_REDIS_PREFIX = "kvstitch:kv"
# A temp file younger than this may belong to a writer that is still running; repair leaves it alone.
TEMP_FILE_GRACE_S = 300.0


@dataclass(frozen=True)
class IndexEntry:
    """One stored block. `path` is relative to the cache dir so the dir can move or be shared."""

    key: str
    path: str
    nbytes: int
    tokens: int
    created: float
    last_used: float


class KVIndex(Protocol):
    """What the cache needs from an index; implementations must be safe across threads and processes."""

    def get(self, key: str) -> IndexEntry | None: ...

    def put(self, entry: IndexEntry) -> None: ...

    def touch(self, key: str, now: float) -> None: ...

    def remove(self, key: str) -> bool: ...

    def keys(self) -> list[str]: ...

    def created_before(self, when: float) -> list[str]:
        """Keys of the blocks stored before `when` (a Unix time)."""
        ...

    def lru(self, limit: int, newest_first: bool = False) -> list[IndexEntry]:
        """Up to `limit` entries, least recently used first (most recently used first with `newest_first`)."""
        ...

    def total_bytes(self) -> int: ...

    def close(self) -> None: ...


# What an index raises when its store is away or refuses (Redis down, SQLite locked or unwritable).
INDEX_ERRORS: tuple[type[Exception], ...] = (redis.RedisError, sqlite3.Error)


# ---- Redis -------------------------------------------------------------------------------------------------

# Each mutation touches the entry hash, the LRU sorted set and the byte total. Lua scripts run atomically on
# the server in one round trip, so the three never disagree, even with many workers writing at once.
_PUT_SCRIPT = """
local old = tonumber(redis.call('HGET', KEYS[1], 'bytes') or '0') or 0
redis.call('HSET', KEYS[1], 'path', ARGV[2], 'bytes', ARGV[3], 'tokens', ARGV[4], 'created', ARGV[5],
           'last_use', ARGV[6])
redis.call('ZADD', KEYS[2], ARGV[6], ARGV[1])
redis.call('INCRBY', KEYS[3], tonumber(ARGV[3]) - old)
return 1
"""
# Last use only moves forward, so a late touch from a slow worker cannot make a hot block look cold.
_TOUCH_SCRIPT = """
local current = redis.call('ZSCORE', KEYS[2], ARGV[1])
if not current or redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if tonumber(current) >= tonumber(ARGV[2]) then return 1 end
redis.call('HSET', KEYS[1], 'last_use', ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
return 1
"""
# Removal also clears a half-written (malformed) hash or a stray LRU member, so repair can always clean up.
_REMOVE_SCRIPT = """
local old = tonumber(redis.call('HGET', KEYS[1], 'bytes') or '0') or 0
local existed = redis.call('DEL', KEYS[1]) + redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('DECRBY', KEYS[3], old)
if existed > 0 then return 1 end
return 0
"""


class RedisIndex:
    """Index in Redis: a hash per block, a sorted set `{prefix}:lru` scored by last use, a byte counter."""

    def __init__(self, url: str, prefix: str = DEFAULT_REDIS_PREFIX) -> None:
        self.prefix = prefix
        self._redis: Any = redis.Redis.from_url(url, decode_responses=True)
        self._lru_key = f"{prefix}:lru"
        self._bytes_key = f"{prefix}:bytes"
        self._put = self._redis.register_script(_PUT_SCRIPT)
        self._touch = self._redis.register_script(_TOUCH_SCRIPT)
        self._remove = self._redis.register_script(_REMOVE_SCRIPT)

    def _entry_key(self, key: str) -> str:
        return f"{self.prefix}:entry:{key}"

    def _script_keys(self, key: str) -> list[str]:
        return [self._entry_key(key), self._lru_key, self._bytes_key]

    def get(self, key: str) -> IndexEntry | None:
        return _entry_from_fields(key, self._redis.hgetall(self._entry_key(key)))

    def put(self, entry: IndexEntry) -> None:
        times = [repr(entry.created), repr(entry.last_used)]
        args: list[str | int] = [entry.key, entry.path, entry.nbytes, entry.tokens, *times]
        self._put(keys=self._script_keys(entry.key), args=args)

    def touch(self, key: str, now: float) -> None:
        self._touch(keys=self._script_keys(key), args=[key, repr(now)])

    def remove(self, key: str) -> bool:
        return bool(self._remove(keys=self._script_keys(key), args=[key]))

    def keys(self) -> list[str]:
        return [str(k) for k in self._redis.zrange(self._lru_key, 0, -1)]

    def created_before(self, when: float) -> list[str]:
        keys = self.keys()
        pipe = self._redis.pipeline(transaction=False)
        for key in keys:
            pipe.hget(self._entry_key(key), "created")
        return [key for key, created in zip(keys, pipe.execute(), strict=True) if _float(created) < when]

    def lru(self, limit: int, newest_first: bool = False) -> list[IndexEntry]:
        if limit <= 0:
            return []
        ordered = self._redis.zrevrange if newest_first else self._redis.zrange
        keys = [str(k) for k in ordered(self._lru_key, 0, limit - 1)]
        pipe = self._redis.pipeline(transaction=False)
        for key in keys:
            pipe.hgetall(self._entry_key(key))
        found = (_entry_from_fields(k, f) for k, f in zip(keys, pipe.execute(), strict=True))
        return [e for e in found if e is not None]

    def total_bytes(self) -> int:
        return int(self._redis.get(self._bytes_key) or 0)

    def close(self) -> None:
        self._redis.close()


def _float(value: str | None) -> float:
    """A stored time; a missing or malformed one reads as the epoch (old enough for any sweep)."""
    try:
        return float(value) if value is not None else 0.0
    except ValueError:
        return 0.0


def _entry_from_fields(key: str, fields: dict[str, str]) -> IndexEntry | None:
    """An entry from a Redis hash; a missing or malformed hash reads as absent (repair re-creates it)."""
    if not fields:
        return None
    try:
        return IndexEntry(
            key=key,
            path=fields["path"],
            nbytes=int(fields["bytes"]),
            tokens=int(fields["tokens"]),
            created=float(fields["created"]),
            last_used=float(fields["last_use"]),
        )
    except (KeyError, ValueError):
        log.warning("malformed index entry for %s in Redis: %r", key, fields)
        return None


# ---- SQLite ------------------------------------------------------------------------------------------------

_SCHEMA_VERSION = 1
_SCHEMA = """
CREATE TABLE IF NOT EXISTS blocks (
    key TEXT PRIMARY KEY,
    path TEXT NOT NULL,
    nbytes INTEGER NOT NULL,
    tokens INTEGER NOT NULL,
    created REAL NOT NULL,
    last_used REAL NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS blocks_last_used ON blocks (last_used);
CREATE TABLE IF NOT EXISTS totals (id INTEGER PRIMARY KEY CHECK (id = 0), nbytes INTEGER NOT NULL);
INSERT OR IGNORE INTO totals (id, nbytes) VALUES (0, 0);
CREATE TRIGGER IF NOT EXISTS blocks_insert AFTER INSERT ON blocks
    BEGIN UPDATE totals SET nbytes = nbytes + NEW.nbytes WHERE id = 0; END;
CREATE TRIGGER IF NOT EXISTS blocks_delete AFTER DELETE ON blocks
    BEGIN UPDATE totals SET nbytes = nbytes - OLD.nbytes WHERE id = 0; END;
CREATE TRIGGER IF NOT EXISTS blocks_resize AFTER UPDATE OF nbytes ON blocks
    BEGIN UPDATE totals SET nbytes = nbytes - OLD.nbytes + NEW.nbytes WHERE id = 0; END;
"""
_COLUMNS = "key, path, nbytes, tokens, created, last_used"


class SqliteIndex:
    """Index in a SQLite file (WAL): one connection shared by threads under a lock; processes use SQLite's.

    Triggers keep the byte total in the same transaction as each row change, so `total_bytes` is O(1).
    `synchronous=NORMAL` may lose the last transactions on power loss; `repair` re-indexes those files.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        # Autocommit: every statement is its own transaction; the 30 s busy timeout covers other processes.
        self._conn = sqlite3.connect(self.path, timeout=30.0, isolation_level=None, check_same_thread=False)
        with self._lock:
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")
            schema = f"BEGIN IMMEDIATE; {_SCHEMA} PRAGMA user_version = {_SCHEMA_VERSION}; COMMIT;"
            self._conn.executescript(schema)

    def _query(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            return self._conn.execute(sql, params).fetchall()

    def _change(self, sql: str, params: tuple[Any, ...]) -> int:
        with self._lock:
            return self._conn.execute(sql, params).rowcount

    def get(self, key: str) -> IndexEntry | None:
        rows = self._query(f"SELECT {_COLUMNS} FROM blocks WHERE key = ?", (key,))
        return _entry_from_row(rows[0]) if rows else None

    def put(self, entry: IndexEntry) -> None:
        self._change(
            f"INSERT INTO blocks ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (key) DO UPDATE SET "
            "path = excluded.path, nbytes = excluded.nbytes, tokens = excluded.tokens, "
            "created = excluded.created, last_used = excluded.last_used",
            (entry.key, entry.path, entry.nbytes, entry.tokens, entry.created, entry.last_used),
        )

    def touch(self, key: str, now: float) -> None:
        self._change("UPDATE blocks SET last_used = MAX(last_used, ?) WHERE key = ?", (now, key))

    def remove(self, key: str) -> bool:
        return self._change("DELETE FROM blocks WHERE key = ?", (key,)) > 0

    def keys(self) -> list[str]:
        return [str(row[0]) for row in self._query("SELECT key FROM blocks ORDER BY last_used, key")]

    def created_before(self, when: float) -> list[str]:
        return [str(row[0]) for row in self._query("SELECT key FROM blocks WHERE created < ? ORDER BY key", (when,))]

    def lru(self, limit: int, newest_first: bool = False) -> list[IndexEntry]:
        order = "last_used DESC, key DESC" if newest_first else "last_used, key"
        rows = self._query(f"SELECT {_COLUMNS} FROM blocks ORDER BY {order} LIMIT ?", (max(limit, 0),))
        return [_entry_from_row(row) for row in rows]

    def total_bytes(self) -> int:
        return int(self._query("SELECT nbytes FROM totals WHERE id = 0")[0][0])

    def close(self) -> None:
        with self._lock:
            self._conn.close()


def _entry_from_row(row: tuple[Any, ...]) -> IndexEntry:
    key, path, nbytes, tokens, created, last_used = row
    return IndexEntry(str(key), str(path), int(nbytes), int(tokens), float(created), float(last_used))


def open_index(redis_url: str | None, data_dir: Path, redis_prefix: str = DEFAULT_REDIS_PREFIX) -> KVIndex:
    """Redis when a URL is configured (shared by all workers), else a SQLite file in the data dir."""
    if redis_url:
        return RedisIndex(redis_url, redis_prefix)
    return SqliteIndex(Path(data_dir) / SQLITE_FILENAME)


# ---- repair ------------------------------------------------------------------------------------------------


@dataclass
class RepairReport:
    """What `repair` found and changed."""

    files_seen: int = 0
    entries_seen: int = 0
    reindexed: int = 0
    entries_removed: int = 0
    corrupt_removed: int = 0
    temp_removed: int = 0


def repair(
    index: KVIndex, cache_dir: Path, now: float | None = None, temp_grace_s: float = TEMP_FILE_GRACE_S
) -> RepairReport:
    """Make the index and the block files agree again.

    Temp files older than `temp_grace_s` are deleted, entries whose file is gone (or whose path points
    anywhere but the key's own file) are removed, and files without an entry are re-indexed from their
    header, or deleted when the header fails its checks.
    """
    cache_dir = Path(cache_dir)
    now = time.time() if now is None else now
    report = RepairReport()
    report.temp_removed = _remove_stale_temp_files(cache_dir, now - temp_grace_s)
    _remove_dangling_entries(index, cache_dir, report)
    _reindex_orphan_files(index, cache_dir, set(index.keys()), report)
    return report


def _remove_stale_temp_files(cache_dir: Path, older_than: float) -> int:
    removed = 0
    for path in cache_dir.rglob("*.tmp"):
        if is_temp_file(path) and _mtime(path) < older_than:
            path.unlink(missing_ok=True)
            removed += 1
    return removed


def _remove_dangling_entries(index: KVIndex, cache_dir: Path, report: RepairReport) -> None:
    keys = index.keys()
    for key in keys:
        report.entries_seen += 1
        entry = index.get(key)
        # The path comes from a shared store, so it must be exactly the key's own path, never `../..`.
        if entry is None or not is_block_key(key) or entry.path != block_relpath(key):
            valid = False
        else:
            valid = (cache_dir / entry.path).is_file()
        if not valid and index.remove(key):
            report.entries_removed += 1


def _reindex_orphan_files(index: KVIndex, cache_dir: Path, indexed: set[str], report: RepairReport) -> None:
    for path in _block_files(cache_dir):
        report.files_seen += 1
        key = path.name.removesuffix(BLOCK_SUFFIX)
        if key in indexed:
            continue
        entry = _entry_from_file(cache_dir, path, key)
        if entry is None:
            path.unlink(missing_ok=True)
            report.corrupt_removed += 1
        else:
            index.put(entry)
            report.reindexed += 1


def _block_files(cache_dir: Path) -> Iterator[Path]:
    for path in cache_dir.rglob(f"*{BLOCK_SUFFIX}"):
        if path.is_file():
            yield path


def _entry_from_file(cache_dir: Path, path: Path, key: str) -> IndexEntry | None:
    """The entry a valid, correctly placed block file deserves; None when it must go."""
    if not is_block_key(key) or path.relative_to(cache_dir).as_posix() != block_relpath(key):
        log.warning("removing misplaced block file %s", path)
        return None
    try:
        header = read_header(path)
    except CorruptBlockError as err:
        log.warning("removing corrupt block file: %s", err)
        return None
    if header.key != key:
        log.warning("removing block file %s: its header names key %s", path, header.key)
        return None
    size = path.stat().st_size
    last_used = _mtime(path)
    return IndexEntry(key, block_relpath(key), size, header.num_tokens, header.created, last_used)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return math.inf  # vanished meanwhile: never "stale"
