"""Tier moves published to the real Redis and the gateway's view of them: rebuilt at start, followed live, bounded."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from fleet_support import chunk, open_store

from service.fleet.placement import PlacementView
from service.fleet.routing import ChunkRef, route
from service.fleet.tier_events import FleetKeys, TierPublisher
from service.kvcache.keys import KeySpace
from service.kvcache.store import KVStore
from service.kvcache.tiers import Tier, TierChange, TierMove
from service.metrics import Metrics
from service.serving.runtime import open_tier_publisher
from service.settings import Settings

TTL_S = 30.0


class Fleet:
    """Stores with publishers and views over one Redis prefix; everything is closed at the end."""

    def __init__(self, url: str, prefix: str, tmp_path: Path) -> None:
        self.url, self.prefix, self.tmp_path = url, prefix, tmp_path
        self.stores: list[KVStore] = []
        self.publishers: list[TierPublisher] = []
        self.views: list[PlacementView] = []

    def engine(self, engine_id: str, fingerprint: str = "fp-test") -> tuple[KVStore, TierPublisher]:
        store = open_store(self.tmp_path / engine_id, gpu_blocks=2, host_blocks=1, fingerprint=fingerprint)
        publisher = TierPublisher(self.url, self.prefix, engine_id, store.key_space, store.tier_contents, ttl_s=TTL_S)
        store.set_tier_listener(publisher)
        self.stores.append(store)
        self.publishers.append(publisher)
        return store, publisher

    def view(self, space: KeySpace, clock: Callable[[], float] | None = None) -> PlacementView:
        self.views.append(PlacementView(self.url, self.prefix, space, ttl_s=TTL_S, clock=clock))
        self.views[-1].load()
        return self.views[-1]

    def close(self) -> None:
        for store in self.stores:
            store.close()
            store.disk.index.close()
        for publisher in self.publishers:
            publisher.close(retire=False)
        for view in self.views:
            view.close()


@pytest.fixture
def fleet(redis_url: str, redis_prefix: str, tmp_path: Path) -> Iterator[Fleet]:
    made = Fleet(redis_url, redis_prefix, tmp_path)
    yield made
    made.close()


def publish(store: KVStore, publisher: TierPublisher) -> None:
    store.flush()  # the disk writes, on the store's writer thread
    publisher.flush()


def test_a_fresh_view_rebuilt_from_redis_sees_what_the_store_holds(fleet: Fleet) -> None:
    store, publisher = fleet.engine("e1")
    publisher.beat()  # announces the (empty) placement
    live = fleet.view(store.key_space)  # loaded before the moves: follows them on the stream
    blocks = [chunk(n) for n in range(4)]
    keys = [store.key_of(ids) for ids in blocks]

    store.fetch(blocks[:3])
    store.fetch(blocks[3:])
    publish(store, publisher)
    live.poll()
    fresh = fleet.view(store.key_space)  # loaded after: reads the engine's hash

    held = [b.tier for b in store.plan(blocks).blocks]
    assert held == [Tier.DISK, Tier.HOST, Tier.GPU, Tier.GPU]
    assert fresh.tiers(keys) == live.tiers(keys) == {"e1": held}


def test_an_eviction_removes_the_block_from_the_view(fleet: Fleet) -> None:
    store, publisher = fleet.engine("e1")
    publisher.beat()
    live = fleet.view(store.key_space)
    key = store.key_of(chunk(0))
    store.fetch([chunk(0)])
    publish(store, publisher)
    live.poll()
    assert live.tier_of("e1", key) is Tier.GPU

    store.remove(key)
    publish(store, publisher)
    live.poll()

    assert live.tier_of("e1", key) is Tier.MISS
    assert fleet.view(store.key_space).tier_of("e1", key) is Tier.MISS
    assert live.stats().blocks == {Tier.GPU: 0, Tier.HOST: 0, Tier.DISK: 0}


def test_a_silent_engine_leaves_the_view_and_its_keys_expire_in_redis(fleet: Fleet, redis_url: str) -> None:
    store, publisher = fleet.engine("e1")
    publisher.beat()
    store.fetch([chunk(0)])
    publish(store, publisher)
    later = [time.time()]
    view = fleet.view(store.key_space, clock=lambda: later[0])
    assert view.engines() == ["e1"]

    client = redis.Redis.from_url(redis_url)
    keys = FleetKeys.under(fleet.prefix)
    ttls = [client.ttl(keys.engine("e1")), client.ttl(keys.held("e1"))]
    client.close()
    assert all(0 < ttl <= TTL_S for ttl in ttls)  # Redis forgets the engine by itself once it stops beating

    later[0] += TTL_S - 1
    view.poll()
    assert view.engines() == ["e1"]
    later[0] += 2  # past the TTL since its last beat
    view.poll()
    assert view.engines() == [] and view.tier_of("e1", store.key_of(chunk(0))) is Tier.MISS
    assert fleet.view(store.key_space, clock=lambda: later[0]).engines() == []


def test_a_retired_engine_leaves_at_once(fleet: Fleet) -> None:
    store, publisher = fleet.engine("e1")
    publisher.beat()
    view = fleet.view(store.key_space)
    assert view.engines() == ["e1"]

    publisher.retire()
    view.poll()

    assert view.engines() == []


def test_a_publisher_thread_announces_and_streams_by_itself(fleet: Fleet) -> None:
    store, publisher = fleet.engine("e1")
    store.fetch([chunk(0)])  # before the publisher runs: part of its first announcement
    view = fleet.view(store.key_space)
    publisher.start()
    store.fetch([chunk(1)])
    store.flush()
    keys = [store.key_of(chunk(0)), store.key_of(chunk(1))]

    deadline = time.monotonic() + 5.0
    while view.tiers(keys).get("e1") != [Tier.GPU, Tier.GPU] and time.monotonic() < deadline:
        view.poll(block_ms=50)

    assert view.tiers(keys) == {"e1": [Tier.GPU, Tier.GPU]}


def test_an_engine_in_another_key_space_is_reported_and_never_routed_to(
    fleet: Fleet, caplog: pytest.LogCaptureFixture
) -> None:
    store, publisher = fleet.engine("e1")
    _, other_publisher = fleet.engine("e2", fingerprint="fp-another-model")
    publisher.beat()
    view = fleet.view(store.key_space)
    metrics = Metrics()
    metrics.watch_placement(view.stats)
    blocks = [chunk(n) for n in range(2)]
    keys = [store.key_of(ids) for ids in blocks]
    store.fetch(blocks[:1])  # e1 holds the first chunk
    publish(store, publisher)
    other_publisher.beat()
    for key in keys:  # e2 claims the gateway's keys on its GPU: a key it never computes for this model
        other_publisher(TierMove(TierChange.ADD, Tier.GPU, key, 24))
    other_publisher.flush()

    with caplog.at_level(logging.WARNING, logger="service.fleet.placement"):
        view.poll()

    assert view.stats().mismatched_moves == {"e2": 2}
    assert metrics.registry.get_sample_value("kvstitch_fleet_mismatched_moves_total", {"engine": "e2"}) == 2
    assert "engine e2" in caplog.text and "fingerprint differ" in caplog.text
    assert view.engines() == ["e1"]
    assert view.tiers(keys) == {"e1": [Tier.GPU, Tier.MISS]}
    decision = route([ChunkRef(k, 24) for k in keys], view.tiers(keys), {"e1": 0, "e2": 0})
    assert (decision.engine, decision.cost) == ("e1", 24.0)  # with e2's claims believed, e2 would cost 0
    assert fleet.view(store.key_space).stats().mismatched_moves == {"e2": 2}  # a reload counts its held blocks


def test_the_runtime_publishes_only_when_an_engine_id_is_set(fleet: Fleet, tmp_path: Path) -> None:
    store = open_store(tmp_path / "runtime", gpu_blocks=2, host_blocks=1)
    fleet.stores.append(store)
    settings = Settings(redis_url=fleet.url, redis_prefix=fleet.prefix, data_dir=tmp_path / "data")
    assert open_tier_publisher(settings, store) is None
    with pytest.raises(ValueError, match="redis_url"):
        Settings(engine_id="gpu-0", data_dir=tmp_path / "data")

    publisher = open_tier_publisher(settings.model_copy(update={"engine_id": "gpu-0"}), store)
    assert publisher is not None
    fleet.publishers.append(publisher)
    store.fetch([chunk(0)])
    view = fleet.view(store.key_space)
    deadline = time.monotonic() + 5.0
    while view.tier_of("gpu-0", store.key_of(chunk(0))) is not Tier.GPU and time.monotonic() < deadline:
        view.poll(block_ms=50)

    assert view.engines() == ["gpu-0"]
    assert view.tier_of("gpu-0", store.key_of(chunk(0))) is Tier.GPU


def test_a_view_that_fell_behind_a_trimmed_stream_loads_again(fleet: Fleet, redis_url: str) -> None:
    store, publisher = fleet.engine("e1")
    publisher.beat()
    view = fleet.view(store.key_space)
    store.fetch([chunk(0), chunk(1)])
    publish(store, publisher)
    client = redis.Redis.from_url(redis_url)
    client.xtrim(FleetKeys.under(fleet.prefix).events, maxlen=0, approximate=False)  # moves the view never read
    client.close()

    assert view.poll() == 0
    keys = [store.key_of(chunk(0)), store.key_of(chunk(1))]
    assert view.tiers(keys) == {"e1": [Tier.GPU, Tier.GPU]}  # from the engine's hash
    assert view.stats().reloads == 2


def test_moves_that_could_not_be_written_stay_queued(tmp_path: Path) -> None:
    space = KeySpace("fp-test", "tpl-1", "float32")
    publisher = TierPublisher("redis://127.0.0.1:1/0", "nowhere", "e1", space, list)  # nothing listens on port 1
    try:
        publisher(TierMove(TierChange.ADD, Tier.GPU, "a" * 32, 24))
        publisher(TierMove(TierChange.ADD, Tier.HOST, "a" * 32, 24))
        publisher(TierMove(TierChange.EVICT, Tier.GPU, "a" * 32))  # the last move per (tier, block) wins
        with pytest.raises(redis.ConnectionError):
            publisher.flush()
        assert publisher.pending == 2
    finally:
        publisher.close(retire=False)
