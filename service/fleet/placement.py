"""The gateway's view of the fleet: which engine holds which chunk key in which tier, read from Redis.

`load` rebuilds the view from the engines' state hashes (see `tier_events.py` for the layout and why it has both
hashes and a stream); `poll` applies the change stream from where the view left it, and drops engines whose heartbeat
is older than the TTL or that retired. A view that finds the stream trimmed past its position (it fell behind) loads
again. `start` runs the polls on a thread of their own; routing reads the view under its lock.

Liveness is judged by Redis's clock, as heartbeats are stamped (`clock` replaces it in tests).

An engine whose key space (model fingerprint, template version, dtype, stored form) differs from the gateway's
computes other keys for the same chunks: its placement would never match, a silent miss. Its moves are counted
(`stats().mismatched_moves`, exported as `kvstitch_fleet_mismatched_moves`), the first one is logged with the fields
that differ, and none of it is used for routing.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis

from service.fleet.tier_events import (
    DEFAULT_TTL_S,
    EventKind,
    FleetKeys,
    decode_moves,
    key_space_of,
    parse_held_field,
    redis_time,
)
from service.kvcache.keys import KeySpace
from service.kvcache.tiers import Tier, TierChange, TierMove
from service.outage import OutageLog

log = logging.getLogger(__name__)

READ_COUNT = 1000  # stream entries per read
POLL_BLOCK_MS = 100  # how long the follower thread's read waits for new entries
FASTEST_FIRST = (Tier.GPU, Tier.HOST, Tier.DISK)
NO_ID = "0-0"


@dataclass
class EnginePlacement:
    """One engine's blocks: key -> the tiers holding it (with its token count)."""

    engine_id: str
    beat: float
    blocks: dict[str, dict[Tier, int]] = field(default_factory=dict)
    url: str | None = None  # its internal API, where it announced one

    def apply(self, move: TierMove) -> None:
        tiers = self.blocks.setdefault(move.key, {})
        if move.change is TierChange.ADD:
            tiers[move.tier] = move.tokens
        else:
            tiers.pop(move.tier, None)
        if not tiers:
            del self.blocks[move.key]

    def tier_of(self, key: str) -> Tier:
        """The fastest tier holding `key`; `miss` when none does."""
        tiers = self.blocks.get(key)
        if tiers:
            for tier in FASTEST_FIRST:
                if tier in tiers:
                    return tier
        return Tier.MISS


@dataclass(frozen=True)
class PlacementStats:
    engines: int
    blocks: dict[Tier, int]  # (engine, block) pairs per tier
    mismatched_moves: dict[str, int]  # by engine id: moves ignored because its key space differs
    reloads: int  # full loads (start, a trimmed stream, recovery from an outage)


class PlacementView:
    """Every live engine's placement, for routing; safe to read from any thread while the follower writes."""

    def __init__(
        self,
        url: str,
        prefix: str,
        space: KeySpace,
        ttl_s: float = DEFAULT_TTL_S,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.keys = FleetKeys.under(prefix)
        self.space = space
        self.digest = space.digest()
        self.ttl_s = ttl_s
        self._clock = clock
        self._redis: Any = redis.Redis.from_url(url, decode_responses=True)
        self._lock = threading.Lock()
        self._engines: dict[str, EnginePlacement] = {}
        self._mismatched: Counter[str] = Counter()
        self._last_id = NO_ID
        self._seen = 0  # stream entries ever added up to `_last_id`
        self._reloads = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._outage = OutageLog(log, "following the fleet's tier events in Redis")

    # ---- reads (routing) --------------------------------------------------------------------------------------

    def engines(self) -> list[str]:
        with self._lock:
            return sorted(self._engines)

    def urls(self) -> dict[str, str]:
        """Engine id -> internal API URL, of the live engines (of the gateway's key space) that announced one."""
        with self._lock:
            return {e: p.url for e, p in sorted(self._engines.items()) if p.url}

    def mismatched(self) -> list[str]:
        """Engines seen keying their KV in another key space (ignored for routing)."""
        with self._lock:
            return sorted(self._mismatched)

    def tier_of(self, engine_id: str, key: str) -> Tier:
        with self._lock:
            placement = self._engines.get(engine_id)
            return Tier.MISS if placement is None else placement.tier_of(key)

    def tiers(self, keys: list[str]) -> dict[str, list[Tier]]:
        """For every live engine, the tier of each key (in order): what a routing decision reads, under one lock."""
        with self._lock:
            return {e: [p.tier_of(k) for k in keys] for e, p in sorted(self._engines.items())}

    def stats(self) -> PlacementStats:
        with self._lock:
            blocks = Counter(t for p in self._engines.values() for tiers in p.blocks.values() for t in tiers)
            return PlacementStats(
                len(self._engines), {t: blocks[t] for t in FASTEST_FIRST}, dict(self._mismatched), self._reloads
            )

    # ---- from Redis -------------------------------------------------------------------------------------------

    def load(self) -> None:
        """Rebuild the whole view: the stream position first, then every live engine's hashes (see the module
        docstring of `tier_events` for why that order loses nothing)."""
        last_id, seen = self._stream_position()
        engines = {}
        for engine_id, beat in self._live_engines().items():
            placement = self._read_engine(engine_id, beat)
            if placement is not None:
                engines[engine_id] = placement
        with self._lock:
            self._engines, self._last_id, self._seen = engines, last_id, seen
            self._reloads += 1

    def poll(self, block_ms: int | None = None) -> int:
        """Apply the stream's new entries (waiting up to `block_ms` for some), then drop silent engines and load new
        ones; how many entries were applied."""
        if self._fell_behind():
            log.warning("the fleet's tier events were trimmed past this view's position; loading it again")
            self.load()
            return 0
        read = self._redis.xread({self.keys.events: self._last_id}, count=READ_COUNT, block=block_ms)
        entries = read[0][1] if read else []
        for entry_id, fields in entries:
            self._apply(fields)
            self._last_id, self._seen = entry_id, self._seen + 1
        self._refresh_engines()
        return len(entries)

    def _stream_position(self) -> tuple[str, int]:
        """The stream's last id and how many entries were ever added to it, from one snapshot ("0-0", 0: none)."""
        try:
            info = self._redis.xinfo_stream(self.keys.events)
        except redis.ResponseError:  # no stream (yet, or any more)
            return NO_ID, 0
        return str(info["last-generated-id"]), int(info["entries-added"])

    def _fell_behind(self) -> bool:
        """Whether entries this view has not read were trimmed: the stream keeps the newest `length` of the entries
        ever added and the view has read the first `seen`, so it misses some when more than `length` are unread.
        Fewer added than read means the stream was deleted and made again."""
        try:
            info = self._redis.xinfo_stream(self.keys.events)
        except redis.ResponseError:
            return self._seen > 0
        added, length = int(info["entries-added"]), int(info["length"])
        return added < self._seen or added - self._seen > length

    def _apply(self, fields: dict[str, str]) -> None:
        engine_id, kind = fields.get("engine", ""), fields.get("kind", "")
        if fields.get("space") != self.digest:
            self._mismatch(engine_id, len(decode_moves(fields.get("moves", "[]"))))
            return
        if kind == EventKind.RETIRE:
            with self._lock:
                self._engines.pop(engine_id, None)
        elif kind == EventKind.RESET or engine_id not in self._engines:
            self._reload_engine(engine_id)
        elif kind == EventKind.MOVES:
            moves = decode_moves(fields.get("moves", "[]"))
            with self._lock:
                placement = self._engines.get(engine_id)
                if placement is not None:
                    for move in moves:
                        placement.apply(move)

    def _reload_engine(self, engine_id: str) -> None:
        beat = self._redis.zscore(self.keys.engines, engine_id)
        placement = None if beat is None else self._read_engine(engine_id, float(beat))
        with self._lock:
            if placement is None:
                self._engines.pop(engine_id, None)
            else:
                self._engines[engine_id] = placement

    def _read_engine(self, engine_id: str, beat: float) -> EnginePlacement | None:
        """The engine's placement from its hashes; None when it is gone or its key space is not ours."""
        fields = self._redis.hgetall(self.keys.engine(engine_id))
        if not fields:
            return None
        if fields.get("digest") != self.digest:
            self._mismatch(engine_id, int(self._redis.hlen(self.keys.held(engine_id))), key_space_of(fields))
            return None
        placement = EnginePlacement(engine_id, beat, url=fields.get("url") or None)
        for name, tokens in self._redis.hgetall(self.keys.held(engine_id)).items():
            parsed = parse_held_field(name)
            if parsed is not None:
                placement.blocks.setdefault(parsed[1], {})[parsed[0]] = int(tokens)
        return placement

    def _live_engines(self) -> dict[str, float]:
        """Engine id -> last beat, of the engines that beat within the TTL (the others' entries are removed)."""
        now = self._clock() if self._clock is not None else redis_time(self._redis)
        horizon = now - self.ttl_s
        self._redis.zremrangebyscore(self.keys.engines, "-inf", f"({horizon!r}")
        return {str(e): float(s) for e, s in self._redis.zrange(self.keys.engines, 0, -1, withscores=True)}

    def _refresh_engines(self) -> None:
        live = self._live_engines()
        with self._lock:
            for engine_id in [e for e in self._engines if e not in live]:
                log.info("engine %s left routing (no heartbeat for %.0f s, or retired)", engine_id, self.ttl_s)
                del self._engines[engine_id]
            for engine_id, beat in live.items():
                if engine_id in self._engines:
                    self._engines[engine_id].beat = beat
            new = [e for e in live if e not in self._engines and e not in self._mismatched]
        for engine_id in new:
            self._reload_engine(engine_id)

    def _mismatch(self, engine_id: str, moves: int, theirs: KeySpace | None = None) -> None:
        with self._lock:
            first = engine_id not in self._mismatched
            self._mismatched[engine_id] += moves
        if not first:
            return
        if theirs is None:
            theirs = key_space_of(self._redis.hgetall(self.keys.engine(engine_id)))
        differ = "unknown fields" if theirs is None else ", ".join(self.space.differences(theirs))
        log.warning(
            "engine %s keys its KV in another key space (%s differ: %s vs the gateway's %s); its placement is ignored",
            engine_id,
            differ,
            theirs,
            self.space,
        )

    # ---- the follower thread ----------------------------------------------------------------------------------

    def start(self) -> None:
        """Load the view, then follow the stream on a thread until `close`."""
        self.load()
        self._thread = threading.Thread(target=self._follow, name="placement-view", daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        stale = False
        while not self._stop.is_set():
            try:
                if stale:
                    self.load()  # moves may have been trimmed or engines expired while Redis was away
                    stale = False
                self.poll(block_ms=POLL_BLOCK_MS)
                self._outage.succeeded()
            except (redis.RedisError, ValueError) as err:
                stale = True
                self._outage.failed(err)
                self._stop.wait(1.0)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        self._redis.close()
