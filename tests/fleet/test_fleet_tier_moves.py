"""The KV store tells its listener of every block entering or leaving a tier, so a replay of the moves is the store."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
from fleet_support import chunk, open_store

from service.kvcache.store import KVStore
from service.kvcache.tiers import Tier, TierChange, TierMove


class Recorder:
    def __init__(self) -> None:
        self.moves: list[TierMove] = []

    def __call__(self, move: TierMove) -> None:
        self.moves.append(move)


def replay(moves: Iterable[TierMove]) -> dict[str, set[Tier]]:
    held: dict[str, set[Tier]] = {}
    for move in moves:
        tiers = held.setdefault(move.key, set())
        if move.change is TierChange.ADD:
            tiers.add(move.tier)
        else:
            tiers.discard(move.tier)
    return {key: tiers for key, tiers in held.items() if tiers}


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
def store(tmp_path: Path, recorder: Recorder) -> Iterator[KVStore]:
    opened = open_store(tmp_path / "kv", gpu_blocks=2, host_blocks=1, listener=recorder)
    yield opened
    opened.close()
    opened.disk.index.close()


def test_a_replay_of_the_moves_is_what_the_store_holds(store: KVStore, recorder: Recorder) -> None:
    c0, c1, c2, c3 = (store.key_of(chunk(n)) for n in range(4))

    store.fetch([chunk(0), chunk(1), chunk(2)])  # three misses: the GPU tier keeps two, the host pool the first
    store.flush()  # the computed blocks reach the disk tier

    assert replay(recorder.moves) == {c0: {Tier.HOST, Tier.DISK}, c1: {Tier.GPU, Tier.DISK}, c2: {Tier.GPU, Tier.DISK}}
    assert [m.tokens for m in recorder.moves if m.change is TierChange.ADD] == [24] * 7  # GPU 3, host 1, disk 3

    store.fetch([chunk(3)])  # c1 falls to the host pool, which drops c0 to make room
    store.remove(c2)
    store.flush()

    expected = {c0: {Tier.DISK}, c1: {Tier.HOST, Tier.DISK}, c3: {Tier.GPU, Tier.DISK}}
    assert replay(recorder.moves) == expected
    assert replay(store.tier_contents()) == expected
    fastest = [b.tier for b in store.plan([chunk(n) for n in range(4)]).blocks]
    assert fastest == [Tier.DISK, Tier.HOST, Tier.MISS, Tier.GPU]


def test_a_store_without_a_listener_tells_no_one_until_given_one(tmp_path: Path, recorder: Recorder) -> None:
    store = open_store(tmp_path / "kv", gpu_blocks=2, host_blocks=1)
    try:
        store.fetch([chunk(0)])
        store.flush()  # its disk write too, before anyone listens
        store.set_tier_listener(recorder)
        store.fetch([chunk(1), chunk(2)])
        store.flush()
    finally:
        store.close()
        store.disk.index.close()

    c0, c1, c2 = (store.key_of(chunk(n)) for n in range(3))
    assert replay(recorder.moves) == {c0: {Tier.HOST}, c1: {Tier.GPU, Tier.DISK}, c2: {Tier.GPU, Tier.DISK}}


def test_the_contents_list_the_newest_disk_blocks_when_limited(store: KVStore) -> None:
    store.fetch([chunk(0)])
    store.flush()
    time.sleep(0.01)  # the index orders by last use: c1 is written later
    store.fetch([chunk(1)])
    store.flush()

    disk = [m.key for m in store.tier_contents(disk_limit=1) if m.tier is Tier.DISK]

    assert disk == [store.key_of(chunk(1))]
    assert [m.tier for m in store.tier_contents(disk_limit=0)] == [Tier.GPU, Tier.GPU]
