"""One kvstitch process per data dir: an advisory lock on `DATA_DIR/kvstitch.lock`, held while the process uses it.

Embedded Qdrant and the SQLite stores allow one process per data dir; a second one used to fail deep inside
qdrant-client (chained tracebacks) or, in `kvstitch serve`, start and answer 503 forever. `flock` is released by
the kernel when the holder dies, however it dies, so a stale file never blocks a restart. The file holds the
holder's pid, for the message. Within one process the lock is shared (counted), so an entry point may take it
early and the runtime take it again.
"""

from __future__ import annotations

import fcntl
import os
import threading
from dataclasses import dataclass
from pathlib import Path

LOCK_FILE = "kvstitch.lock"


class DataDirInUseError(RuntimeError):
    """Another process holds the data dir; the message names the dir and, when known, that process's pid."""

    def __init__(self, data_dir: Path, pid: str) -> None:
        holder = f"pid {pid}" if pid else "pid unknown"
        super().__init__(f"data dir {data_dir} is in use by another kvstitch process ({holder})")
        self.data_dir = data_dir


@dataclass
class _Held:
    fd: int
    count: int


_held: dict[Path, _Held] = {}
_guard = threading.Lock()


class DataDirLock:
    """This process's claim on a data dir; `release` gives it up (the last release unlocks the file)."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self._released = False

    def release(self) -> None:
        with _guard:
            if self._released:
                return
            self._released = True
            held = _held[self.data_dir]
            held.count -= 1
            if held.count == 0:
                del _held[self.data_dir]
                os.close(held.fd)  # closing the last descriptor drops the flock


def claim_data_dir(data_dir: Path) -> DataDirLock:
    """Lock `data_dir` (created if missing) for this process; DataDirInUseError when another process has it."""
    data_dir = Path(data_dir).resolve()
    with _guard:
        if data_dir in _held:
            _held[data_dir].count += 1
            return DataDirLock(data_dir)
        data_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(data_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            os.close(fd)
            raise DataDirInUseError(data_dir, pid) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
        _held[data_dir] = _Held(fd, 1)
        return DataDirLock(data_dir)
