"""A full data disk fails the job cleanly: status `failed` naming the cause, what it wrote released, and new jobs
succeed once space is back; instead of a job left `running` for ever while its blocks keep the disk full.

The disk is simulated faithfully enough for the worker: once full, every write fails (a KV file with ENOSPC, the
SQLite job stores with "database or disk is full") until something is deleted, which frees space."""

from __future__ import annotations

import contextlib
import errno
import sqlite3
from collections.abc import Callable
from typing import Any

import pytest
from ingest_support import CORPUS, run_job

from service.jobs.documents import Document
from service.jobs.submit import submit_ingest
from service.kvcache import tiers
from service.serving.runtime import Runtime
from workers.worker import is_no_space, runtime_worker

OpenRuntime = Callable[..., Runtime]


class FullDisk:
    """Full after `writes_left` more KV block files; deleting any block frees space again."""

    def __init__(self, writes_left: int) -> None:
        self.writes_left = writes_left
        self.full = False

    def write(self) -> None:
        if self.full or self.writes_left == 0:
            self.full = True
            raise OSError(errno.ENOSPC, "No space left on device")
        self.writes_left -= 1

    def check_sqlite(self) -> None:
        if self.full:
            raise sqlite3.OperationalError("database or disk is full")


def fill_the_disk(runtime: Runtime, disk: FullDisk, monkeypatch: pytest.MonkeyPatch) -> None:
    write_block = tiers.write_block

    def write(*args: Any, **kwargs: Any) -> int:
        disk.write()
        return write_block(*args, **kwargs)

    monkeypatch.setattr(tiers, "write_block", write)
    for store, names in ((runtime.jobs, ("create", "update")), (runtime.queue, ("fail", "reject", "ack"))):
        for name in names:
            monkeypatch.setattr(store, name, _checked(disk, getattr(store, name)))
    remove = runtime.store.remove

    def remove_frees_space(key: str) -> None:
        remove(key)
        disk.full, disk.writes_left = False, -1  # room again, for good

    monkeypatch.setattr(runtime.store, "remove", remove_frees_space)


def _checked(disk: FullDisk, method: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        disk.check_sqlite()
        return method(*args, **kwargs)

    return call


def test_a_full_disk_fails_the_job_releases_what_it_wrote_and_new_jobs_then_succeed(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk = FullDisk(writes_left=3)
    fill_the_disk(runtime, disk, monkeypatch)
    job_id = submit_ingest(runtime.queue, runtime.jobs, runtime.order, CORPUS)
    worker = runtime_worker(runtime, poll_ms=10)

    for _ in range(5):  # as the worker's loop does: an error that escapes a turn is logged, the next turn runs
        with contextlib.suppress(Exception):
            worker.run_once()
        status = runtime.jobs.get(job_id)
        if status is not None and status.status == "failed":
            break

    assert status is not None and status.status == "failed", status
    assert status.error is not None and status.error.startswith("no space left on the data disk (")
    assert "No space left on device" in status.error or "database or disk is full" in status.error
    assert "free space and send it again" in status.error
    assert runtime.index.keys() == [] and runtime.collection.invisible_points() == []  # the 3 blocks released
    assert runtime.queue.pending_count() == 0  # not retried into the full disk

    again = run_job(runtime, [Document("chess.txt", "In chess the knight jumps over other pieces.")])
    assert again.status == "done" and again.documents_done == 1


def test_no_space_is_told_apart_wherever_it_comes_from() -> None:
    wrapped = RuntimeError("upsert failed")
    wrapped.__cause__ = sqlite3.OperationalError("database or disk is full")
    assert is_no_space(OSError(errno.ENOSPC, "No space left on device"))
    assert is_no_space(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert is_no_space(wrapped)
    assert is_no_space(ValueError("qdrant: [Errno 28] No space left on device: '/data/qdrant/x'"))
    assert not is_no_space(OSError(errno.EACCES, "Permission denied"))
    assert not is_no_space(sqlite3.OperationalError("database is locked"))
