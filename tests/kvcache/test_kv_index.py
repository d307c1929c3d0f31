"""The block index, over Redis and SQLite alike: bookkeeping, LRU order, restarts and repair."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
import torch
from kv_support import BlockFactory, SpecFactory

from service.kvcache.fileformat import block_relpath, read_block, write_block
from service.kvcache.index import (
    SQLITE_FILENAME,
    IndexEntry,
    KVIndex,
    RedisIndex,
    SqliteIndex,
    open_index,
    repair,
)
from service.kvcache.keys import block_key

FP = "c" * 64
Opener = Callable[[], KVIndex]


@pytest.fixture
def index(index_opener: Opener) -> KVIndex:
    return index_opener()


def entry(n: int, nbytes: int = 1000, last_used: float = 0.0) -> IndexEntry:
    key = block_key(FP, "tpl", torch.float32, [n])
    return IndexEntry(key, block_relpath(key), nbytes, tokens=n + 1, created=1000.0 + n, last_used=last_used)


# ---- bookkeeping -------------------------------------------------------------------------------------------


def test_put_then_get_returns_the_same_entry(index: KVIndex) -> None:
    e = entry(1, nbytes=4096, last_used=1234.5678901234)
    index.put(e)
    assert index.get(e.key) == e
    assert index.get(entry(2).key) is None


def test_total_bytes_follows_puts_replacements_and_removes(index: KVIndex) -> None:
    assert index.total_bytes() == 0
    index.put(entry(1, nbytes=100))
    index.put(entry(2, nbytes=250))
    assert index.total_bytes() == 350
    index.put(entry(1, nbytes=40))  # re-put of the same key replaces, not adds
    assert index.total_bytes() == 290
    assert index.remove(entry(2).key) is True
    assert index.remove(entry(2).key) is False
    assert index.total_bytes() == 40
    assert index.keys() == [entry(1).key]


def test_created_before_lists_the_blocks_stored_before_a_time(index: KVIndex) -> None:
    for n in (1, 2, 3):
        index.put(entry(n))  # created 1001, 1002, 1003
    assert sorted(index.created_before(1002.5)) == sorted([entry(1).key, entry(2).key])
    assert index.created_before(1001.0) == []
    assert sorted(index.created_before(10_000.0)) == sorted(entry(n).key for n in (1, 2, 3))


def test_lru_lists_least_recently_used_first(index: KVIndex) -> None:
    for n, used in [(1, 30.0), (2, 10.0), (3, 20.0)]:
        index.put(entry(n, last_used=used))
    assert [e.key for e in index.lru(10)] == [entry(2).key, entry(3).key, entry(1).key]
    assert [e.key for e in index.lru(2)] == [entry(2).key, entry(3).key]
    assert index.lru(0) == []

    index.touch(entry(2).key, 40.0)

    assert [e.key for e in index.lru(10)] == [entry(3).key, entry(1).key, entry(2).key]
    refreshed = index.get(entry(2).key)
    assert refreshed is not None and refreshed.last_used == 40.0
    assert sorted(index.keys()) == sorted(entry(n).key for n in (1, 2, 3))


def test_lru_lists_most_recently_used_first_when_asked(index: KVIndex) -> None:
    for n, used in [(1, 30.0), (2, 10.0), (3, 20.0)]:
        index.put(entry(n, last_used=used))

    assert [e.key for e in index.lru(2, newest_first=True)] == [entry(1).key, entry(3).key]
    assert [e.tokens for e in index.lru(10, newest_first=True)] == [2, 4, 3]
    assert index.lru(0, newest_first=True) == []


def test_touch_never_moves_last_use_backwards(index: KVIndex) -> None:
    index.put(entry(1, last_used=50.0))
    index.touch(entry(1).key, 20.0)
    got = index.get(entry(1).key)
    assert got is not None and got.last_used == 50.0


def test_touch_of_an_unknown_key_creates_nothing(index: KVIndex) -> None:
    index.touch(entry(7).key, 99.0)
    assert index.get(entry(7).key) is None
    assert index.keys() == [] and index.lru(5) == [] and index.total_bytes() == 0


def test_index_survives_a_restart(index_opener: Opener) -> None:
    first = index_opener()
    first.put(entry(1, nbytes=11, last_used=5.0))
    first.put(entry(2, nbytes=22, last_used=3.0))
    first.close()

    second = index_opener()

    assert second.get(entry(1).key) == entry(1, nbytes=11, last_used=5.0)
    assert [e.key for e in second.lru(10)] == [entry(2).key, entry(1).key]
    assert second.total_bytes() == 33


def test_concurrent_threads_keep_the_total_exact(index: KVIndex) -> None:
    def work(worker: int) -> None:
        for i in range(40):
            n = worker * 100 + i
            index.put(entry(n, nbytes=n))
            if i % 2:
                index.remove(entry(n).key)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    kept = [w * 100 + i for w in range(4) for i in range(40) if i % 2 == 0]
    assert sorted(index.keys()) == sorted(entry(n).key for n in kept)
    assert index.total_bytes() == sum(kept)


SQLITE_WRITER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from service.kvcache.index import IndexEntry, SqliteIndex

    path, worker = Path(sys.argv[1]), int(sys.argv[2])
    index = SqliteIndex(path)
    for i in range(150):
        key = f"{worker:02x}{i:030x}"
        index.put(IndexEntry(key, f"{key[:2]}/{key}.kvblock", i + 1, 1, 0.0, float(i)))
        index.touch(key, float(i) + 0.5)
        if i % 3 == 0:
            index.remove(key)
    index.close()
    """
)


@pytest.mark.slow
def test_sqlite_index_is_shared_safely_by_processes(tmp_path: Path) -> None:
    path = tmp_path / "data" / SQLITE_FILENAME
    commands = [[sys.executable, "-c", SQLITE_WRITER, str(path), str(worker)] for worker in (1, 2, 3)]
    writers = [subprocess.Popen(command) for command in commands]
    assert [w.wait(timeout=120) for w in writers] == [0, 0, 0]

    index = SqliteIndex(path)
    try:
        kept = [i for i in range(150) if i % 3]
        assert len(index.keys()) == 3 * len(kept)
        assert index.total_bytes() == 3 * sum(i + 1 for i in kept)
        assert index.lru(1)[0].last_used == 1.5
    finally:
        index.close()


def test_open_index_picks_sqlite_without_a_redis_url(tmp_path: Path) -> None:
    opened = open_index(None, tmp_path / "data")
    try:
        assert isinstance(opened, SqliteIndex)
        assert (tmp_path / "data" / SQLITE_FILENAME).is_file()
    finally:
        opened.close()


def test_open_index_picks_redis_with_a_url(redis_url: str, tmp_path: Path) -> None:
    opened = open_index(redis_url, tmp_path)
    try:
        assert isinstance(opened, RedisIndex)
    finally:
        opened.close()


# ---- repair ------------------------------------------------------------------------------------------------


def test_repair_makes_index_and_files_agree(
    index: KVIndex, tmp_path: Path, make_spec: SpecFactory, make_block: BlockFactory
) -> None:
    spec = make_spec()
    cache = tmp_path / "cache"
    names = ["kept", "orphan", "gone"]
    blocks = {name: make_block(spec, num_tokens=8 + i, seed=i) for i, name in enumerate(names)}
    keys = {name: block_key(FP, "tpl", spec.dtype, b.token_ids) for name, b in blocks.items()}
    paths = {name: cache / block_relpath(key) for name, key in keys.items()}
    sizes = {name: write_block(paths[name], keys[name], FP, b) for name, b in blocks.items()}
    # "kept" is indexed and on disk; "orphan" is on disk only; "gone" is indexed but its file was lost.
    for name in ("kept", "gone"):
        index.put(IndexEntry(keys[name], block_relpath(keys[name]), sizes[name], 9, 1.0, 2.0))
    (cache / block_relpath(keys["gone"])).unlink()
    corrupt_key = block_key(FP, "tpl", spec.dtype, [9, 9, 9])
    corrupt = cache / block_relpath(corrupt_key)
    write_block(corrupt, corrupt_key, FP, make_block(spec, seed=7))
    corrupt.write_bytes(corrupt.read_bytes()[:-10])
    stale_temp = cache / "ab" / f".{'ab' * 16}.kvblock.123.deadbeef.tmp"
    fresh_temp = cache / "ab" / f".{'ab' * 16}.kvblock.456.feedface.tmp"
    for temp in (stale_temp, fresh_temp):
        temp.parent.mkdir(exist_ok=True)
        temp.write_bytes(b"half a block")
    os.utime(stale_temp, (1.0, 1.0))

    report = repair(index, cache)

    assert (report.reindexed, report.entries_removed, report.corrupt_removed, report.temp_removed) == (
        1,
        1,
        1,
        1,
    )
    assert (report.files_seen, report.entries_seen) == (3, 2)
    assert sorted(index.keys()) == sorted([keys["kept"], keys["orphan"]])
    assert index.total_bytes() == sizes["kept"] + sizes["orphan"]
    reindexed = index.get(keys["orphan"])
    assert reindexed is not None
    assert (reindexed.path, reindexed.nbytes, reindexed.tokens) == (
        block_relpath(keys["orphan"]),
        sizes["orphan"],
        9,
    )
    loaded = read_block(cache / reindexed.path, keys["orphan"], FP, spec)
    assert loaded.token_ids == blocks["orphan"].token_ids
    assert not corrupt.exists() and not stale_temp.exists()
    assert fresh_temp.exists()  # may belong to a writer still at work

    again = repair(index, cache)
    assert (again.reindexed, again.entries_removed, again.corrupt_removed, again.temp_removed) == (0, 0, 0, 0)


def test_repair_drops_entries_whose_path_escapes_the_cache(index: KVIndex, tmp_path: Path) -> None:
    outside = tmp_path / "outside.kvblock"
    outside.write_bytes(b"not ours")
    e = entry(1)
    index.put(IndexEntry(e.key, "../outside.kvblock", 8, 1, 1.0, 1.0))
    (tmp_path / "cache").mkdir()

    report = repair(index, tmp_path / "cache")

    assert report.entries_removed == 1 and index.get(e.key) is None
    assert outside.exists()  # repair never deletes outside the cache dir


def test_repair_clears_a_malformed_redis_entry(redis_url: str, tmp_path: Path) -> None:
    prefix = f"kvstitch-test:{uuid.uuid4().hex}"
    index = RedisIndex(redis_url, prefix=prefix)
    client = redis.Redis.from_url(redis_url)
    try:
        e = entry(1)
        index.put(e)
        client.hset(f"{prefix}:entry:{e.key}", "created", "garbage")  # damaged by hand or by a foreign writer
        assert index.get(e.key) is None
        (tmp_path / "cache").mkdir()

        report = repair(index, tmp_path / "cache")

        assert report.entries_removed == 1
        assert index.keys() == [] and index.total_bytes() == 0
        assert client.exists(f"{prefix}:entry:{e.key}") == 0
    finally:
        index.close()
        leftovers = list(client.scan_iter(match=f"{prefix}:*"))
        if leftovers:
            client.delete(*leftovers)
        client.close()
