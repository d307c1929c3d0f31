"""Routing simulated on a trace: chunk-aware (`service.fleet.routing.route`) against round-robin and random.

N engines each keep a GPU tier of C chunks (LRU). A trace of questions, each over k distinct chunks drawn by Zipf
popularity (exponent 1.1) from a corpus of M chunks, arrives at a fixed rate; every policy routes the same trace.
A question runs on its engine for a decode time plus the time to precompute its missed tokens (engines batch, so
load is the number of questions running there); after it, its chunks are the engine's most recently used. The
GPU tier is the only cache: a chunk not on the chosen engine's GPU is a miss. What is reported per policy:

- GPU hit ratio (tokens) over the trace;
- load imbalance: the busiest engine's share of the questions against an even share (1.0 = even), and the mean gap
  between the most and least loaded engine's running questions at each arrival;
- mean KV cost per question (precompute-token equivalents, `routing.TIER_WEIGHTS`), and for chunk-aware routing
  how often balance overrode the cost and the cost chosen against the best.

    python -m loadtest.sim_routing --engines 4 --gpu-chunks 400 --questions 20000 --seed 0 --json sim.json

Deterministic for a seed: the trace comes from `random.Random(seed)`, round-robin and chunk-aware routing use no
randomness, random routing its own `Random(seed + 1)`. `--write-trace` saves the trace (JSON lines, one question's
chunk ids each) and `--trace` replays one, so a trace recorded elsewhere can be routed too.
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import itertools
import json
import random
import sys
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Generic, TypeVar

from service.fleet.routing import DEFAULT_POLICY, TIER_WEIGHTS, ChunkRef, RouteReason, RoutingPolicy, route
from service.kvcache.tiers import Tier

POLICIES = ("chunk-aware", "round-robin", "random")
ZIPF_EXPONENT = 1.1
# A question's time on its engine: decoding its answer (seconds), plus its missed tokens at the precompute rate.
DECODE_S = 2.0
PRECOMPUTE_TOKENS_PER_S = 40_000.0
CHUNK_TOKENS = (256, 512)  # chunk lengths are drawn uniformly from this range
T = TypeVar("T")


@dataclass(frozen=True)
class Trace:
    questions: list[list[int]]  # chunk ids per question
    tokens: list[int]  # token count per chunk id


@dataclass
class Engine:
    capacity: int
    gpu: OrderedDict[int, None] = field(default_factory=OrderedDict)
    ends: list[float] = field(default_factory=list)  # heap of running questions' end times

    def tier(self, chunk: int) -> Tier:
        return Tier.GPU if chunk in self.gpu else Tier.MISS

    def running(self, now: float) -> int:
        while self.ends and self.ends[0] <= now:
            heapq.heappop(self.ends)
        return len(self.ends)

    def serve(self, chunks: Sequence[int], now: float, duration: float) -> None:
        for chunk in chunks:  # fetched: hits refreshed, misses computed and kept, the least recent evicted
            self.gpu[chunk] = None
            self.gpu.move_to_end(chunk)
            if len(self.gpu) > self.capacity:
                self.gpu.popitem(last=False)
        heapq.heappush(self.ends, now + duration)


@dataclass(frozen=True)
class PolicyReport:
    policy: str
    gpu_hit_ratio: float
    question_imbalance: float
    mean_running_gap: float
    mean_kv_cost: float
    balance_share: float
    cost_over_best: float


def zipf_trace(corpus: int, per_question: int, questions: int, seed: int, doc_chunks: int = 0) -> Trace:
    """Questions over `per_question` distinct chunks each, drawn with weight 1 / rank ** 1.1 (ranks: a seeded
    permutation). With `doc_chunks`, the corpus is documents of that many chunks: a question picks a document by that
    popularity, then its chunks within the document the same way (questions about one document share chunks)."""
    rng = random.Random(seed)
    tokens = [rng.randint(*CHUNK_TOKENS) for _ in range(corpus)]
    if doc_chunks <= 0:
        everything = _ZipfDraw(rng, list(range(corpus)))
        return Trace([everything.distinct(per_question) for _ in range(questions)], tokens)
    if doc_chunks < per_question:
        raise ValueError("a document needs at least --top-k chunks")
    starts = range(0, corpus - doc_chunks + 1, doc_chunks)
    documents = _ZipfDraw(rng, [_ZipfDraw(rng, list(range(s, s + doc_chunks))) for s in starts])
    return Trace([documents.one().distinct(per_question) for _ in range(questions)], tokens)


class _ZipfDraw(Generic[T]):
    """Draws from `items` by Zipf popularity over a seeded random ranking of them."""

    def __init__(self, rng: random.Random, items: list[T]) -> None:
        self.rng = rng
        self.by_rank = items[:]
        rng.shuffle(self.by_rank)
        weights = (1.0 / (rank + 1) ** ZIPF_EXPONENT for rank in range(len(items)))
        self.cumulative = list(itertools.accumulate(weights))

    def one(self) -> T:
        rank = bisect.bisect_left(self.cumulative, self.rng.random() * self.cumulative[-1])
        return self.by_rank[min(rank, len(self.by_rank) - 1)]

    def distinct(self, n: int) -> list[T]:
        picked: dict[T, None] = {}
        while len(picked) < n:
            picked[self.one()] = None
        return list(picked)


@dataclass
class GatewayView:
    """What one of several gateways knows of the engines' loads, as `fleet_gateway.Fleet` does: the questions it
    sent itself (end times per engine, exact) plus the others' as of its last probe, every `probe_s` seconds."""

    probe_s: float
    next_probe: float
    own: dict[str, list[float]] = field(default_factory=dict)
    others: dict[str, int] = field(default_factory=dict)

    def loads(self, now: float, fleet: dict[str, Engine]) -> dict[str, int]:
        for ends in self.own.values():
            while ends and ends[0] <= now:
                heapq.heappop(ends)
        mine = {name: len(self.own.get(name, [])) for name in fleet}
        if now >= self.next_probe:
            self.others = {name: max(0, engine.running(now) - mine[name]) for name, engine in fleet.items()}
            while self.next_probe <= now:
                self.next_probe += self.probe_s
        return {name: mine[name] + self.others.get(name, 0) for name in fleet}

    def sent(self, name: str, end: float) -> None:
        heapq.heappush(self.own.setdefault(name, []), end)


def simulate(
    trace: Trace,
    policy: str,
    engines: int,
    gpu_chunks: int,
    rate: float,
    seed: int,
    routing: RoutingPolicy = DEFAULT_POLICY,
    gateways: int = 1,
    probe_s: float = 0.5,
) -> PolicyReport:
    """Route the whole trace with one policy (`routing` configures chunk-aware routing); questions arrive every
    1 / `rate` seconds. With several `gateways` question n goes through gateway n mod G, which routes by its own
    `GatewayView` of the loads (a lone gateway's view is exact: every open question is its own) and, round-robin,
    by its own turn."""
    fleet = {f"e{i}": Engine(gpu_chunks) for i in range(engines)}
    picks = [_picker(policy, list(fleet), seed + g, routing) for g in range(gateways)]
    views = [GatewayView(probe_s, next_probe=g * probe_s / gateways) for g in range(gateways)]
    hit = total = 0
    cost = gap = 0.0
    counts: Counter[str] = Counter()
    balanced = 0
    chosen_cost = best_cost = 0.0
    for n, chunks in enumerate(trace.questions):
        now = n / rate
        loads = {name: engine.running(now) for name, engine in fleet.items()}
        gap += max(loads.values()) - min(loads.values())
        refs = [ChunkRef(str(c), trace.tokens[c]) for c in chunks]
        placement = {name: [engine.tier(c) for c in chunks] for name, engine in fleet.items()}
        gateway = n % gateways
        name, reason, costs = picks[gateway](refs, placement, views[gateway].loads(now, fleet))
        balanced += reason is RouteReason.BALANCE
        chosen_cost, best_cost = chosen_cost + costs[0], best_cost + costs[1]
        tiers = placement[name]
        hit_tokens = sum(r.tokens for r, t in zip(refs, tiers, strict=True) if t is Tier.GPU)
        all_tokens = sum(r.tokens for r in refs)
        hit, total = hit + hit_tokens, total + all_tokens
        cost += sum(r.tokens * TIER_WEIGHTS[t] for r, t in zip(refs, tiers, strict=True))
        counts[name] += 1
        duration = DECODE_S + (all_tokens - hit_tokens) / PRECOMPUTE_TOKENS_PER_S
        fleet[name].serve(chunks, now, duration)
        views[gateway].sent(name, now + duration)
    q = len(trace.questions)
    return PolicyReport(
        policy=policy,
        gpu_hit_ratio=hit / total,
        question_imbalance=max(counts.values()) / (q / engines),
        mean_running_gap=gap / q,
        mean_kv_cost=cost / q,
        balance_share=balanced / q,
        cost_over_best=chosen_cost / best_cost if best_cost else 1.0,
    )


# (chunks, per-engine tiers, loads) -> (engine, reason, (cost chosen, best cost) summed over the KV and load terms)
Picker = Callable[[list[ChunkRef], dict[str, list[Tier]], dict[str, int]], tuple[str, RouteReason, tuple[float, float]]]


def _picker(policy: str, names: list[str], seed: int, routing: RoutingPolicy) -> Picker:
    if policy == "chunk-aware":

        def chunk_aware(
            refs: list[ChunkRef], placement: dict[str, list[Tier]], loads: dict[str, int]
        ) -> tuple[str, RouteReason, tuple[float, float]]:
            decision = route(refs, placement, loads, routing)
            return decision.engine, decision.reason, (decision.cost, decision.best_cost)

        return chunk_aware
    if policy == "round-robin":
        turn = itertools.cycle(names)
        return lambda refs, placement, loads: (next(turn), RouteReason.COST, (0.0, 0.0))
    if policy == "random":
        rng = random.Random(seed + 1)
        return lambda refs, placement, loads: (rng.choice(names), RouteReason.COST, (0.0, 0.0))
    raise ValueError(f"unknown policy {policy!r}; one of {', '.join(POLICIES)}")


def read_trace(path: Path, seed: int) -> Trace:
    """A trace of JSON lines (one list of chunk ids per question); chunk lengths drawn from `seed`."""
    questions = [list(map(int, json.loads(line))) for line in path.read_text().splitlines() if line.strip()]
    rng = random.Random(seed)
    corpus = 1 + max(c for q in questions for c in q)
    return Trace(questions, [rng.randint(*CHUNK_TOKENS) for _ in range(corpus)])


def table(reports: Sequence[PolicyReport]) -> str:
    head = (
        "| policy | GPU hit ratio (tokens) | busiest engine / even share | mean running gap | mean KV cost (tokens) |"
    )
    head += " balance overrides | cost chosen / best |\n|---|---|---|---|---|---|---|"
    rows = [
        f"| {r.policy} | {r.gpu_hit_ratio:.3f} | {r.question_imbalance:.3f} | {r.mean_running_gap:.2f} | "
        f"{r.mean_kv_cost:,.0f} | {r.balance_share:.3f} | {r.cost_over_best:.3f} |"
        for r in reports
    ]
    return "\n".join([head, *rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--gpu-chunks", type=int, default=400, help="chunks one engine's GPU tier holds")
    parser.add_argument("--corpus", type=int, default=4000, help="chunks in the corpus")
    parser.add_argument("--top-k", type=int, default=16, help="chunks per question")
    parser.add_argument(
        "--doc-chunks", type=int, default=0, help="documents of this many chunks: a question's chunks from one (0: off)"
    )
    parser.add_argument("--questions", type=int, default=20_000)
    parser.add_argument("--rate", type=float, default=None, help="questions/s; default 8 running per engine")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--load-cost-tokens", type=float, default=DEFAULT_POLICY.load_cost_tokens)
    parser.add_argument("--balance-abs", type=int, default=DEFAULT_POLICY.balance_abs)
    parser.add_argument("--balance-rel", type=float, default=DEFAULT_POLICY.balance_rel)
    parser.add_argument("--gateways", type=int, default=1, help="gateways routing in turn, each by its own view")
    parser.add_argument("--probe-s", type=float, default=0.5, help="how often a gateway reads the others' loads")
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    parser.add_argument("--trace", type=Path, help="replay this trace (JSON lines of chunk ids)")
    parser.add_argument("--write-trace", type=Path, help="save the generated trace here")
    parser.add_argument("--json", type=Path, help="write the reports here")
    args = parser.parse_args(argv)
    if args.trace is not None:
        trace = read_trace(args.trace, args.seed)
    else:
        trace = zipf_trace(args.corpus, args.top_k, args.questions, args.seed, args.doc_chunks)
    if args.write_trace is not None:
        args.write_trace.write_text("".join(json.dumps(q) + "\n" for q in trace.questions))
    rate = args.rate if args.rate is not None else args.engines * 8 / DECODE_S
    routing = RoutingPolicy(
        load_cost_tokens=args.load_cost_tokens, balance_abs=args.balance_abs, balance_rel=args.balance_rel
    )
    if args.gateways < 1 or args.probe_s <= 0:
        parser.error("--gateways must be at least 1 and --probe-s positive")
    reports = [
        simulate(trace, p, args.engines, args.gpu_chunks, rate, args.seed, routing, args.gateways, args.probe_s)
        for p in args.policies
    ]
    sys.stdout.write(table(reports) + "\n")
    if args.json is not None:
        settings = {k: v for k, v in vars(args).items() if k not in ("json", "trace", "write_trace", "policies")}
        args.json.write_text(json.dumps({"settings": settings, "reports": [asdict(r) for r in reports]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
