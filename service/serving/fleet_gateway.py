"""The gateway's fleet: which engine processes it may send a question to, and the choice of one.

Engines come from `KVSTITCH_ENGINES`: a list of URLs, or `redis` for those that announce themselves there (their
heartbeat hash carries their URL, `service.fleet.tier_events`). A prober thread asks every engine's `/info` every
`PROBE_INTERVAL_S`: an engine is routable while it answers, says it is ready, and keys its KV in the gateway's key
space. An engine that fails a probe or a connection leaves routing at once (`mark_failed`) and comes back after its
next good probe, so a dead engine stops taking questions within a probe interval, long before its heartbeat's TTL.

An engine whose key space (model fingerprint, template version, dtype, stored form) differs from the gateway's would
answer with another model or never find a chunk the gateway names: it is never routed to, its mismatch is logged
once and exported (`kvstitch_fleet_key_space_mismatch`), and `/readyz` names it.

Ingestion goes through the fleet too: the gateway computes no KV (its model is a shell, `open_gateway_model`); each
chunk missing from the KV index is sent to the engine it belongs to (`routing.owner`, the engine chunk-aware routing
breaks ties toward) to be computed there (`place_kv`).

The choice is `service.fleet.routing.route` over the placement view (the chunks' tiers per engine, from Redis) and
the gateway's own count of the answers it has open on each engine (its load): counted here the moment a question is
routed, so concurrent questions see each other at once.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx

from service.engine.kv_layout import TokenIds
from service.fleet.placement import PlacementView
from service.fleet.routing import ChunkRef, RouteDecision, RoutingMode, RoutingPolicy, owner, round_robin, route
from service.fleet.tier_events import key_space_of
from service.kvcache.keys import KeySpace
from service.settings import Settings

log = logging.getLogger(__name__)

PROBE_INTERVAL_S = 0.5
# Chunk tokens per /precompute request at ingestion: the engine holds the whole request's KV on its device until it
# answers (a 7B model's 8K tokens: ~0.5 GB beside its KV pool), and computes it in well under the timeout.
PLACE_BATCH_TOKENS = 8192
PLACE_TIMEOUT_S = 600.0
PROBE_TIMEOUT_S = 2.0
RECENT_DECISIONS = 256  # kept for /readyz-style inspection and the tests
# An engine's count and a gateway's differ by an answer now and then with no other gateway (one sent and not yet
# received, one finished and not yet read, a running shadow); only a larger difference is other gateways' load, so a
# lone gateway's routing does not swing on a unit of noise at each probe.
COUNT_SKEW = 1


@dataclass
class EngineState:
    """One engine as the gateway knows it."""

    url: str
    engine_id: str | None = None  # from its /info
    ready: bool = False
    key_space: KeySpace | None = None
    mismatch: list[str] | None = None  # the key-space fields that differ from the gateway's; None: same
    failed: bool = False  # its last probe or connection failed
    running: int = 0  # answers this gateway has open on it
    reported: dict[str, int] = field(default_factory=dict)  # running/waiting as it last said
    others: int = 0  # answers other gateways had on it at the last probe (its count less this gateway's, less skew)

    @property
    def load(self) -> int:
        """What routing weighs: this gateway's open answers now, plus the other gateways' as of the last probe
        (their changes since are not seen; with one gateway `others` stays near 0)."""
        return self.running + self.others

    @property
    def routable(self) -> bool:
        return self.ready and not self.failed and self.mismatch is None and self.engine_id is not None


@dataclass(frozen=True)
class Routed:
    """A routing decision with what it was made over (the loads), for metrics and inspection."""

    decision: RouteDecision
    url: str
    loads: dict[str, int]


@dataclass(frozen=True)
class FleetEngineFigures:
    running: int
    routable: bool
    mismatched: bool


class NoEngineError(RuntimeError):
    """No engine may take the question now."""


class Fleet:
    """The engines of one gateway; `start` probes them on a thread of its own until `close`."""

    def __init__(self, settings: Settings, space: KeySpace, policy: RoutingPolicy | None = None) -> None:
        self.space = space
        self.policy = policy or RoutingPolicy(
            balance_abs=settings.fleet_balance_abs,
            balance_rel=settings.fleet_balance_rel,
            load_cost_tokens=settings.fleet_load_cost_tokens,
            mode=RoutingMode(settings.fleet_routing),
        )
        self._static = settings.engine_urls
        self._view: PlacementView | None = None
        if settings.redis_url is not None:
            self._view = PlacementView(settings.redis_url, settings.redis_prefix, space, ttl_s=settings.fleet_ttl_s)
        self._lock = threading.Lock()
        self._engines: dict[str, EngineState] = {url: EngineState(url) for url in self._static}
        self._client = httpx.Client(timeout=PROBE_TIMEOUT_S)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.recent: deque[Routed] = deque(maxlen=RECENT_DECISIONS)
        self.reroutes = 0
        self._turn = 0  # round-robin mode: questions routed so far
        self.unplaced = 0  # chunks ingestion could not have computed on an engine (computed at a first question)

    @property
    def view(self) -> PlacementView | None:
        return self._view

    # ---- lifecycle --------------------------------------------------------------------------------------------

    def start(self) -> None:
        if self._view is not None:
            self._view.start()
        self.probe()
        self._thread = threading.Thread(target=self._run, name="fleet-prober", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        if self._view is not None:
            self._view.close()
        self._client.close()

    def _run(self) -> None:
        while not self._stop.wait(PROBE_INTERVAL_S):
            try:
                self.probe()
            except Exception:  # the prober must outlive any one bad answer
                log.exception("probing the engines failed")

    # ---- the engines ------------------------------------------------------------------------------------------

    def urls(self) -> list[str]:
        """The engines to probe: the configured URLs, or those announced in Redis."""
        if self._static or self._view is None:
            return list(self._static)
        return sorted(set(self._view.urls().values()))

    def probe(self) -> None:
        """Ask every engine's /info once; the answers (or failures) update who is routable."""
        urls = self.urls()
        with self._lock:
            for url in [u for u in self._engines if u not in urls and self._engines[u].running == 0]:
                del self._engines[url]
            for url in urls:
                self._engines.setdefault(url, EngineState(url))
        for url in urls:
            self._probe_one(url)

    def _probe_one(self, url: str) -> None:
        try:
            response = self._client.get(f"{url}/info")
            response.raise_for_status()
            info: dict[str, Any] = response.json()
        except (httpx.HTTPError, ValueError) as err:
            self._set_failed(url, f"probe: {type(err).__name__}: {err}")
            return
        space = _key_space(info.get("key_space"))
        with self._lock:
            state = self._engines.get(url)
            if state is None:
                return
            came_back = state.failed
            state.engine_id = str(info.get("engine_id") or url)
            state.ready = bool(info.get("ready"))
            state.reported = {k: int(info.get(k, 0)) for k in ("running", "waiting")}
            state.others = max(0, sum(state.reported.values()) - state.running - COUNT_SKEW)
            state.failed = False
            state.key_space = space
            before, state.mismatch = state.mismatch, self._mismatch(space)
        if came_back:
            log.info("engine %s at %s answers again", state.engine_id, url)
        if state.mismatch is not None and before is None:
            log.warning(
                "engine %s at %s keys its KV in another key space (%s differ: %s vs the gateway's %s): not routed to",
                state.engine_id,
                url,
                ", ".join(state.mismatch),
                space,
                self.space,
            )

    def _mismatch(self, space: KeySpace | None) -> list[str] | None:
        if space is None:
            return None  # still loading: not ready either
        differ = self.space.differences(space)
        return differ or None

    def mark_failed(self, url: str, why: str) -> None:
        """A connection to the engine failed: out of routing until its next good probe."""
        self._set_failed(url, why)

    def _set_failed(self, url: str, why: str) -> None:
        with self._lock:
            state = self._engines.get(url)
            if state is None or state.failed:
                return
            state.failed = True
        log.warning("engine %s at %s left routing: %s", state.engine_id or "?", url, why)

    def engines(self) -> list[EngineState]:
        with self._lock:
            return [_snapshot(s) for s in self._engines.values()]

    def figures(self) -> dict[str, FleetEngineFigures]:
        """Per engine (by id, else URL): answers open on it, whether it is routable, whether its key space differs."""
        with self._lock:
            figures = {
                s.engine_id or s.url: FleetEngineFigures(s.running, s.routable, s.mismatch is not None)
                for s in self._engines.values()
            }
        for engine_id in self._view_mismatched():
            figures.setdefault(engine_id, FleetEngineFigures(0, False, True))
        return figures

    def _view_mismatched(self) -> list[str]:
        """Engines the placement view met in Redis with another key space (discovery never hands them over)."""
        return self._view.mismatched() if self._view is not None else []

    # ---- routing ----------------------------------------------------------------------------------------------

    def choose(self, chunks: Sequence[ChunkRef], exclude: Sequence[str] = ()) -> Routed:
        """Route a question (its chunks' keys and token counts), counting it on the chosen engine at once;
        `NoEngineError` when none may take it. Give it back with `finished`."""
        keys = [c.key for c in chunks]
        placement = self._view.tiers(keys) if self._view is not None else {}
        with self._lock:
            candidates = {s.engine_id: s for s in self._engines.values() if s.routable and s.url not in exclude}
            if not candidates:
                raise NoEngineError(self._why_none(exclude))
            loads = {engine_id: s.load for engine_id, s in candidates.items() if engine_id is not None}
            if self.policy.mode is RoutingMode.ROUND_ROBIN:
                decision = round_robin(chunks, placement, loads, self._turn, self.policy)
                self._turn += 1
            else:
                decision = route(chunks, placement, loads, self.policy)
            chosen = candidates[decision.engine]
            chosen.running += 1
        routed = Routed(decision, chosen.url, loads)
        self.recent.append(routed)
        return routed

    def finished(self, url: str) -> None:
        with self._lock:
            state = self._engines.get(url)
            if state is not None and state.running > 0:
                state.running -= 1

    # ---- ingestion --------------------------------------------------------------------------------------------

    def place_kv(
        self,
        keys: Sequence[str],
        chunks: Sequence[TokenIds],
        on_batch: Callable[[Sequence[int]], None] | None = None,
    ) -> None:
        """Have each chunk's KV computed (or found) on the routable engine it belongs to, all engines at once; a
        chunk no engine takes (none routable, a failed request) is logged and counted, not an ingestion failure:
        its first question computes it. `on_batch(indices)` hears of every batch sent, done or not."""
        if not keys:
            return
        with self._lock:
            urls = {s.engine_id: s.url for s in self._engines.values() if s.routable and s.engine_id is not None}
        if not urls:
            self._unplaced(len(keys), "no engine is routable")
            if on_batch is not None:
                on_batch(range(len(keys)))
            return
        groups: dict[str, list[int]] = {}
        for i, key in enumerate(keys):
            groups.setdefault(owner(key, sorted(urls)), []).append(i)
        with ThreadPoolExecutor(max_workers=len(groups), thread_name_prefix="place-kv") as pool:
            for engine_id, indices in groups.items():
                pool.submit(self._place_on, urls[engine_id], indices, chunks, on_batch)

    def _place_on(
        self,
        url: str,
        indices: Sequence[int],
        chunks: Sequence[TokenIds],
        on_batch: Callable[[Sequence[int]], None] | None,
    ) -> None:
        for batch in token_batches(indices, [len(chunks[i]) for i in indices], PLACE_BATCH_TOKENS):
            try:
                body = {"chunks": [list(chunks[i]) for i in batch]}
                self._client.post(f"{url}/precompute", json=body, timeout=PLACE_TIMEOUT_S).raise_for_status()
            except httpx.HTTPError as err:
                self._unplaced(len(batch), f"{url}/precompute: {type(err).__name__}: {err}")
            if on_batch is not None:
                on_batch(batch)

    def _unplaced(self, count: int, why: str) -> None:
        with self._lock:
            self.unplaced += count
        log.warning(
            "%d chunks' KV not computed on an engine at ingestion (%s): their first question computes it", count, why
        )

    def _why_none(self, exclude: Sequence[str]) -> str:
        if not self._engines:
            return "no engine known (KVSTITCH_ENGINES names none, or none announced itself in Redis)"
        parts = []
        for s in self._engines.values():
            name = s.engine_id or s.url
            if s.url in exclude:
                parts.append(f"{name}: tried")
            elif s.mismatch is not None:
                parts.append(f"{name}: key space differs ({', '.join(s.mismatch)})")
            elif s.failed:
                parts.append(f"{name}: unreachable")
            else:
                parts.append(f"{name}: not ready")
        return "no engine can take the question (" + "; ".join(parts) + ")"

    def readiness(self) -> tuple[bool, str]:
        """Whether any engine is routable, and a line naming each engine's state."""
        with self._lock:
            states = list(self._engines.values())
        ok = any(s.routable for s in states)
        parts = [f"{s.engine_id or s.url}: {_state(s)}" for s in states]
        known = {s.engine_id for s in states}
        parts += [f"{e}: mismatched key space" for e in self._view_mismatched() if e not in known]
        return ok, "; ".join(parts) or "no engine known"


def token_batches(indices: Sequence[int], lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """`indices` in order, cut into batches of at most `max_tokens` tokens (`lengths`: each index's); a chunk longer
    than that goes alone."""
    batches: list[list[int]] = []
    tokens = 0
    for index, length in zip(indices, lengths, strict=True):
        if not batches or tokens + length > max_tokens:
            batches.append([])
            tokens = 0
        batches[-1].append(index)
        tokens += length
    return batches


def _state(s: EngineState) -> str:
    if s.routable:
        return "routable"
    if s.mismatch:
        return "mismatched key space"
    return "unreachable" if s.failed else "not ready"


def _snapshot(state: EngineState) -> EngineState:
    """A copy a caller may read without the lock."""
    mismatch = None if state.mismatch is None else list(state.mismatch)
    return dataclasses.replace(state, mismatch=mismatch, reported=dict(state.reported))


def _key_space(fields: Any) -> KeySpace | None:
    """The key space an engine's /info names; None while it has none (loading) or for a malformed one."""
    return key_space_of({k: str(v) for k, v in fields.items()}) if isinstance(fields, dict) else None
