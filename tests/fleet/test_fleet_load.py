"""A gateway's load view of its engines counts other gateways' answers (from the engines' own counts at each probe),
so several gateway replicas over the same engines still balance them."""

from __future__ import annotations

import dataclasses
from typing import Any

import httpx
import pytest

from service.fleet.routing import BALANCE_ABS, BALANCE_REL, LOAD_COST_TOKENS, ChunkRef, route
from service.kvcache.keys import KeySpace
from service.kvcache.tiers import Tier
from service.serving.fleet_gateway import COUNT_SKEW, Fleet
from service.settings import Settings

SPACE = KeySpace(fingerprint="f" * 16, template_version="t1", dtype="bfloat16")
URLS = ("http://e0:8100", "http://e1:8100")


class Engines:
    """Two engines' /info as a mock transport: each reports the running and waiting counts it is given."""

    def __init__(self) -> None:
        self.counts = {url: {"running": 0, "waiting": 0} for url in URLS}

    def handler(self, request: httpx.Request) -> httpx.Response:
        url = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        space: dict[str, Any] = {**dataclasses.asdict(SPACE), "digest": SPACE.digest()}
        info = {"engine_id": url.split("//")[1].split(":")[0], "ready": True, "key_space": space, **self.counts[url]}
        return httpx.Response(200, json=info)


@pytest.fixture
def fleet_and_engines() -> tuple[Fleet, Engines]:
    engines = Engines()
    settings = Settings(engines=",".join(URLS), fleet_routing="chunk-aware")
    fleet = Fleet(settings, SPACE)
    fleet._client = httpx.Client(transport=httpx.MockTransport(engines.handler))
    fleet.probe()
    return fleet, engines


def chunk(key: str) -> list[ChunkRef]:
    return [ChunkRef(key, 64)]


def test_an_engine_busy_with_another_gateways_answers_is_loaded_in_this_ones_view(
    fleet_and_engines: tuple[Fleet, Engines],
) -> None:
    fleet, engines = fleet_and_engines
    engines.counts[URLS[0]] = {"running": 30, "waiting": 6}  # another gateway's answers
    fleet.probe()

    loads = {s.engine_id: s.load for s in fleet.engines()}
    assert loads == {"e0": 36 - COUNT_SKEW, "e1": 0}
    chosen = {fleet.choose(chunk(f"k{i}")).url for i in range(8)}
    assert chosen == {URLS[1]}  # the bound sends every new question to the idle engine


def test_this_gateways_own_answers_are_not_counted_twice(fleet_and_engines: tuple[Fleet, Engines]) -> None:
    fleet, engines = fleet_and_engines
    routed = [fleet.choose(chunk(f"k{i}")) for i in range(6)]
    mine = {url: sum(r.url == url for r in routed) for url in URLS}
    for url in URLS:  # the engines report exactly this gateway's answers
        engines.counts[url] = {"running": mine[url], "waiting": 0}
    fleet.probe()

    states = {s.url: s for s in fleet.engines()}
    assert all(states[url].others == 0 and states[url].load == mine[url] for url in URLS)
    for r in routed:
        fleet.finished(r.url)
    assert all(s.load == 0 for s in fleet.engines())  # until the next probe says otherwise


def test_a_difference_of_one_answer_is_skew_not_another_gateways_load(fleet_and_engines: tuple[Fleet, Engines]) -> None:
    fleet, engines = fleet_and_engines
    routed = fleet.choose(chunk("k0"))
    engines.counts[routed.url] = {"running": 1, "waiting": 1}  # e.g. a running shadow beside this gateway's answer
    fleet.probe()
    assert {s.url: s.load for s in fleet.engines()}[routed.url] == 1


@pytest.mark.parametrize("weight", [0.0, 256.0, 40.0])
def test_the_load_weight_of_routing_is_a_setting(weight: float) -> None:
    """KVSTITCH_FLEET_LOAD_COST_TOKENS reaches the policy: at 0 a question goes where its chunks are, however
    loaded that engine is; at the default a few running answers outweigh a question's host-to-GPU difference."""
    settings = Settings(engines=",".join(URLS), fleet_routing="chunk-aware", fleet_load_cost_tokens=weight)
    policy = Fleet(settings, SPACE).policy
    assert policy.load_cost_tokens == weight
    chunks = [ChunkRef(f"c{i}", 500) for i in range(4)]
    placement = {"e0": [Tier.GPU] * 4, "e1": [Tier.HOST] * 4}  # e0 saves 4 x 500 x 0.05 = 100 tokens of work
    chosen = route(chunks, placement, {"e0": 3, "e1": 2}, policy).engine
    assert chosen == ("e0" if weight < 100.0 else "e1")


def test_the_settings_defaults_are_the_routing_policys() -> None:
    """The settings keep their own literals (they import no torch, the routing module's tiers do): the two must not
    drift apart, or a gateway would route differently from the policy the docs and tests describe."""
    settings = Settings()
    assert settings.fleet_load_cost_tokens == LOAD_COST_TOKENS
    assert (settings.fleet_balance_abs, settings.fleet_balance_rel) == (BALANCE_ABS, BALANCE_REL)
