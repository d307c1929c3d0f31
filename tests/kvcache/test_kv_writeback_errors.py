"""Background write failures: counted by reason, and an index or disk outage logged once, not once per write."""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Iterable

import pytest
import redis
import torch

from service.kvcache.writeback import WriteBack


class FlakyDisk:
    """Stands in for the DiskTier: touches raise `error` while it is set."""

    def __init__(self) -> None:
        self.error: Exception | None = None
        self.touched: list[str] = []

    def touch(self, keys: Iterable[str], now: float) -> None:
        if self.error is not None:
            raise self.error
        self.touched.extend(keys)


@pytest.mark.parametrize(
    ("error", "reason", "what"),
    [
        (redis.ConnectionError("Connection refused"), "index", "KV index update"),
        (sqlite3.OperationalError("database is locked"), "index", "KV index update"),
        (OSError(28, "No space left on device"), "no_space", "KV block write (disk full)"),
        (OSError(5, "Input/output error"), "disk", "KV block write"),
    ],
)
def test_an_outage_is_one_warning_then_a_count_then_one_recovery_line(
    caplog: pytest.LogCaptureFixture, error: Exception, reason: str, what: str
) -> None:
    disk = FlakyDisk()
    writeback = WriteBack(disk, torch.device("cpu"))  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="service.kvcache.writeback"):
        disk.error = error
        for n in range(7):
            writeback.touch([f"k{n}"])
        writeback.flush()
        during = [r.getMessage() for r in caplog.records]
        disk.error = None
        writeback.touch(["back"])
        writeback.touch(["again"])
        writeback.close()

    assert writeback.error_counts() == {"index": 0, "disk": 0, "no_space": 0, "other": 0} | {reason: 7}
    assert during == [f"{what} failed: {type(error).__name__}: {error} (further failures are counted, not logged, "
                      "until it recovers)"]  # fmt: skip
    messages = [r.getMessage() for r in caplog.records]
    if reason == "index":
        assert messages[1:] == ["KV index update recovered after 7 failures"]
    assert disk.touched == ["back", "again"]
    assert all(r.exc_info is None for r in caplog.records)


def test_an_unexpected_error_is_counted_as_other_and_logged_with_its_traceback_each_time(
    caplog: pytest.LogCaptureFixture,
) -> None:
    disk = FlakyDisk()
    disk.error = KeyError("a bug")
    writeback = WriteBack(disk, torch.device("cpu"))  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="service.kvcache.writeback"):
        writeback.touch(["a"])
        writeback.touch(["b"])
        writeback.close()

    assert writeback.error_counts() == {"index": 0, "disk": 0, "no_space": 0, "other": 2}
    assert [r.exc_info is not None for r in caplog.records] == [True, True]
