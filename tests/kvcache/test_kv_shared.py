"""The shared tier on a real S3 server (SeaweedFS on loopback): a block computed on one node is read by another
without recompute and gives the same KV; a damaged object is refused (a counted miss, recomputed, replaced); an
object store that is down is a miss, never a crash."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from kv_support import bits
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from service.devtools.ports import free_port
from service.devtools.seaweed import SeaweedS3
from service.engine.engine import StitchEngine
from service.engine.gate import synthetic_ids
from service.engine.kv_layout import KVBlock, TokenIds
from service.engine.prompt import PromptIds
from service.kvcache.fileformat import CorruptBlockError, verify_block_bytes, write_block
from service.kvcache.index import SQLITE_FILENAME, SqliteIndex
from service.kvcache.keys import block_key, model_fingerprint
from service.kvcache.quant import DiskFormat
from service.kvcache.s3 import S3Config, S3Objects
from service.kvcache.shared import MISS_REASONS, UPLOAD_RESULTS, SharedTier
from service.kvcache.store import KVStore, TierBudgets
from service.kvcache.tiers import Tier
from service.metrics import Metrics
from service.serving.kv_source import kv_store_for
from service.serving.runtime import open_shared_tier, open_store
from service.settings import Settings

BUCKET = "kvstitch-test"
CHUNK_LENGTHS = (23, 9, 31, 14)
MIB = 1 << 20
LARGE = 1 << 30  # a size cap that never bites: the tests read objects back whole


@pytest.fixture
def engine(get_engine: Callable[..., StitchEngine]) -> StitchEngine:
    return get_engine("qwen2", "cpu")


@pytest.fixture
def prompt(engine: StitchEngine) -> PromptIds:
    chunks = synthetic_ids(engine, CHUNK_LENGTHS, seed=5)
    return engine.template.prompt(chunks, synthetic_ids(engine, [8], seed=6)[0])


class Counting:
    """The engine's precompute, counting the blocks it computes."""

    def __init__(self, engine: StitchEngine) -> None:
        self.engine = engine
        self.blocks = 0

    def __call__(self, blocks: Sequence[TokenIds]) -> list[KVBlock]:
        self.blocks += len(blocks)
        return self.engine.precompute(blocks)


class Nodes:
    """Stores standing for nodes: each its own cache dir and SQLite index, all on one bucket and prefix."""

    def __init__(self, engine: StitchEngine, root: Path, endpoint: str) -> None:
        self.engine = engine
        self.root = root
        self.endpoint = endpoint
        self.prefix = f"test/{uuid.uuid4().hex}"
        self.objects = s3_objects(endpoint)
        self.opened: list[tuple[KVStore, SqliteIndex]] = []

    def open(
        self,
        name: str,
        disk_format: DiskFormat = "native",
        endpoint: str | None = None,
        budgets: TierBudgets | None = None,
        **tier: Any,
    ) -> tuple[KVStore, Counting]:
        counting = Counting(self.engine)
        index = SqliteIndex(self.root / name / "index" / SQLITE_FILENAME)
        shared = SharedTier(
            s3_objects(endpoint or self.endpoint),
            self.prefix,
            model_fingerprint(self.engine.model),
            self.engine.spec,
            disk_format,
            **tier,
        )
        budgets = budgets or TierBudgets(gpu_bytes=0, host_bytes=MIB, disk_bytes=64 * MIB)
        store = kv_store_for(
            self.engine,
            self.root / name / "kv",
            index,
            budgets,
            precompute=counting,
            disk_format=disk_format,
            shared=shared,
        )
        self.opened.append((store, index))
        return store, counting

    def local(self, name: str, disk_format: DiskFormat = "native") -> KVStore:
        """A store over a node's dir and index without the shared tier (what its own disk gives)."""
        index = SqliteIndex(self.root / name / "index" / SQLITE_FILENAME)
        budgets = TierBudgets(gpu_bytes=0, host_bytes=MIB, disk_bytes=64 * MIB)
        store = kv_store_for(self.engine, self.root / name / "kv", index, budgets, disk_format=disk_format)
        self.opened.append((store, index))
        return store

    def close(self) -> None:
        for store, index in self.opened:
            store.close()
            index.close()
        self.objects.close()


def s3_objects(endpoint: str) -> S3Objects:
    objects = S3Objects(S3Config(endpoint, BUCKET, timeout_s=2.0))
    objects.ensure_bucket()
    return objects


@pytest.fixture
def nodes(engine: StitchEngine, tmp_path: Path, s3_credentials: SeaweedS3) -> Iterator[Nodes]:
    made = Nodes(engine, tmp_path, s3_credentials.endpoint)
    yield made
    made.close()


def counts(**nonzero: int) -> dict[Tier, int]:
    return {tier: nonzero.get(tier.value, 0) for tier in Tier}


def same_kv(got: Sequence[KVBlock], want: Sequence[KVBlock]) -> bool:
    return len(got) == len(want) and all(torch.equal(bits(g.kv), bits(w.kv)) for g, w in zip(got, want, strict=True))


def metric_samples(store: KVStore) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    metrics = Metrics()
    metrics.watch_store(store.stats)
    text = metrics.render().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("kvstitch_s3_")
    }


# ---- node B reads what node A computed ---------------------------------------------------------------------


@pytest.mark.parametrize("disk_format", ["native", "int8"])
def test_a_block_computed_on_node_a_is_read_by_node_b_without_recompute(
    nodes: Nodes, prompt: PromptIds, disk_format: DiskFormat
) -> None:
    n = len(prompt.blocks)
    a, computed_a = nodes.open("a", disk_format)
    first = a.fetch(prompt.blocks)
    a.flush()
    uploads_a = a.stats().shared
    files_a = {key: a.disk.path_of(key).read_bytes() for key in map(a.key_of, prompt.blocks)}
    b, computed_b = nodes.open("b", disk_format)
    planned_b = b.plan(prompt.blocks).counts()
    got = b.fetch(prompt.blocks)
    b.flush()
    on_a_disk = nodes.local("a", disk_format).fetch(prompt.blocks)  # what node A's own disk gives
    stats_b = b.stats().shared

    assert first.counts == counts(miss=n) and computed_a.blocks == n
    assert uploads_a is not None and uploads_a.uploads == {**dict.fromkeys(UPLOAD_RESULTS, 0), "stored": n}
    assert uploads_a.bytes_written == sum(map(len, files_a.values()))
    assert planned_b == counts(miss=n)  # node B's disk has nothing
    assert computed_b.blocks == 0 and got.counts == counts(disk=n) and got.shared == n and got.corrupt == 0
    assert got.timings.shared_ms > 0 and got.timings.load_ms >= got.timings.shared_ms
    assert on_a_disk.counts == counts(disk=n) and same_kv(got.blocks, on_a_disk.blocks)
    if disk_format == "native":
        assert same_kv(got.blocks, first.blocks)  # bit for bit what node A computed
    # node B keeps a local copy, byte for byte the object (and A's file); it uploads nothing
    for key, data in files_a.items():
        assert b.disk.contains(key) and b.disk.path_of(key).read_bytes() == data
        assert nodes.objects.get(b.shared.name_of(key), LARGE) == data  # type: ignore[union-attr]
    assert stats_b is not None and stats_b.hits == n and stats_b.misses == dict.fromkeys(MISS_REASONS, 0)
    assert stats_b.bytes_read == sum(map(len, files_a.values())) and stats_b.bytes_written == 0
    assert stats_b.uploads == dict.fromkeys(UPLOAD_RESULTS, 0) and stats_b.latency["get"].count == n
    samples = metric_samples(b)
    assert samples[("kvstitch_s3_hits_total", ())] == n
    assert samples[("kvstitch_s3_bytes_total", (("direction", "read"),))] == stats_b.bytes_read
    assert samples[("kvstitch_s3_seconds_count", (("op", "get"),))] == n


def test_a_block_uploaded_once_is_not_uploaded_again(nodes: Nodes, prompt: PromptIds) -> None:
    n = len(prompt.blocks)
    a, _ = nodes.open("a")
    a.fetch(prompt.blocks)
    a.flush()
    c, _ = nodes.open("c")
    c.put([KVBlock(ids, kv.kv) for ids, kv in zip(prompt.blocks, a.fetch(prompt.blocks).blocks, strict=True)])
    c.flush()  # ingestion on another node wrote the same blocks locally: the objects exist already

    stats_c = c.stats().shared
    assert stats_c is not None and stats_c.uploads == {**dict.fromkeys(UPLOAD_RESULTS, 0), "exists": n}
    assert stats_c.bytes_written == 0


def test_no_local_copy_while_the_disk_writer_is_behind(nodes: Nodes, prompt: PromptIds) -> None:
    n = len(prompt.blocks)
    a, _ = nodes.open("a")
    a.fetch(prompt.blocks)
    a.flush()
    b, computed_b = nodes.open("b")
    b.max_pending_copies = 0  # as if the disk writer had that many copies queued already
    got = b.fetch(prompt.blocks)
    b.flush()

    assert got.counts == counts(disk=n) and got.shared == n and computed_b.blocks == 0
    assert not any(b.disk.contains(b.key_of(ids)) for ids in prompt.blocks)
    assert sorted((nodes.root / "b" / "kv").rglob("*.kvblock")) == []


def test_a_lookup_of_absent_blocks_evicts_nothing_from_the_host_tier(
    nodes: Nodes, engine: StitchEngine, prompt: PromptIds
) -> None:
    a, _ = nodes.open("a")
    a.fetch(prompt.blocks)
    a.flush()
    held = sum(-(-len(ids) * engine.spec.kv_bytes_per_token() // 4096) * 4096 for ids in prompt.blocks)
    b, computed_b = nodes.open("b", budgets=TierBudgets(gpu_bytes=MIB, host_bytes=held, disk_bytes=64 * MIB))
    first = b.fetch(prompt.blocks)  # from S3 through host slots, which the pool holds exactly
    other = engine.template.prompt(synthetic_ids(engine, (40, 40), seed=21), synthetic_ids(engine, [5], seed=4)[0])
    fresh = [ids for ids in other.blocks if ids not in prompt.blocks]
    second = b.fetch(other.blocks)  # absent everywhere: computed, kept in the GPU tier (it has room)

    assert first.shared == len(prompt.blocks) and computed_b.blocks == len(fresh)
    assert second.counts[Tier.MISS] == len(fresh) and second.shared == 0
    assert all(b.key_of(ids) in b.host for ids in prompt.blocks)  # no slot was taken for the lookups


# ---- a damaged object is refused ---------------------------------------------------------------------------


def _flip_last(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 0x01])


def _flip_header(data: bytes) -> bytes:
    return data[:40] + bytes([data[40] ^ 0x01]) + data[41:]


DAMAGE: dict[str, Callable[[bytes, bytes], bytes]] = {
    "payload byte flipped": lambda data, other: _flip_last(data),
    "header byte flipped": lambda data, other: _flip_header(data),
    "truncated": lambda data, other: data[:-100],
    "a few bytes appended": lambda data, other: data + b"\x00" * 8,
    "oversized": lambda data, other: data + bytes(4 * MIB),
    "another block's file": lambda data, other: other,
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_object_is_refused_recomputed_and_replaced(
    nodes: Nodes, engine: StitchEngine, prompt: PromptIds, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    n = len(prompt.blocks)
    a, _ = nodes.open("a")
    first = a.fetch(prompt.blocks)
    a.flush()
    keys = [a.key_of(ids) for ids in prompt.blocks]
    name = a.shared.name_of(keys[0])  # type: ignore[union-attr]
    good, other = (a.disk.path_of(key).read_bytes() for key in keys[:2])
    nodes.objects.put(name, DAMAGE[damage](good, other))
    b, computed_b = nodes.open("b")
    with caplog.at_level(logging.WARNING, logger="service.kvcache.shared"):
        got = b.fetch(prompt.blocks)
    b.flush()
    stats_b = b.stats().shared
    replaced = nodes.objects.get(name, LARGE)

    assert got.counts == counts(disk=n - 1, miss=1) and got.shared == n - 1 and computed_b.blocks == 1
    # the right answer whatever the object held: block 0 computed (alone, as B did), the others node A's
    assert same_kv(got.blocks, [*engine.precompute(prompt.blocks[:1]), *first.blocks[1:]])
    assert stats_b is not None and stats_b.misses == {**dict.fromkeys(MISS_REASONS, 0), "corrupt": 1}
    assert any("corrupt KV object in the shared tier" in r.getMessage() for r in caplog.records)
    assert metric_samples(b)[("kvstitch_s3_misses_total", (("reason", "corrupt"),))] == 1
    # the damaged object was deleted and node B's recomputed file uploaded in its place
    assert stats_b.uploads["stored"] == 1
    assert replaced is not None and replaced == b.disk.path_of(keys[0]).read_bytes()
    assert verify_block_bytes(replaced, name, keys[0]).key == keys[0]


def test_damaged_bytes_fail_the_same_checks_as_a_file(nodes: Nodes, prompt: PromptIds) -> None:
    a, _ = nodes.open("a")
    a.fetch(prompt.blocks)
    a.flush()
    key = a.key_of(prompt.blocks[0])
    data = a.disk.path_of(key).read_bytes()

    assert verify_block_bytes(data, "mem", key).num_tokens == len(prompt.blocks[0])
    with pytest.raises(CorruptBlockError, match="payload checksum mismatch"):
        verify_block_bytes(_flip_last(data), "mem", key)
    with pytest.raises(CorruptBlockError, match="truncated or overlong"):
        verify_block_bytes(data[:-100], "mem", key)
    with pytest.raises(CorruptBlockError, match="key mismatch"):
        verify_block_bytes(data, "mem", a.key_of(prompt.blocks[1]))
    assert a.shared is not None and len(data) <= a.shared.max_object_bytes(len(prompt.blocks[0])) < len(data) + MIB


# ---- the object store down ---------------------------------------------------------------------------------


def test_the_tier_survives_the_object_store_being_down(nodes: Nodes, engine: StitchEngine, prompt: PromptIds) -> None:
    n = len(prompt.blocks)
    now = [0.0]
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    b, computed_b = nodes.open("b", endpoint=dead, retry_after_s=30.0, clock=lambda: now[0])
    first = b.fetch(prompt.blocks)
    b.flush()
    after_first = b.stats().shared
    other = engine.template.prompt(synthetic_ids(engine, (12, 7), seed=9), synthetic_ids(engine, [5], seed=3)[0])
    second = b.fetch(other.blocks)  # within the retry window: the store is not asked
    after_second = b.stats().shared
    now[0] = 31.0
    b.fetch(synthetic_ids(engine, (6,), seed=11))  # the window is over: asked again
    after_window = b.stats().shared

    assert first.counts == counts(miss=n) and computed_b.blocks == n + len(other.blocks) + 1
    assert same_kv(first.blocks, engine.precompute(prompt.blocks))
    assert second.counts == counts(miss=len(other.blocks))
    assert after_first is not None and after_second is not None and after_window is not None
    errors = after_first.misses["error"]
    assert errors >= 1 and errors + after_first.misses["down"] == n
    assert after_first.latency["get"].count == errors
    assert after_first.uploads == {**dict.fromkeys(UPLOAD_RESULTS, 0), "dropped": n}  # kept local, not queued
    assert after_second.misses["down"] == after_first.misses["down"] + len(other.blocks)
    assert after_second.latency["get"].count == errors
    assert after_window.latency["get"].count == errors + 1 and after_window.misses["error"] == errors + 1
    assert all(b.disk.contains(b.key_of(ids)) for ids in prompt.blocks)  # the disk tier works on


# ---- settings ----------------------------------------------------------------------------------------------


def test_the_settings_open_the_tier_on_their_bucket_and_prefix(
    engine: StitchEngine, s3_credentials: SeaweedS3, tmp_path: Path
) -> None:
    prefix = f"settings/{uuid.uuid4().hex}"
    settings = Settings(s3_url=s3_credentials.endpoint, s3_bucket="kvstitch-settings", s3_prefix=prefix)
    tier = open_shared_tier(settings, engine)
    assert tier is not None
    block = engine.precompute([tuple(range(3, 19))])[0]
    key = block_key(model_fingerprint(engine.model), engine.kv_version, engine.spec.dtype, block.token_ids)
    path = tmp_path / "one.kvblock"
    write_block(path, key, model_fingerprint(engine.model), block)
    tier.upload_later(key, path)
    tier.flush()
    found = tier.read(key, block.token_ids)
    tier.close()

    assert open_shared_tier(Settings(), engine) is None  # off by default
    assert open_shared_tier(Settings(s3_url=""), engine) is None  # set empty: off too
    assert tier.name_of(key) == f"{prefix}/{key[:2]}/{key}.kvblock"
    assert tier.objects.url(tier.name_of(key)) == f"s3://kvstitch-settings/{prefix}/{key[:2]}/{key}.kvblock"
    assert found is not None and found.data == path.read_bytes()
    assert isinstance(found.block, KVBlock) and torch.equal(bits(found.block.kv), bits(block.kv))


def test_the_runtime_puts_the_tier_behind_its_store(
    engine: StitchEngine, s3_credentials: SeaweedS3, tmp_path: Path, prompt: PromptIds
) -> None:
    prefix = f"runtime/{uuid.uuid4().hex}"
    settings = Settings(data_dir=tmp_path, s3_url=s3_credentials.endpoint, s3_bucket=BUCKET, s3_prefix=prefix)
    index = SqliteIndex(tmp_path / "index" / SQLITE_FILENAME)
    store = open_store(settings, engine, index, engine.precompute)
    store.fetch(prompt.blocks)
    store.flush()
    stats = store.stats().shared
    store.close()
    index.close()

    assert store.shared is not None and store.shared.prefix == prefix and store.shared.retry_after_s == 10.0
    assert stats is not None and stats.uploads["stored"] == len(prompt.blocks)


@pytest.mark.parametrize(
    ("field", "value"),
    [("s3_url", "ftp://s3.example"), ("s3_bucket", "KV"), ("s3_prefix", "/kv"), ("s3_prefix", "a//b")],
)
def test_bad_s3_settings_are_refused(field: str, value: str) -> None:
    with pytest.raises(ValidationError, match=field):
        Settings(**{field: value})
