"""`KVStore`: the one object the worker asks for a request's chunk KV, whichever tier holds it.

A fetch plans every block (device, host pool, disk, or miss), then loads in an order that cannot evict a block it
still needs: device hits are taken first, host hits are queued for H2D, disk blocks are read in parallel by reader
threads into host pool slots (with O_DIRECT when `direct_io` is on and the filesystem allows it; each block's H2D
copy starts as its read finishes, overlapping the reads still running), and the misses are computed in batched
calls of the `precompute` callable the store was given (at most `max_precompute_tokens` padded tokens each; one
call when they fit). The store never sees the engine: the composition root binds that callable and the layer
groups. Only then are new blocks promoted into the device tier, whose overflow is demoted into the host pool.
Misses are written to disk by a background thread, so the request never waits for the disk and the next request
hits. A block file that fails a check is deleted, counted as corrupt and recomputed like a miss, so the answer is
the same as without the cache.

With a shared tier (`shared.py`: block files on an S3 object store every node reads), the blocks the disk tier could
not give are looked up there before they are computed (on reader threads of their own, checked like a file, copied
into a host slot only when found); each one found is served as a disk hit (`FetchResult.shared` counts them) and
its file copied to the local disk by the background writer. Blocks computed here are uploaded after their local
write.

Every block copied to the device comes with its `Arrival` in `FetchResult.ready`. By default the fetch orders the
caller's stream after all copies before it returns, so any consumer is safe. With `overlap=True` it does not: the
caller passes `ready` to the stitcher (`StitchEngine.stitch(..., chunk_ready=result.ready)`, likewise
`prefill_stitched` and the scheduler's slab prefill), which waits for each block just before placing it, so the
first blocks are rotated while later ones are still copying. When the store was given `layer_groups` (the engine
pipelines: CUDA graphs on, `engine.pipeline_layers`) an overlapped fetch copies the host-tier hits layer group by
layer group across all of them instead, and their `ready` entries are `LayeredArrival`s: the engine stitches group g and
replays prefill segment g while group g + 1 is still copying (`StitchEngine.prefill_pipelined`).
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Self

import torch

from service.engine.kv_layout import KVBlock, ModelSpec, TokenIds, block_shape, check_block
from service.kvcache import device
from service.kvcache.device import CopyEvent
from service.kvcache.fileformat import CorruptBlockError, MissingBlockError, QuantBlock
from service.kvcache.host_pool import HostPool, HostSlot
from service.kvcache.index import INDEX_ERRORS, KVIndex
from service.kvcache.keys import KeySpace, block_key, dtype_name
from service.kvcache.precompute import DEFAULT_MAX_PRECOMPUTE_TOKENS, Precompute, precompute_batches
from service.kvcache.quant import DiskFormat, QuantizedKV, dequantize, unpack
from service.kvcache.shared import SharedRead, SharedStats, SharedTier
from service.kvcache.tiers import DiskTier, GpuTier, HostTier, Tier, TierChange, TierListener, TierMove
from service.kvcache.writeback import WriteBack

log = logging.getLogger(__name__)

CACHE_TIERS = (Tier.GPU, Tier.HOST, Tier.DISK)
# Block files are read in parallel: reads and checksums release the GIL, and an NVMe drive needs several
# requests in flight to reach its bandwidth.
DEFAULT_READ_THREADS = 4
# Shared-tier reads wait on the network, not the disk: more of them in flight (the S3 client pools as many connections).
SHARED_READ_THREADS = 16
KEY_CACHE_SIZE = 1 << 16
# Prompts waiting for the read-ahead thread at most; more are not read ahead (their admission reads for them).
READ_AHEAD_QUEUE = 64
# The disk tier's blocks `tier_contents` lists at most (the most recently used): a snapshot of a huge disk tier would
# stall the start of publishing, and the blocks used last are the likeliest to be asked for again.
DISK_CONTENTS_LIMIT = 100_000
# Local copies of shared-tier reads waiting for the disk writer, at most: each holds its object's bytes in memory, so
# a burst of reads faster than the disk writes is not copied (those blocks are read from the shared tier again).
MAX_PENDING_COPIES = 64
# Layer ranges [first, end) the host tier copies by when a fetch overlaps (the engine's prefill segments).
LayerGroups = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class TierBudgets:
    """Bytes each tier may hold; 0 disables a tier (the GPU tier on a CPU-only host, say)."""

    gpu_bytes: int = 0
    host_bytes: int = 0
    disk_bytes: int = 0


@dataclass(frozen=True)
class PlannedBlock:
    key: str
    token_ids: TokenIds
    tier: Tier
    nbytes: int


@dataclass(frozen=True)
class LoadPlan:
    """Where each requested block would come from right now, in request order."""

    blocks: tuple[PlannedBlock, ...]

    def counts(self) -> dict[Tier, int]:
        return _count(b.tier for b in self.blocks)

    def bytes_by_tier(self) -> dict[Tier, int]:
        return _sum_bytes((b.tier, b.nbytes) for b in self.blocks)


@dataclass
class FetchTimings:
    """Milliseconds of one fetch; each waits for the device work it times (per event)."""

    load_ms: float = 0.0  # disk reads (parallel), checksums included: until the last read finished; shared included
    shared_ms: float = 0.0  # the shared tier's reads (after the disk's), until the last finished
    precompute_ms: float = 0.0  # the batched forwards over the misses, until the last one finished
    total_ms: float = 0.0  # until `fetch` returned (copies may still be landing: see `h2d_ms`)
    copies: device.CopyClock | None = field(default=None, repr=False, compare=False)

    @property
    def h2d_ms(self) -> float:
        """Copy time of the host-to-device copies, until the last one landed.

        Resolved on first read, which waits for the last copy: read it after stitching, so timing the copies
        does not hold up the stitch that overlaps them.
        """
        return 0.0 if self.copies is None else self.copies.elapsed_ms()


@dataclass
class FetchResult:
    """The blocks on the engine's device, in request order, where each came from, and when each is there.

    `ready[i]` is None when block i needs no wait (it was resident, computed on the caller's stream, or the
    device is a CPU), else the `Arrival` of its copy: pass `ready` as the stitcher's `chunk_ready`.
    """

    blocks: list[KVBlock]
    sources: list[Tier]
    counts: dict[Tier, int]
    bytes_loaded: dict[Tier, int]
    ready: list[device.Arrival | None] = field(default_factory=list)  # LayeredArrival for layer-group copies
    corrupt: int = 0
    shared: int = 0  # blocks served as disk hits that the disk tier read through from the shared tier
    timings: FetchTimings = field(default_factory=FetchTimings)
    pinned: list[str] = field(default_factory=list)  # device-tier keys held in place until `KVStore.release`


@dataclass(frozen=True)
class TierUsage:
    used_bytes: int | None  # None for disk while the index (which holds its total) is unreachable
    budget_bytes: int
    blocks: int | None  # None for disk, where counting would scan the index


@dataclass(frozen=True)
class StoreStats:
    """Counters since the store opened, and current usage per tier (for metrics)."""

    usage: dict[Tier, TierUsage]
    hits: dict[Tier, int]
    misses: int
    corrupt: int
    evictions: dict[Tier, int]
    blocks_written: int
    bytes_written: int
    pending_writes: int
    write_errors: dict[str, int]  # by reason: index, disk, no_space, other (writeback.WRITE_ERROR_REASONS)
    shared: SharedStats | None = None  # the shared tier's, where one is configured
    read_ahead: int = 0  # blocks read from disk into the host tier before their fetch asked (`prefetch`)


class KVStore:
    """Tiered cache of chunk KV for one model, template and dtype.

    The lock keeps the memory tiers' bookkeeping consistent between a fetch (on the engine loop, the one owner
    of the device) and readers such as `stats` (the metrics thread); it does not serialise device work. `put` and
    the background writer only touch the disk tier, which is safe across threads and processes.
    `precompute` computes missing blocks (batched, in the order given); `layer_groups` are the layer ranges an
    overlapped fetch copies host-tier hits by (None: whole blocks). The store does
    not own the index it is given and leaves closing it to the caller. `max_precompute_tokens` caps the padded
    tokens of one batched precompute of misses. `direct_io` reads block payloads with O_DIRECT into the host
    pool where the filesystem allows it. It is off by default: O_DIRECT bypasses the page cache, so a block the
    cache holds is read from the disk again (a warm 8K fetch took 283 ms against 58 ms buffered), and whether a
    cold read gains depends on the drive. Turn it on where a cold fetch measures faster with it. `disk_format`
    "int8" or "fp8" stores block files in an 8-bit form (`quant.py`: half the bytes to read, pin and copy;
    dequantised on the device after the copy), under keys of their own; "native" (the default) stores the compute
    dtype's bytes, bit-exact. `tier_listener` is told of every block entering or leaving a tier (`tiers.TierMove`):
    how an engine publishes its placement for routing; None (the default) tells no one. `shared` is the tier behind
    the disk (None: none); the store closes it.
    """

    def __init__(
        self,
        spec: ModelSpec,
        fingerprint: str,
        template_version: str,
        cache_dir: Path,
        index: KVIndex,
        budgets: TierBudgets,
        precompute: Precompute,
        layer_groups: LayerGroups | None = None,
        read_threads: int = DEFAULT_READ_THREADS,
        max_precompute_tokens: int = DEFAULT_MAX_PRECOMPUTE_TOKENS,
        direct_io: bool = False,
        disk_format: DiskFormat = "native",
        tier_listener: TierListener | None = None,
        shared: SharedTier | None = None,
    ) -> None:
        if max_precompute_tokens <= 0:
            raise ValueError("max_precompute_tokens must be positive")
        self.spec = spec
        self.fingerprint = fingerprint
        self.template_version = template_version
        self.target = spec.device  # where fetched blocks end up: the engine's device
        self.max_precompute_tokens = max_precompute_tokens
        self.precompute = precompute
        self.layer_groups = layer_groups
        self.gpu = GpuTier(budgets.gpu_bytes, tier_listener)
        pool = HostPool(budgets.host_bytes, pinned=device.uses_cuda(self.target))
        self.host = HostTier(pool, self.target, device.new_copy_stream(self.target), tier_listener)
        self.disk = DiskTier(
            Path(cache_dir), index, fingerprint, spec, budgets.disk_bytes, direct_io, disk_format, tier_listener
        )
        self.disk_format = disk_format
        self.shared = shared
        self.max_pending_copies = MAX_PENDING_COPIES
        self._writeback = WriteBack(self.disk, self.target, self._share if shared is not None else None)
        self.readers = concurrent.futures.ThreadPoolExecutor(max(1, read_threads), thread_name_prefix="kv-read")
        self.shared_readers = (
            concurrent.futures.ThreadPoolExecutor(SHARED_READ_THREADS, thread_name_prefix="kv-s3-read")
            if shared is not None
            else None
        )
        self._lock = threading.Lock()
        self._kv_bytes_per_token = spec.kv_bytes_per_token()
        # Hashing a 512-token block costs ~100 µs of Python; hot chunks recur, so remember recent keys.
        self._cached_key = functools.lru_cache(maxsize=KEY_CACHE_SIZE)(self._compute_key)
        self._hits: Counter[Tier] = Counter()
        self._misses = 0
        self._corrupt = 0
        self._put_blocks = 0  # blocks and bytes `put` wrote (ingestion); the write-back counts its own
        self._put_bytes = 0
        # Disk reads `prefetch` started into busy host slots, by key, until a fetch settles them.
        self._prefetching: dict[str, concurrent.futures.Future[KVBlock | QuantBlock]] = {}
        self.prefetched = 0  # blocks `prefetch` read ahead into the host tier (metrics, tests)
        # `read_ahead`'s thread: its index lookups are round trips the caller (an answer's start) should not wait on.
        self._ahead = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-read-ahead")
        self._ahead_queued = 0  # prompts waiting for that thread (bounded: READ_AHEAD_QUEUE), under _ahead_lock
        self._ahead_lock = threading.Lock()

    @property
    def key_space(self) -> KeySpace:
        """What this store's keys are computed in (a router compares it with its own)."""
        return KeySpace(self.fingerprint, self.template_version, dtype_name(self.spec.dtype), self.disk_format)

    def key_of(self, token_ids: Sequence[int]) -> str:
        return self._cached_key(tuple(map(int, token_ids)))

    def _compute_key(self, token_ids: TokenIds) -> str:
        return block_key(self.fingerprint, self.template_version, self.spec.dtype, token_ids, self.disk_format)

    # ---- planning ----------------------------------------------------------------------------------------

    def plan(self, token_id_blocks: Sequence[Sequence[int]]) -> LoadPlan:
        """Which tier each block would be served from now (the disk answer trusts the index)."""
        with self._lock:
            return self._plan(token_id_blocks)

    def _plan(self, token_id_blocks: Sequence[Sequence[int]]) -> LoadPlan:
        planned = []
        for ids in token_id_blocks:
            token_ids, key = self._keyed(ids)
            nbytes = len(token_ids) * self._kv_bytes_per_token
            planned.append(PlannedBlock(key, token_ids, self._tier_of(key, token_ids), nbytes))
        return LoadPlan(tuple(planned))

    def _keyed(self, ids: Sequence[int]) -> tuple[TokenIds, str]:
        """A block's ids as a tuple of ints and its key. A prompt's blocks are tuples of ints already
        (`PromptTemplate.chunk_block`): converting a question's thousands of ids again would cost the engine thread
        about a millisecond per admission."""
        token_ids = ids if type(ids) is tuple else tuple(map(int, ids))
        return token_ids, self._cached_key(token_ids)

    def _tier_of(self, key: str, token_ids: TokenIds) -> Tier:
        gpu_block = self.gpu.peek(key)
        if gpu_block is not None and gpu_block.token_ids == token_ids:
            return Tier.GPU
        slot = self.host.pool.peek(key)
        if slot is not None and slot.token_ids == token_ids:
            return Tier.HOST
        return Tier.DISK if self.disk.contains(key) else Tier.MISS

    # ---- reading ahead -----------------------------------------------------------------------------------

    def prefetch(self, prompt_blocks: Sequence[Sequence[int]]) -> int:
        """Start reading into the host tier, on the reader threads, the blocks of a prompt that only the disk
        holds; returns how many reads started. Called when a request arrives, so that its reads overlap its wait
        in line and the fetch at its admission (on the engine thread, which every running answer waits for) finds
        host hits to copy instead of disk reads to wait for. A block without host room is left to the fetch."""
        with self._lock:
            wanted = {}
            for ids in prompt_blocks:
                token_ids, key = self._keyed(ids)
                if not self._held(key):
                    wanted[key] = token_ids
        try:
            on_disk = {k: ids for k, ids in wanted.items() if self.disk.contains(k)}  # the index, outside the lock
        except INDEX_ERRORS as err:  # reading ahead is a help, never a failure: the fetch will say what is wrong
            log.debug("no KV read ahead, the index is away: %s", err)
            return 0
        started = 0
        with self._lock:
            for key, token_ids in on_disk.items():
                if self._held(key):
                    continue  # a fetch or another prefetch got there meanwhile
                shape = block_shape(self.spec, len(token_ids))
                slot = self.host.reserve(key, token_ids, self.spec.dtype, shape, self.disk_format)
                if slot is None:
                    break  # every host slot busy or too small: the rest wait for the fetch
                read = self.readers.submit(self.disk.read, key, token_ids, self.host.buffer(slot))
                self._prefetching[key] = read  # settled by the next fetch (no callback: it would need this lock)
                started += 1
        return started

    def read_ahead(self, prompt_blocks: Sequence[Sequence[int]]) -> concurrent.futures.Future[int] | None:
        """`prefetch` on the store's read-ahead thread; the future gives how many reads it started. None when
        READ_AHEAD_QUEUE prompts already wait for that thread: a read ahead that starts after its admission's
        fetch is of no use, and the queue must not grow without bound when lookups are slower than arrivals."""
        with self._ahead_lock:
            if self._ahead_queued >= READ_AHEAD_QUEUE:
                return None
            self._ahead_queued += 1
        try:
            return self._ahead.submit(self._prefetch_queued, list(prompt_blocks))
        except RuntimeError:  # the store closing: nothing was queued
            with self._ahead_lock:
                self._ahead_queued -= 1
            raise

    def _prefetch_queued(self, prompt_blocks: Sequence[Sequence[int]]) -> int:
        with self._ahead_lock:
            self._ahead_queued -= 1
        return self.prefetch(prompt_blocks)

    def _held(self, key: str) -> bool:
        """Under the lock: whether the GPU or the host tier holds the block, or a read ahead is bringing it."""
        return key in self._prefetching or self.gpu.peek(key) is not None or self.host.pool.peek(key) is not None

    def _settle_prefetches(self, prompt_blocks: Sequence[Sequence[int]]) -> None:
        """Under the lock, before a fetch plans: every read ahead that ended settled, and those of this prompt's
        blocks still running waited for (a host hit soon, rather than the same block read twice)."""
        mine = {self._keyed(ids)[1] for ids in prompt_blocks}
        for key in [k for k, read in self._prefetching.items() if k in mine or read.done()]:
            self._settle(key)

    def _settle(self, key: str) -> None:
        """Under the lock: wait for the read ahead of `key` if it still runs, then mark its slot filled (a host
        hit from now on) or discard it (the fetch reads the disk again, and counts what it finds). Once only."""
        read = self._prefetching.pop(key, None)
        if read is None:
            return
        slot = self.host.pool.peek(key)
        try:
            read.result()
        except Exception as err:  # damaged (the disk tier deleted it), vanished or unreadable: not read ahead
            if isinstance(err, CorruptBlockError):
                self._corrupt += 1  # counted here: the fetch finds the block gone and computes it
            elif not isinstance(err, MissingBlockError):
                log.warning("cannot read KV block %s ahead: %s", key, err)
            if slot is not None:
                self.host.discard(key)
            return
        if slot is not None:
            self.host.filled(slot)
            self.prefetched += 1

    # ---- fetching ----------------------------------------------------------------------------------------

    def fetch(self, prompt_blocks: Sequence[Sequence[int]], *, overlap: bool = False, pin: bool = False) -> FetchResult:
        """The KV of every block on the target device, in order; misses computed in capped batches.

        Without `overlap` the caller's current stream is ordered after every copy before this returns. With
        it, copies may still be running: pass `result.ready` to the stitch, which waits block by block.
        With `pin`, every block the device tier holds after the fetch stays there, in place, until `release`
        (a reader that attends to the tier's copy instead of copying it); the others are the caller's alone.
        """
        start = time.perf_counter()
        with self._lock:
            if self._prefetching:
                self._settle_prefetches(prompt_blocks)
            plan = self._plan(prompt_blocks)
            fetch = _Fetch(self, plan)
            result = fetch.run(overlap)
            if pin:
                result.pinned = [key for key, block in fetch.blocks.items() if self.gpu.peek(key) is block]
                for key in result.pinned:
                    self.gpu.pin(key)
            self._hits.update(t for t in fetch.sources.values() if t is not Tier.MISS)
            self._misses += sum(1 for t in fetch.sources.values() if t is Tier.MISS)
            self._corrupt += result.corrupt
        self._writeback.touch(k for k, t in fetch.sources.items() if t is not Tier.MISS)
        result.timings.total_ms = (time.perf_counter() - start) * 1e3
        return result

    def release(self, result: FetchResult) -> None:
        """Unpin what a pinned fetch held (once: a second call finds nothing left to release)."""
        with self._lock:
            keys, result.pinned = result.pinned, []
            for key in keys:
                self.gpu.unpin(key)

    # ---- ingestion ---------------------------------------------------------------------------------------

    def contains(self, key: str) -> bool:
        """Whether the block with this key is stored (on disk and in the index)."""
        return self.disk.contains(key)

    def stored_before(self, when: float) -> list[str]:
        """Keys of the blocks on disk stored before `when` (a Unix time), for sweeps of blocks nothing names."""
        return self.disk.index.created_before(when)

    def remove(self, key: str) -> None:
        """Drop a block from every tier (no point names it any more)."""
        with self._lock:
            self._settle(key)  # a read ahead still filling its host slot: never free memory a reader writes into
            self.gpu.discard(key)
            self.host.discard(key)
        self.disk.remove(key)
        if self.shared is not None:
            self.shared.delete_later(key)

    def put(self, blocks: Sequence[KVBlock]) -> int:
        """Store blocks on disk and in the index now; returns bytes written (0 for blocks already stored)."""
        written = 0
        for block in blocks:
            check_block(self.spec, block)
            try:
                size = self.disk.write(self.key_of(block.token_ids), block)
            except Exception as err:  # counted with the background writes' failures (disk full, index away)
                self._writeback.record_failure(err)
                raise
            # Ingestion writes here, not through the write-back queue: count it too (kvstitch_kv_blocks_written).
            with self._lock:
                self._put_blocks += size > 0
                self._put_bytes += size
            if size > 0 and self.shared is not None:
                self._share(self.key_of(block.token_ids))
            written += size
        return written

    def _share(self, key: str) -> None:
        """Upload a block file just written locally (in the background), so other nodes read it."""
        if self.shared is not None:
            self.shared.upload_later(key, self.disk.path_of(key))

    def keep_copy(self, key: str, found: SharedRead, num_tokens: int) -> None:
        """Queue a local copy of a block file read from the shared tier (nothing when the disk tier is off or the
        disk writer is `max_pending_copies` behind)."""
        if self.disk.budget_bytes > 0 and self._writeback.pending < self.max_pending_copies:
            self._writeback.write_bytes(key, found.data, num_tokens)

    # ---- placement ---------------------------------------------------------------------------------------

    def set_tier_listener(self, listener: TierListener | None) -> None:
        """Tell `listener` of every block entering or leaving a tier from now on (None: no one)."""
        with self._lock:
            self.gpu.listener = self.host.listener = self.disk.listener = listener

    def tier_contents(self, disk_limit: int = DISK_CONTENTS_LIMIT) -> list[TierMove]:
        """Every block held now, as `add` moves: the GPU tier, the host pool, and the disk tier's `disk_limit` most
        recently used blocks. What a publisher announces when it starts or lost its state."""
        with self._lock:
            memory = [(Tier.GPU, held) for held in self.gpu.held()] + [(Tier.HOST, held) for held in self.host.held()]
        newest = self.disk.index.lru(disk_limit, newest_first=True)
        disk = [(Tier.DISK, (e.key, e.tokens)) for e in newest]
        return [TierMove(TierChange.ADD, tier, key, tokens) for tier, (key, tokens) in memory + disk]

    # ---- housekeeping ------------------------------------------------------------------------------------

    def write_back(self, key: str, block: KVBlock) -> None:
        """Queue a computed block for the disk tier (nothing to do when the disk tier is disabled)."""
        if self.disk.budget_bytes > 0:
            self._writeback.write(key, block)

    def flush(self, timeout: float | None = None) -> None:
        """Wait for the queued background writes and index touches, then the shared tier's uploads."""
        self._writeback.flush(timeout)
        if self.shared is not None:
            self.shared.flush(timeout)

    def stats(self) -> StoreStats:
        pool, wb = self.host.pool, self._writeback
        with self._lock:  # a consistent view of the memory tiers between fetches
            gpu_usage = TierUsage(self.gpu.used_bytes, self.gpu.budget_bytes, len(self.gpu))
            host_usage = TierUsage(pool.used_bytes, pool.capacity_bytes, len(pool))
            hits = {t: self._hits[t] for t in CACHE_TIERS}
            misses, corrupt = self._misses, self._corrupt
            evictions = {Tier.GPU: self.gpu.evictions, Tier.HOST: pool.evictions, Tier.DISK: self.disk.evictions}
            put_blocks, put_bytes = self._put_blocks, self._put_bytes
            read_ahead = self.prefetched
        disk_usage = TierUsage(self._disk_used_bytes(), self.disk.budget_bytes, None)
        return StoreStats(
            usage={Tier.GPU: gpu_usage, Tier.HOST: host_usage, Tier.DISK: disk_usage},
            hits=hits,
            misses=misses,
            corrupt=corrupt,
            evictions=evictions,
            blocks_written=wb.blocks_written + put_blocks,
            bytes_written=wb.bytes_written + put_bytes,
            pending_writes=wb.pending,
            write_errors=wb.error_counts(),
            shared=None if self.shared is None else self.shared.stats(),
            read_ahead=read_ahead,
        )

    def _disk_used_bytes(self) -> int | None:
        # Stats feed every metrics scrape: an index outage makes the disk total unknown, not the scrape fail.
        try:
            return self.disk.used_bytes()
        except INDEX_ERRORS:
            return None

    def close(self) -> None:
        """Finish background writes and stop the threads; the index stays open (the caller owns it)."""
        self._writeback.close()
        self._ahead.shutdown(wait=True)  # before the readers: a read ahead submits to them
        self.readers.shutdown(wait=True)
        if self.shared_readers is not None:
            self.shared_readers.shutdown(wait=True)
        if self.shared is not None:
            self.shared.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()


class _Fetch:
    """One fetch's state: the blocks found so far, the copies in flight and the timings."""

    def __init__(self, store: KVStore, plan: LoadPlan) -> None:
        self.store = store
        self.plan = plan
        self.unique = {b.key: b for b in plan.blocks}  # a chunk repeated in one prompt is loaded once
        self.blocks: dict[str, KVBlock] = {}
        self.sources: dict[str, Tier] = {}
        self.arriving: dict[str, CopyEvent] = {}  # the copy each block copied to the device lands on
        self.layered: dict[str, device.LayeredArrival] = {}  # blocks copied by layer groups
        self.clock = device.CopyClock(store.host.stream)
        self.corrupt = 0
        self.shared = 0
        self.timings = FetchTimings(copies=self.clock)

    def run(self, overlap: bool) -> FetchResult:
        by_tier = {t: [b for b in self.unique.values() if b.tier is t] for t in Tier}
        for planned in by_tier[Tier.GPU]:
            self._take_from_gpu(planned)
        groups = self.store.layer_groups if overlap else None
        if groups is not None and len(by_tier[Tier.HOST]) > 0:
            self._take_from_host_by_layers(by_tier[Tier.HOST], groups)
        else:
            for planned in by_tier[Tier.HOST]:
                self._take_from_host(planned)
        if by_tier[Tier.DISK]:
            self._take_from_disk(by_tier[Tier.DISK])
        missing = [b for b in self.unique.values() if b.key not in self.blocks]
        if missing and self.store.shared is not None:
            self._take_from_shared(missing)
            missing = [b for b in missing if b.key not in self.blocks]
        if missing:
            self._compute(missing)
        self._promote()
        if not overlap:
            self._await_copies()
        return self._result()

    def _take_from_gpu(self, planned: PlannedBlock) -> None:
        block = self.store.gpu.get(planned.key)
        if block is not None:
            self._found(planned, block, Tier.GPU, self.store.gpu.arrival(planned.key))

    def _take_from_host(self, planned: PlannedBlock) -> None:
        slot = self.store.host.get(planned.key)
        if slot is None:
            return
        with self.clock.timing():
            block, event = self.store.host.to_device(slot)
        self._found(planned, block, Tier.HOST, event)

    def _take_from_host_by_layers(
        self, planned_blocks: list[PlannedBlock], groups: tuple[tuple[int, int], ...]
    ) -> None:
        """Every host hit copied group-major (layers of group 0 of every block first), one event per group."""
        found = [(p, slot) for p in planned_blocks if (slot := self.store.host.get(p.key)) is not None]
        for planned, slot in found:
            if slot.fmt != "native":  # 8-bit slots are dequantised whole after their copy
                self._take_from_host(planned)
        found = [(p, slot) for p, slot in found if slot.fmt == "native"]
        if not found:
            return
        with self.clock.timing():
            copied = self.store.host.to_device_by_layers([slot for _, slot in found], groups)
        if copied is None:  # plain copies (CPU): nothing to pipeline
            for planned, _ in found:
                self._take_from_host(planned)
            return
        blocks, events = copied
        arrivals = device.layered_arrivals(events, groups, self.store.target, len(found))
        for (planned, _), block, arrived in zip(found, blocks, arrivals, strict=True):
            self._found(planned, block, Tier.HOST, events[-1])
            self.layered[planned.key] = arrived

    def _take_from_disk(self, planned_blocks: list[PlannedBlock]) -> None:
        """Read the disk blocks on the reader threads, each into its own host slot, and start each block's H2D
        copy as soon as its read is done, so the copies overlap the reads still running."""
        host = self.store.host
        fmt, dtype = self.store.disk_format, self.store.spec.dtype
        slots = {p.key: host.reserve(p.key, p.token_ids, dtype, self._shape(p), fmt) for p in planned_blocks}
        start = time.perf_counter()
        reads = {self.store.readers.submit(self._read, p, slots[p.key]): p for p in planned_blocks}
        try:
            for done in concurrent.futures.as_completed(reads):
                self.timings.load_ms = (time.perf_counter() - start) * 1e3
                self._arrived(reads[done], slots[reads[done].key], done)
        finally:
            # Only after an unexpected error: no slot may stay busy (it could never be evicted again).
            concurrent.futures.wait(reads)
            for key, slot in slots.items():
                if slot is not None and slot.busy:
                    host.discard(key)

    def _take_from_shared(self, planned_blocks: list[PlannedBlock]) -> None:
        """Look the blocks the disk tier did not give up in the shared tier, many at once on its reader threads, and
        start each found block's copy as it arrives. Unlike disk reads (whose blocks exist) a lookup reserves no
        host slot ahead: a slot is taken only for a block found, so absent ones evict nothing from the host tier."""
        shared, readers = self.store.shared, self.store.shared_readers
        assert shared is not None and readers is not None
        start = time.perf_counter()
        reads = {readers.submit(shared.read, p.key, p.token_ids): p for p in planned_blocks}
        for done in concurrent.futures.as_completed(reads):
            planned, found = reads[done], done.result()  # a miss of any kind is None (the tier counted and logged it)
            self.timings.shared_ms = (time.perf_counter() - start) * 1e3
            if found is None:
                continue
            self.shared += 1
            self._place(planned, self._into_slot(planned, found.block), found.block)
            self.store.keep_copy(planned.key, found, len(planned.token_ids))
        self.timings.load_ms += self.timings.shared_ms

    def _into_slot(self, planned: PlannedBlock, block: KVBlock | QuantBlock) -> HostSlot | None:
        """A busy host slot holding a copy of the block's stored bytes; None when the pool has no room."""
        host = self.store.host
        slot = host.reserve(
            planned.key, planned.token_ids, self.store.spec.dtype, self._shape(planned), self.store.disk_format
        )
        if slot is not None:
            stored = block.payload if isinstance(block, QuantBlock) else block.kv.reshape(-1).view(torch.uint8)
            host.buffer(slot)[: stored.numel()].copy_(stored)
        return slot

    def _read(self, planned: PlannedBlock, slot: HostSlot | None) -> KVBlock | QuantBlock:
        """Runs on a reader thread: the checked block, in its host slot when it has one."""
        buffer = None if slot is None else self.store.host.buffer(slot)
        return self.store.disk.read(planned.key, planned.token_ids, buffer)

    def _arrived(
        self, planned: PlannedBlock, slot: HostSlot | None, read: concurrent.futures.Future[KVBlock | QuantBlock]
    ) -> None:
        try:
            block = read.result()
        except (CorruptBlockError, OSError) as err:  # damaged, vanished or unreadable: recompute it
            if slot is not None:
                self.store.host.discard(planned.key)
            if isinstance(err, CorruptBlockError):
                self.corrupt += 1
            elif not isinstance(err, MissingBlockError):
                log.warning("cannot read KV block %s, recomputing it: %s", planned.key, err)
            return
        self._place(planned, slot, block)

    def _place(self, planned: PlannedBlock, slot: HostSlot | None, block: KVBlock | QuantBlock) -> None:
        """Start the device copy of a block read from storage (from its host slot, or from the read's buffer)."""
        host = self.store.host
        with self.clock.timing():
            if slot is not None:
                host.filled(slot)
                block, event = host.to_device(slot)
            elif isinstance(block, QuantBlock):  # no room in the host pool: copy the 8-bit read, then dequantise
                q = block.kv
                kv, event = device.copy_to_device(
                    block.payload, self.store.target, host.stream, lambda flat: dequantize(_moved(q, flat))
                )
                block = KVBlock(block.token_ids, kv)
            else:  # no room in the host pool: copy from the pageable buffer the read allocated
                kv, event = device.copy_to_device(block.kv, self.store.target, host.stream)
                block = KVBlock(block.token_ids, kv)
        self._found(planned, block, Tier.DISK, event)

    def _shape(self, planned: PlannedBlock) -> tuple[int, ...]:
        return block_shape(self.store.spec, len(planned.token_ids))

    def _compute(self, missing: list[PlannedBlock]) -> None:
        """Precompute the misses in batches under the token cap (on the caller's stream: no arrival event)."""
        start = time.perf_counter()
        lengths = [len(b.token_ids) for b in missing]
        for batch in precompute_batches(lengths, self.store.max_precompute_tokens):
            planned_batch = [missing[i] for i in batch]
            computed = self.store.precompute([b.token_ids for b in planned_batch])
            for planned, block in zip(planned_batch, computed, strict=True):
                self._found(planned, block, Tier.MISS)
                self.store.write_back(planned.key, block)
        device.wait_host(device.record_event(self.store.target))  # time the forwards, not their launch
        self.timings.precompute_ms = (time.perf_counter() - start) * 1e3

    def _promote(self) -> None:
        """New blocks into the device tier; what falls out of it (or never fit) is kept in the host pool."""
        gpu, host = self.store.gpu, self.store.host
        for key in self.unique:  # request order, whatever order the reads finished in
            if self.sources[key] is Tier.GPU:
                continue
            for demoted_key, demoted in gpu.put(key, self.blocks[key], self.arriving.get(key)):
                if host.enabled:
                    host.store(demoted_key, demoted)

    def _await_copies(self) -> None:
        """Order the consumer's stream after every copy (device-side; the host goes on)."""
        for event in self.arriving.values():
            device.wait_on(event, self.store.target)

    def _found(self, planned: PlannedBlock, block: KVBlock, source: Tier, arriving: CopyEvent | None = None) -> None:
        self.blocks[planned.key] = block
        self.sources[planned.key] = source
        if arriving is not None:
            self.arriving[planned.key] = arriving

    def _result(self) -> FetchResult:
        ordered = self.plan.blocks
        sources = [self.sources[b.key] for b in ordered]
        target = self.store.target
        return FetchResult(
            blocks=[self.blocks[b.key] for b in ordered],
            sources=sources,
            counts=_count(sources),
            bytes_loaded=_sum_bytes(zip(sources, (b.nbytes for b in ordered), strict=True)),
            ready=[self.layered.get(b.key) or device.arrival(self.arriving.get(b.key), target) for b in ordered],
            corrupt=self.corrupt,
            shared=self.shared,
            timings=self.timings,
        )


def _moved(q: QuantizedKV, flat: torch.Tensor) -> QuantizedKV:
    """`q`'s data and scales as views of its payload copied elsewhere (`flat`)."""
    return unpack(flat, q.fmt, tuple(q.data.shape), q.compute_dtype)


def _count(tiers: Iterable[Tier]) -> dict[Tier, int]:
    counts = Counter(tiers)
    return {t: counts[t] for t in Tier}


def _sum_bytes(pairs: Iterable[tuple[Tier, int]]) -> dict[Tier, int]:
    totals = dict.fromkeys(Tier, 0)
    for tier, nbytes in pairs:
        totals[tier] += nbytes
    return totals
