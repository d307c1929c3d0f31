"""Which engine a question goes to: the one that would do the least work to bring its chunks' KV in, unless that
would leave the fleet unbalanced.

Cost of an engine = sum over the question's chunks of tokens x the weight of the tier that engine holds the chunk in
(GPU ~0, host small, disk larger, miss = the full precompute) + its running requests x `load_cost_tokens`. Chunks are
matched by their keys wherever they sit in the prompt, not by prefix: a chunk reused at another position is still a
hit, which prefix-hash routers (llm-d, Dynamo, SGLang) cannot see.

The balance rule is SGLang's cache-aware router's: when the busiest engine runs more than `balance_abs` requests over
the idlest and more than `balance_rel` times as many, the question goes to the least loaded engine, whatever the
cache says. Either way the chosen engine runs at most `balance_abs` more requests than the idlest one.

Ties (a question no engine holds anything of, on engines equally loaded) go by rendezvous hashing of the question's
first chunk key: the same chunks land on the same engine, so the next question over them finds them warm.

`RoutingMode.ROUND_ROBIN` ignores cache and load and takes the engines in turn: the baseline chunk-aware routing is
measured against (`KVSTITCH_FLEET_ROUTING=round-robin`), and what a plain Kubernetes Service would do.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType

from service.kvcache.tiers import Tier

# Token weights: the time to bring one token's KV from that tier onto the GPU, relative to computing it. A GPU hit
# costs nothing (the stitch is the same work on every engine); a pinned host copy runs at PCIe bandwidth, far faster
# than a forward; a disk read runs at the drive's bandwidth, which cold is close to a recompute and warm (page cache)
# a fraction of one; a miss is the whole precompute. docs/benchmarks.md section 4 has the measured fetch times the
# ratios follow.
TIER_WEIGHTS: Mapping[Tier, float] = MappingProxyType({Tier.GPU: 0.0, Tier.HOST: 0.05, Tier.DISK: 0.5, Tier.MISS: 1.0})
# One running request weighs as much as computing this many tokens: enough that between engines holding the same
# chunks the idler one wins, small enough that residency decides most questions. With four gateways each routing
# on a view probed every half second, a heavier weight herds (every gateway sends its questions to the engine that
# looked idle): 256 gave back the hit gain and a higher p99 against round-robin, 64 won on both (benchmarks §16.5).
LOAD_COST_TOKENS = 64.0
# SGLang's router defaults: unbalanced when the busiest engine runs 32 requests more than the idlest and 1.5 times as
# many; then the least loaded engine takes the question.
BALANCE_ABS = 32
BALANCE_REL = 1.5


class RouteReason(StrEnum):
    COST = "cost"  # the cheapest engine
    BALANCE = "balance"  # the fleet was unbalanced: the least loaded engine
    ROUND_ROBIN = "round-robin"  # the next engine in turn (round-robin mode)


class RoutingMode(StrEnum):
    CHUNK_AWARE = "chunk-aware"
    ROUND_ROBIN = "round-robin"


@dataclass(frozen=True)
class ChunkRef:
    """A question's chunk as routing sees it: its block key and token count."""

    key: str
    tokens: int


@dataclass(frozen=True)
class RoutingPolicy:
    tier_weights: Mapping[Tier, float] = field(default_factory=lambda: TIER_WEIGHTS)
    load_cost_tokens: float = LOAD_COST_TOKENS
    balance_abs: int = BALANCE_ABS
    balance_rel: float = BALANCE_REL
    mode: RoutingMode = RoutingMode.CHUNK_AWARE


DEFAULT_POLICY = RoutingPolicy()


@dataclass(frozen=True)
class RouteDecision:
    """The engine chosen, why, its cost and the lowest cost any engine had (equal unless balance overrode the cost),
    and the tier the chosen engine holds each chunk in (for hit ratios by decision)."""

    engine: str
    reason: RouteReason
    cost: float
    best_cost: float
    tiers: tuple[Tier, ...]


def engine_cost(chunks: Sequence[ChunkRef], tiers: Sequence[Tier], load: int, policy: RoutingPolicy) -> float:
    """Tokens of work the engine would do for this question, in precompute-token equivalents, plus its load."""
    weights = policy.tier_weights
    kv = sum(chunk.tokens * weights[tier] for chunk, tier in zip(chunks, tiers, strict=True))
    return kv + load * policy.load_cost_tokens


def unbalanced(loads: Mapping[str, int], policy: RoutingPolicy) -> bool:
    busiest, idlest = max(loads.values()), min(loads.values())
    return busiest - idlest > policy.balance_abs and busiest > policy.balance_rel * idlest


def route(
    chunks: Sequence[ChunkRef],
    placement: Mapping[str, Sequence[Tier]],
    loads: Mapping[str, int],
    policy: RoutingPolicy = DEFAULT_POLICY,
) -> RouteDecision:
    """Pick the engine for a question over `chunks`. `loads` names the engines that may take it (running requests
    each); `placement` gives, per engine, the tier of each chunk (`PlacementView.tiers`); an engine it does not
    list holds nothing."""
    if not loads:
        raise ValueError("no engine to route to")
    misses = (Tier.MISS,) * len(chunks)
    tiers = {e: tuple(placement.get(e, misses)) for e in loads}
    costs = {e: engine_cost(chunks, tiers[e], loads[e], policy) for e in loads}
    first = chunks[0].key if chunks else ""
    best = min(loads, key=lambda e: (costs[e], loads[e], _rendezvous(first, e)))
    if unbalanced(loads, policy):
        chosen = min(loads, key=lambda e: (loads[e], costs[e], _rendezvous(first, e)))
        return RouteDecision(chosen, RouteReason.BALANCE, costs[chosen], costs[best], tiers[chosen])
    return RouteDecision(best, RouteReason.COST, costs[best], costs[best], tiers[best])


def round_robin(
    chunks: Sequence[ChunkRef],
    placement: Mapping[str, Sequence[Tier]],
    loads: Mapping[str, int],
    turn: int,
    policy: RoutingPolicy = DEFAULT_POLICY,
) -> RouteDecision:
    """The `turn`-th engine of `loads` in id order (modulo their number), whatever it holds; its cost and the
    cheapest engine's are reported as `route` reports them, so the metrics show what ignoring the cache cost."""
    if not loads:
        raise ValueError("no engine to route to")
    engines = sorted(loads)
    chosen = engines[turn % len(engines)]
    misses = (Tier.MISS,) * len(chunks)
    tiers = {e: tuple(placement.get(e, misses)) for e in engines}
    costs = {e: engine_cost(chunks, tiers[e], loads[e], policy) for e in engines}
    return RouteDecision(chosen, RouteReason.ROUND_ROBIN, costs[chosen], min(costs.values()), tiers[chosen])


def owner(key: str, engines: Sequence[str]) -> str:
    """The engine a chunk with no other placement belongs to: the one `route` breaks ties toward for a question
    whose first chunk it is (rendezvous hashing, so adding an engine moves only the chunks it wins)."""
    if not engines:
        raise ValueError("no engine to place on")
    return min(engines, key=lambda e: _rendezvous(key, e))


def _rendezvous(key: str, engine: str) -> bytes:
    """An engine's rank for a question's first chunk key, stable across processes (never Python's `hash`)."""
    return hashlib.blake2b(f"{key}/{engine}".encode(), digest_size=8).digest()
