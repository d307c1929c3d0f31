"""Chunk-aware routing as a pure function: it follows the chunks, weighs tiers and load, and keeps the balance bound."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from service.fleet.routing import (
    DEFAULT_POLICY,
    LOAD_COST_TOKENS,
    TIER_WEIGHTS,
    ChunkRef,
    RouteReason,
    owner,
    round_robin,
    route,
)
from service.kvcache.tiers import Tier
from service.metrics import Metrics

CHUNKS = [ChunkRef(f"k{i}", 512) for i in range(4)]
G, H, D, M = Tier.GPU, Tier.HOST, Tier.DISK, Tier.MISS


def test_a_question_goes_to_the_engine_that_holds_its_chunks() -> None:
    placement = {"e0": [M, M, M, M], "e1": [G, G, G, G], "e2": [G, M, M, M]}

    decision = route(CHUNKS, placement, {"e0": 1, "e1": 1, "e2": 1})

    assert (decision.engine, decision.reason) == ("e1", RouteReason.COST)
    assert decision.cost == decision.best_cost == LOAD_COST_TOKENS
    assert decision.tiers == (G, G, G, G)


def test_faster_tiers_cost_less_and_an_engine_the_view_lacks_holds_nothing() -> None:
    loads = {"host": 0, "disk": 0, "unknown": 0}
    placement = {"host": [H, H, H, H], "disk": [D, D, D, D]}

    decision = route(CHUNKS, placement, loads)

    assert decision.engine == "host" and decision.cost == 4 * 512 * TIER_WEIGHTS[H]
    assert route(CHUNKS, {"disk": [D, D, D, D]}, {"disk": 0, "unknown": 0}).engine == "disk"


def test_between_equal_placements_the_less_loaded_engine_wins() -> None:
    placement = {"e0": [G, G, M, M], "e1": [G, G, M, M]}

    assert route(CHUNKS, placement, {"e0": 3, "e1": 2}).engine == "e1"
    assert route(CHUNKS, placement, {"e0": 2, "e1": 3}).engine == "e0"


def test_a_small_load_gap_does_not_outweigh_the_cache_but_an_unbalanced_fleet_goes_to_the_idlest() -> None:
    long_chunks = [ChunkRef(f"k{i}", 4096) for i in range(4)]  # what the hot engine saves outweighs its load
    placement = {"hot": [G, G, G, G], "cold": [M, M, M, M]}

    assert route(long_chunks, placement, {"hot": 5, "cold": 0}).engine == "hot"
    busy = DEFAULT_POLICY.balance_abs + 1
    decision = route(long_chunks, placement, {"hot": busy, "cold": 0})

    assert (decision.engine, decision.reason) == ("cold", RouteReason.BALANCE)
    assert decision.cost == 4 * 4096  # every chunk a miss there
    assert decision.best_cost == busy * LOAD_COST_TOKENS  # the hot engine's: all GPU hits, its load
    assert decision.cost > decision.best_cost
    assert route(long_chunks, placement, {"hot": busy, "cold": 1}).engine == "hot"  # 32 apart: within the bound


def test_the_chosen_engine_never_runs_more_than_the_bound_over_the_idlest() -> None:
    rng = random.Random(7)
    tiers = [G, H, D, M]
    for _ in range(500):
        engines = [f"e{i}" for i in range(rng.randint(1, 6))]
        loads = {e: rng.randint(0, 120) for e in engines}
        placement = {e: [rng.choice(tiers) for _ in CHUNKS] for e in engines}

        decision = route(CHUNKS, placement, loads)

        assert loads[decision.engine] - min(loads.values()) <= DEFAULT_POLICY.balance_abs
        assert decision.cost >= decision.best_cost


def test_questions_no_engine_holds_spread_evenly_and_stick_to_their_first_chunk() -> None:
    loads = {"e0": 0, "e1": 0, "e2": 0}
    questions = [[ChunkRef(f"q{n}", 300)] for n in range(600)]

    chosen = [route(q, {}, loads).engine for q in questions]

    assert chosen == [route(q, {}, loads).engine for q in questions]
    assert all(150 <= n <= 250 for n in Counter(chosen).values())


def test_no_engine_is_an_error() -> None:
    with pytest.raises(ValueError, match="no engine"):
        route(CHUNKS, {}, {})


def test_the_metrics_count_chunks_by_tier_and_decision_and_the_cost_chosen_against_the_best() -> None:
    metrics = Metrics()
    placement = {"hot": [G, G, H, M], "cold": [M, M, M, M]}
    metrics.observe_route(route(CHUNKS, placement, {"hot": 0, "cold": 0}))
    long_chunks = [ChunkRef(f"k{i}", 4096) for i in range(4)]
    metrics.observe_route(route(long_chunks, placement, {"hot": 40, "cold": 0}))  # unbalanced: to the cold engine

    def sample(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(name, labels)

    assert sample("kvstitch_route_chunks_total", reason="cost", tier="gpu") == 2
    assert sample("kvstitch_route_chunks_total", reason="cost", tier="host") == 1
    assert sample("kvstitch_route_chunks_total", reason="balance", tier="miss") == 4
    first = 512 * 0.05 + 512  # hot: a host hit and a miss, no load
    assert sample("kvstitch_route_cost_tokens_total", kind="chosen") == pytest.approx(first + 4 * 4096)
    hot_when_busy = 4096 * 0.05 + 4096 + 40 * LOAD_COST_TOKENS
    assert sample("kvstitch_route_cost_tokens_total", kind="best") == pytest.approx(first + hot_when_busy)


def test_round_robin_takes_the_engines_in_turn_whatever_they_hold() -> None:
    placement = {"e0": [M, M, M, M], "e1": [G, G, G, G]}
    loads = {"e1": 5, "e0": 0}

    decisions = [round_robin(CHUNKS, placement, loads, turn) for turn in range(4)]

    assert [d.engine for d in decisions] == ["e0", "e1", "e0", "e1"]
    assert {d.reason for d in decisions} == {RouteReason.ROUND_ROBIN}
    # The cost of ignoring the cache shows as chosen > best on the turns that miss the holder.
    assert decisions[0].tiers == (M, M, M, M) and decisions[1].tiers == (G, G, G, G)
    assert decisions[0].cost == 4 * 512 and decisions[0].best_cost == 5 * LOAD_COST_TOKENS


def test_a_chunk_belongs_to_the_engine_route_breaks_its_ties_toward() -> None:
    engines = ["e0", "e1", "e2"]
    for n in range(20):
        key = f"key-{n}"
        tie = route([ChunkRef(key, 100)], {}, dict.fromkeys(engines, 0))
        assert owner(key, engines) == tie.engine == owner(key, list(reversed(engines)))
    assert len({owner(f"key-{n}", engines) for n in range(20)}) == 3
