"""An engine's tier changes, published to Redis, where every gateway's placement view reads them.

Layout, under `{prefix}:fleet` (prefix: `KVSTITCH_REDIS_PREFIX`):

- `engines`: sorted set, engine id -> Unix time of its last heartbeat. How a view finds the engines and drops the
  silent ones.
- `engine:{id}`: hash, the engine's key space (model fingerprint, template version, dtype, stored form), its
  digest and, where it serves one, the URL of its internal API (`url`). What a view compares with its own before
  trusting any key of that engine, and where a gateway that discovers engines through Redis sends questions.
- `held:{id}`: hash, one field `{tier}:{key}` -> token count per block the engine holds. The engine's whole
  placement: what a gateway that starts reads.
- `events`: stream, one entry per published batch (engine, key-space digest, kind, moves as JSON). What a running
  view follows.

Why a state hash per engine *and* a change stream, not one of them: rebuilding from the stream alone needs the stream
kept whole (unbounded) or loses state once trimmed; the hashes alone would have to be re-read whole at every poll.
The hashes are the state, re-readable at any time; the stream is the change feed, capped at `STREAM_MAXLEN`. Each
batch writes both in one MULTI transaction, so a view that reads the stream's last id, then the hashes, then follows
the stream from that id applies every later change at least once and in order; adds and evictions are idempotent, so
it ends where the hashes are. One field per (tier, key) rather than per key: a block may sit in several tiers at once
(a GPU hit keeps its host copy; every computed block goes to disk), and evicting it from one tier must not forget
the others, without a read-modify-write on the server.

Bounded: `engine:{id}` and `held:{id}` expire `ttl_s` after the engine's last heartbeat, so Redis forgets a dead
engine by itself, and views drop an engine whose heartbeat is older than `ttl_s`. An engine that stops cleanly
retires at once (`close`). Heartbeats are stamped with Redis's clock (`TIME`), which the views compare with too, so
hosts whose clocks drift apart do not drop each other.

The publisher is the store's `TierListener`: a move is put in a dict (the last move per block wins) under a lock,
nothing else happens on the engine thread; a thread of its own writes the batch every `flush_interval_s` and beats.
A Redis outage leaves the moves queued (bounded by the blocks there are); once Redis answers again, or whenever the
engine's own hash has gone (it was silent past the TTL), the whole placement is announced again from `contents`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import redis

from service.kvcache.keys import KeySpace
from service.kvcache.tiers import Tier, TierChange, TierMove
from service.outage import OutageLog

log = logging.getLogger(__name__)

# An engine silent this long leaves routing: several missed beats (one every third of it), far less than a restart.
DEFAULT_TTL_S = 15.0
# Moves reach the views within about this; batching them costs one transaction per interval instead of one per block.
FLUSH_INTERVAL_S = 0.05
# The change feed's length (approximate trim); a view that falls further behind rebuilds from the hashes.
STREAM_MAXLEN = 100_000
OUTAGE_RETRY_S = 1.0  # while Redis is away, one attempt a second
ENGINE_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
TIER_NAMES = {t.value: t for t in (Tier.GPU, Tier.HOST, Tier.DISK)}


class EventKind(StrEnum):
    MOVES = "moves"  # `moves` lists tier changes
    RESET = "reset"  # the engine's placement was announced whole: re-read `held:{id}`
    RETIRE = "retire"  # the engine stopped: forget it


@dataclass(frozen=True)
class FleetKeys:
    """The Redis key names of the fleet under one prefix."""

    root: str

    @classmethod
    def under(cls, prefix: str) -> FleetKeys:
        return cls(f"{prefix}:fleet")

    @property
    def engines(self) -> str:
        return f"{self.root}:engines"

    @property
    def events(self) -> str:
        return f"{self.root}:events"

    def engine(self, engine_id: str) -> str:
        return f"{self.root}:engine:{engine_id}"

    def held(self, engine_id: str) -> str:
        return f"{self.root}:held:{engine_id}"


def held_field(tier: Tier, key: str) -> str:
    return f"{tier.value}:{key}"


def parse_held_field(field: str) -> tuple[Tier, str] | None:
    """(tier, key) of a `held:{id}` field; None for a malformed one."""
    tier, _, key = field.partition(":")
    return (TIER_NAMES[tier], key) if tier in TIER_NAMES and key else None


def encode_moves(moves: Iterable[TierMove]) -> str:
    return json.dumps([[m.change.value, m.tier.value, m.key, m.tokens] for m in moves], separators=(",", ":"))


def decode_moves(text: str) -> list[TierMove]:
    """The moves of a stream entry; ValueError when malformed."""
    try:
        return [TierMove(TierChange(c), TIER_NAMES[t], str(k), int(n)) for c, t, k, n in json.loads(text)]
    except (KeyError, TypeError) as err:
        raise ValueError(f"malformed tier moves: {text[:200]!r}") from err


def redis_time(client: Any) -> float:
    """The Redis server's clock (Unix seconds): the one clock heartbeats are stamped and judged by."""
    seconds, micros = client.time()
    return float(seconds) + float(micros) / 1e6


def key_space_fields(space: KeySpace) -> dict[str, str]:
    return {**dataclasses.asdict(space), "digest": space.digest()}


def key_space_of(fields: dict[str, str]) -> KeySpace | None:
    """The key space an `engine:{id}` hash names; None when incomplete."""
    try:
        return KeySpace(**{f.name: fields[f.name] for f in dataclasses.fields(KeySpace)})
    except KeyError:
        return None


class TierPublisher:
    """Publishes one engine's tier moves and heartbeat; pass it to the KV store as its `tier_listener`.

    `contents` lists every block the engine holds (`KVStore.tier_contents`): announced at start and after any loss
    of state. `start` runs the publishing thread; `flush` and `beat` do one round now (tests, shutdown).
    """

    def __init__(
        self,
        url: str,
        prefix: str,
        engine_id: str,
        space: KeySpace,
        contents: Callable[[], Iterable[TierMove]],
        ttl_s: float = DEFAULT_TTL_S,
        flush_interval_s: float = FLUSH_INTERVAL_S,
        api_url: str | None = None,
    ) -> None:
        if ENGINE_ID.fullmatch(engine_id) is None:
            raise ValueError(f"engine id {engine_id!r}: 1-64 of letters, digits, '.', '_', '-'")
        self.engine_id = engine_id
        self.space = space
        self.keys = FleetKeys.under(prefix)
        self.ttl_s = ttl_s
        self.flush_interval_s = flush_interval_s
        self.api_url = api_url  # the engine's internal API, for gateways that discover engines through Redis
        self._contents = contents
        self._redis: Any = redis.Redis.from_url(url, decode_responses=True)
        self._lock = threading.Lock()
        self._pending: dict[tuple[Tier, str], TierMove] = {}
        self._announced = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._outage = OutageLog(log, "publishing tier changes to Redis")

    def __call__(self, move: TierMove) -> None:
        """The store's listener: queue the move (the last one per block wins)."""
        if move.tier is Tier.MISS:
            return
        with self._lock:
            self._pending[(move.tier, move.key)] = move

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def start(self) -> None:
        """Announce the placement, then publish on a thread until `close`."""
        self._thread = threading.Thread(target=self._run, name="tier-publisher", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last_beat: float | None = None
        while True:
            try:
                if last_beat is None or time.monotonic() - last_beat >= self.ttl_s / 3:
                    self.beat()
                    last_beat = time.monotonic()
                self.flush()
                self._outage.succeeded()
                pause = self.flush_interval_s
            except redis.RedisError as err:
                self._announced = False  # Redis may have lost state, or the TTL passed: announce whole again
                self._outage.failed(err)
                pause = max(self.flush_interval_s, OUTAGE_RETRY_S)
            if self._stop.wait(pause):
                return

    def beat(self) -> None:
        """Refresh the heartbeat and the TTLs; announce the whole placement first when Redis does not know it."""
        if not self._announced or not self._redis.exists(self.keys.engine(self.engine_id)):
            self.announce()
        now = redis_time(self._redis)
        pipe = self._redis.pipeline(transaction=True)
        pipe.zadd(self.keys.engines, {self.engine_id: now})
        pipe.hset(self.keys.engine(self.engine_id), "beat", repr(now))
        for key in (self.keys.engine(self.engine_id), self.keys.held(self.engine_id)):
            pipe.expire(key, max(1, round(self.ttl_s)))
        pipe.execute()

    def announce(self) -> None:
        """Replace the engine's placement in Redis with `contents` (moves queued before are part of it)."""
        with self._lock:
            self._pending.clear()
        held = {held_field(m.tier, m.key): m.tokens for m in self._contents() if m.change is TierChange.ADD}
        pipe = self._redis.pipeline(transaction=True)
        pipe.delete(self.keys.held(self.engine_id))
        for chunk in _chunks(list(held.items()), 10_000):
            pipe.hset(self.keys.held(self.engine_id), mapping=dict(chunk))
        now = redis_time(self._redis)
        fields = {**key_space_fields(self.space), "beat": repr(now), **({"url": self.api_url} if self.api_url else {})}
        pipe.hset(self.keys.engine(self.engine_id), mapping=fields)
        pipe.zadd(self.keys.engines, {self.engine_id: now})
        self._add_event(pipe, EventKind.RESET)
        for key in (self.keys.engine(self.engine_id), self.keys.held(self.engine_id)):
            pipe.expire(key, max(1, round(self.ttl_s)))
        pipe.execute()
        self._announced = True

    def flush(self) -> int:
        """Write the queued moves (one transaction); how many. On a Redis error they stay queued."""
        with self._lock:
            moves, self._pending = list(self._pending.values()), {}
        if not moves:
            return 0
        pipe = self._redis.pipeline(transaction=True)
        held = self.keys.held(self.engine_id)
        added = {held_field(m.tier, m.key): m.tokens for m in moves if m.change is TierChange.ADD}
        evicted = [held_field(m.tier, m.key) for m in moves if m.change is TierChange.EVICT]
        if added:
            pipe.hset(held, mapping=added)
        if evicted:
            pipe.hdel(held, *evicted)
        self._add_event(pipe, EventKind.MOVES, encode_moves(moves))
        pipe.expire(held, max(1, round(self.ttl_s)))
        try:
            pipe.execute()
        except redis.RedisError:
            self._requeue(moves)
            raise
        return len(moves)

    def _requeue(self, moves: list[TierMove]) -> None:
        with self._lock:  # moves queued since are newer: they win
            self._pending = {**{(m.tier, m.key): m for m in moves}, **self._pending}

    def _add_event(self, pipe: Any, kind: EventKind, moves: str = "[]") -> None:
        entry = {"engine": self.engine_id, "space": self.space.digest(), "kind": kind.value, "moves": moves}
        pipe.xadd(self.keys.events, entry, maxlen=STREAM_MAXLEN, approximate=True)

    def retire(self) -> None:
        """Remove the engine from Redis now (a clean stop), so views drop it without waiting for the TTL."""
        pipe = self._redis.pipeline(transaction=True)
        pipe.zrem(self.keys.engines, self.engine_id)
        pipe.delete(self.keys.engine(self.engine_id), self.keys.held(self.engine_id))
        self._add_event(pipe, EventKind.RETIRE)
        pipe.execute()

    def close(self, retire: bool = True) -> None:
        """Stop the thread; retire the engine (best effort: Redis may be away), then close the connection."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        try:
            if retire:
                self.retire()
        except redis.RedisError as err:
            log.warning("could not retire engine %s from Redis (its entries expire by TTL): %s", self.engine_id, err)
        self._redis.close()


def _chunks(items: list[tuple[str, int]], size: int) -> Iterable[list[tuple[str, int]]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]
