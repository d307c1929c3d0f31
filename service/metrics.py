"""Every Prometheus metric of kvstitch, in one registry per process (one per app in tests).

Names are part of the contract with the Grafana dashboard in deploy/grafana/ (tests/test_deploy_grafana.py checks
that every query names a metric defined here): change them only together.

Processes: each gateway has one engine process (uvicorn runs one worker; the engine thread and its line live in
it), and each `kvstitch worker` exposes its own registry on `KVSTITCH_WORKER_METRICS_PORT`. Prometheus scrapes
every process as its own target and sums across them, so prometheus-client's multiprocess mode is not needed;
running the gateway under several uvicorn workers would need it (and would split the engine's line), so don't.

Tier usage, hits and corrupt files are read from the KV store at scrape time, and the queue depth and ingest
backlog from their owners, so none of them can drift from the source.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from service.engine.arena_stats import ArenaStats
from service.fleet.placement import PlacementStats
from service.fleet.routing import RouteDecision, RouteReason
from service.kvcache.shared import LATENCY_BUCKETS, SharedStats
from service.kvcache.store import StoreStats
from service.kvcache.tiers import Tier
from service.retrieval.batcher import RetrievalStats
from service.serving.gc_pauses import PAUSE_BUCKETS, GcPauses

log = logging.getLogger(__name__)

# TTFT is the headline figure: fine buckets where the stitched path lives (ms), coarse ones for naive/cold.
TTFT_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
STAGE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 30.0)
# Per-token decode time: a 7B model on one GPU decodes in ~10-30 ms, a tiny CPU model in ~1-5 ms.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
TPOT_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0)
# `queue` is the wait for the engine; `precompute` is KV computed online for misses; `recompute` the part of the
# stitched context recomputed before the question (all part of TTFT).
STAGES = (
    "retrieve",
    "queue",
    "engine_wait",
    "load",
    "h2d",
    "precompute",
    "stitch",
    "recompute",
    "prefill",
    "decode",
    "transport",
    "relay_in",
    "relay_out",
)
# KL(naive || turbo) of the first-token distribution, in nats: ~1e-6 is rounding, ~0.1 a visible shift, > 1 another
# answer.
KL_BUCKETS = (1e-6, 1e-5, 1e-4, 1e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0)
# What became of the shadow of a turbo answer picked for one (service/serving/shadow.py): compared, dropped (the
# shadows' queue was full), preempted (a request needed its place), failed.
SHADOW_OUTCOMES = ("compared", "dropped", "preempted", "failed")
SHADOW_KINDS = ("first_token", "answer")
# `submitted` at POST /ingest; the others as a worker's delivery ends (`retry`: failed, will be delivered again).
INGEST_STATUSES = ("submitted", "done", "failed", "retry")


class EngineFigures(Protocol):
    """What the fleet metrics read of one engine (`service.serving.fleet_gateway.FleetEngineFigures`)."""

    @property
    def running(self) -> int: ...

    @property
    def routable(self) -> bool: ...

    @property
    def mismatched(self) -> bool: ...


class ChunkCounts(Protocol):
    """What the ingest metrics read from a finished job's counts (workers.ingest.IngestCounts)."""

    @property
    def chunks_precomputed(self) -> int: ...

    @property
    def chunks_reused(self) -> int: ...


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvstitch_requests", "HTTP requests answered", ["route", "status"], registry=r)
        self.ttft = Histogram(
            "kvstitch_ttft_seconds", "Time to first token, request arrival to first token", ["mode", "positions"],
            buckets=TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        self.stage = Histogram(
            "kvstitch_stage_seconds", "Time per stage of a request", ["stage"], buckets=STAGE_BUCKETS, registry=r
        )
        self.kv_blocks = Counter(
            "kvstitch_kv_blocks", "Chunk KV blocks served to requests, by tier (miss = computed)", ["tier"], registry=r
        )
        self.kv_bytes_loaded = Counter(
            "kvstitch_kv_bytes_loaded", "Bytes of chunk KV served to requests, by tier", ["tier"], registry=r
        )
        self.output_tokens = Counter("kvstitch_output_tokens", "Tokens generated", ["mode"], registry=r)
        self.time_per_output_token = Histogram(
            "kvstitch_time_per_output_token_seconds", "Decode time per token after the first", ["mode"],
            buckets=TPOT_BUCKETS, registry=r,
        )  # fmt: skip
        self.rejected = Counter("kvstitch_rejected_requests", "Requests refused with 503", ["reason"], registry=r)
        self.disconnects = Counter("kvstitch_client_disconnects", "Streams stopped by the client", registry=r)
        self.queue_depth = Gauge("kvstitch_queue_depth", "Requests waiting for the engine", registry=r)
        self.running_requests = Gauge(
            "kvstitch_running_requests", "Answers decoding in the current batch (admitted into the KV pool)", registry=r
        )
        self.batch_size = Histogram(
            "kvstitch_batch_size", "Answers in each batched decode step", buckets=BATCH_BUCKETS, registry=r
        )
        self.kv_pool_bytes = Gauge(
            "kvstitch_kv_pool_bytes", "KV pool of running answers: bytes used and the budget", ["kind"], registry=r
        )
        # Admission reserves a whole answer's slots, so a running answer never needs more memory and none is ever
        # preempted: this stays 0, exported so dashboards and alerts hold should that policy change.
        self.preemptions = Counter(
            "kvstitch_preemptions", "Running answers preempted to free KV pool memory", registry=r
        )
        self.recompute_requests = Counter(
            "kvstitch_recompute_requests", "Turbo answers by recompute policy (none, prefix, selective, query, auto)",
            ["policy"], registry=r,
        )  # fmt: skip
        self.recompute_triggered = Counter(
            "kvstitch_recompute_triggered", "Turbo answers that recomputed any context token, by policy",
            ["policy"], registry=r,
        )  # fmt: skip
        # The share of answers whose recompute ran (since start): `auto`'s trigger rate, the figure its threshold
        # trades against TTFT. The two counters give it over any window.
        self.recompute_trigger_rate = Gauge(
            "kvstitch_recompute_trigger_rate", "Share of turbo answers that recomputed, by policy (since start)",
            ["policy"], registry=r,
        )  # fmt: skip
        self.recomputed_tokens = Counter(
            "kvstitch_recomputed_tokens", "Context tokens recomputed after the stitch", registry=r
        )
        self._recomputes: dict[str, tuple[int, int]] = {}  # policy -> (answers, answers that recomputed)
        self.ready = Gauge("kvstitch_ready", "1 when /readyz answers 200", registry=r)
        self.gate_diff = Gauge(
            "kvstitch_gate_max_abs_logit_diff", "Largest logit difference of the startup gate", registry=r
        )
        self.gate_zero_copy_diff = Gauge(
            "kvstitch_gate_zero_copy_max_abs_logit_diff",
            "Largest logit difference of the startup gate's zero-copy (shared chunk) cases, where checked",
            registry=r,
        )
        # One series at 1: the path chosen at start and why (on, off, device, triton, head_dim, gate).
        self.kv_path = Gauge(
            "kvstitch_kv_path", "KV path serving turbo answers, chosen at start (1 on the chosen mode and reason)",
            ["mode", "reason"], registry=r,
        )  # fmt: skip
        # Agreement as counters of comparisons by outcome (agreed, differed), not a gauge of a running mean: a rate
        # over any window is then agreed / all, it sums across gateways, and no comparison is lost between scrapes.
        self.shadow_agreement = Counter(
            "kvstitch_shadow_agreement", "Turbo answers compared with their naive shadow, by outcome: agreed, differed",
            ["positions", "recompute", "kind", "outcome"], registry=r,
        )  # fmt: skip
        self.shadow_kl = Histogram(
            "kvstitch_shadow_kl", "KL(naive || turbo) of the first-token distribution of sampled answers (nats)",
            ["positions", "recompute", "kind"], buckets=KL_BUCKETS, registry=r,
        )  # fmt: skip
        self.shadow_answers = Counter(
            "kvstitch_shadow_answers", "Shadow answers (a share of turbo answers run again naive), by outcome",
            ["outcome"], registry=r,
        )  # fmt: skip
        self.shadow_pending = Gauge("kvstitch_shadow_pending", "Shadow answers queued or running", registry=r)
        self.ingest_jobs = Counter("kvstitch_ingest_jobs", "Ingest jobs by outcome", ["status"], registry=r)
        self.kv_blocks_swept = Counter(
            "kvstitch_kv_blocks_swept", "KV blocks the start-up sweep released: no point named them", registry=r
        )
        self.ingest_chunks = Counter(
            "kvstitch_ingest_chunks", "Chunks ingested, by whether their KV was computed or reused", ["kv"], registry=r
        )
        self.ingest_pending = Gauge(
            "kvstitch_ingest_pending", "Ingest jobs queued or running, not yet acked (stream backlog)", registry=r
        )
        self.route_chunks = Counter(
            "kvstitch_route_chunks",
            "Chunks of routed questions by the tier the chosen engine held them in, and why it was chosen (cost, "
            "balance or round-robin)",
            ["reason", "tier"],
            registry=r,
        )
        self.route_cost = Counter(
            "kvstitch_route_cost_tokens",
            "Routing cost (precompute-token equivalents) of the chosen engine and of the cheapest one: their ratio is "
            "what balancing cost",
            ["kind"],
            registry=r,
        )
        self.fleet_reroutes = Counter(
            "kvstitch_fleet_reroutes",
            "Questions sent to another engine because the one routed to refused them (busy) or failed before the "
            "answer's first token",
            registry=r,
        )
        # Every label value shows from the start (at 0), so rates and ratios exist before the first event.
        for status in INGEST_STATUSES:
            self.ingest_jobs.labels(status)
        for kv in ("precomputed", "reused"):
            self.ingest_chunks.labels(kv)
        for outcome in SHADOW_OUTCOMES:
            self.shadow_answers.labels(outcome)
        for reason in RouteReason:
            for tier in Tier:
                self.route_chunks.labels(reason.value, tier.value)
        for kind in ("chosen", "best"):
            self.route_cost.labels(kind)

    # ---- answers --------------------------------------------------------------------------------------------

    def observe_answer(
        self,
        mode: str,
        positions: str,
        ttft_ms: float,
        timings_ms: dict[str, float],
        kv: dict[str, int],
        kv_bytes: dict[str, int],
        output_tokens: int,
        recompute: str = "none",
        recomputed_tokens: int = 0,
    ) -> None:
        self.ttft.labels(mode, positions).observe(ttft_ms / 1e3)
        if mode == "turbo":
            self._observe_recompute(recompute.partition(":")[0], recomputed_tokens)
        for stage, ms in timings_ms.items():
            if stage in STAGES:
                self.stage.labels(stage).observe(ms / 1e3)
        for tier, n in kv.items():
            if n:
                self.kv_blocks.labels(tier).inc(n)
        for tier, n in kv_bytes.items():
            if n:
                self.kv_bytes_loaded.labels(tier).inc(n)
        self.output_tokens.labels(mode).inc(output_tokens)
        # Decode time covers the tokens after the first (the first one is TTFT); one token has no decode rate.
        if output_tokens > 1:
            self.time_per_output_token.labels(mode).observe(timings_ms.get("decode", 0.0) / 1e3 / (output_tokens - 1))

    def _observe_recompute(self, policy: str, tokens: int) -> None:
        self.recompute_requests.labels(policy).inc()
        if tokens:
            self.recompute_triggered.labels(policy).inc()
            self.recomputed_tokens.inc(tokens)
        runs, triggered = self._recomputes.get(policy, (0, 0))
        runs, triggered = runs + 1, triggered + (tokens > 0)
        self._recomputes[policy] = (runs, triggered)
        self.recompute_trigger_rate.labels(policy).set(triggered / runs)

    # ---- shadow answers -------------------------------------------------------------------------------------

    def observe_shadow(self, positions: str, recompute: str, agreed: dict[str, bool | None], kl: float | None) -> None:
        """One compared shadow: agreement by kind (first_token, answer; None: not compared) and the KL where
        one was computed (kind first_token: the first-token distribution)."""
        for kind, same in agreed.items():
            if same is not None:
                self.shadow_agreement.labels(positions, recompute, kind, "agreed" if same else "differed").inc()
        if kl is not None:
            self.shadow_kl.labels(positions, recompute, "first_token").observe(kl)

    # ---- routing (a gateway in front of several engines) ----------------------------------------------------

    def observe_route(self, decision: RouteDecision) -> None:
        for tier in decision.tiers:
            self.route_chunks.labels(decision.reason.value, tier.value).inc()
        self.route_cost.labels("chosen").inc(decision.cost)
        self.route_cost.labels("best").inc(decision.best_cost)

    # ---- ingestion ------------------------------------------------------------------------------------------

    def ingest_finished(self, status: str, counts: ChunkCounts | None) -> None:
        """`IngestWorker.on_job_finished`: one delivery ended with `status` (done, failed, retry, cancelled)."""
        self.ingest_jobs.labels(status).inc()
        if counts is not None:
            self.ingest_chunks.labels("precomputed").inc(counts.chunks_precomputed)
            self.ingest_chunks.labels("reused").inc(counts.chunks_reused)

    # ---- read at scrape time ------------------------------------------------------------------------------

    def watch_queue_depth(self, waiting: Callable[[], int]) -> None:
        self.queue_depth.set_function(lambda: float(waiting()))

    def watch_batching(self, running: Callable[[], int], pool_used: Callable[[], int], pool_budget: int) -> None:
        """Running answers and the KV pool's use, read at every scrape."""
        self.running_requests.set_function(lambda: float(running()))
        self.kv_pool_bytes.labels("used").set_function(lambda: float(pool_used()))
        self.kv_pool_bytes.labels("budget").set(pool_budget)

    def set_kv_path(self, mode: str, reason: str) -> None:
        """The KV path chosen at start (shared or copy) and why; the one series of `kvstitch_kv_path`."""
        self.kv_path.clear()
        self.kv_path.labels(mode, reason).set(1)

    def watch_arena(self, stats: Callable[[], ArenaStats]) -> None:
        """The shared chunk arena's bytes, chunks, pins, readers, admissions, evictions and resident reads at every
        scrape."""
        self.registry.register(_ArenaCollector(stats))

    def watch_engine(
        self,
        seconds: Callable[[], dict[str, float]],
        prefills: Callable[[], dict[str, int]] | None = None,
        rider_tokens: Callable[[], dict[str, int]] | None = None,
    ) -> None:
        """The engine thread's time by phase (idle, work, pace, admit, prefill, decode, emit), read at every scrape:
        `rate()` of each is the share of the engine it takes, so a dashboard shows what the one GPU owner does;
        with `prefills`, the questions prefilled in batched forwards by how (riding in a decode step's forward, or
        apart): whether arrivals ride or stall the running answers; with `rider_tokens`, the token slots computed
        for riding questions, theirs and padding: the compute the rider buckets waste."""
        self.registry.register(_EngineCollector(seconds, prefills, rider_tokens))

    def watch_retrieval(self, stats: Callable[[], RetrievalStats]) -> None:
        """Retrieval's time per question by stage (wait, embed, search), its questions and rounds, read at every
        scrape: rate(seconds) / rate(questions) is the mean time a question spends in each stage."""
        self.registry.register(_RetrievalCollector(stats))

    def watch_ingest_backlog(self, pending: Callable[[], int]) -> None:
        """The ingest stream's backlog at every scrape; NaN while the queue cannot be read (Redis away), so one
        unreachable dependency does not fail the whole scrape."""

        def read() -> float:
            try:
                return float(pending())
            except Exception as err:  # any backend error: the value is unknown, the scrape goes on
                log.debug("ingest backlog unreadable: %s", err)
                return math.nan

        self.ingest_pending.set_function(read)

    def watch_store(self, stats: Callable[[], StoreStats]) -> None:
        """Report the KV store's tier usage, hits, evictions and corrupt files at every scrape."""
        self.registry.register(_StoreCollector(stats))

    def watch_placement(self, stats: Callable[[], PlacementStats]) -> None:
        """The gateway's view of the fleet at every scrape: engines, their blocks per tier, and the tier moves of
        engines whose key space differs from the gateway's (ignored for routing)."""
        self.registry.register(_PlacementCollector(stats))

    def watch_fleet(self, figures: Callable[[], Mapping[str, EngineFigures]]) -> None:
        """A gateway's engines at every scrape: answers open on each, routable ones, key-space mismatches."""
        self.registry.register(_FleetCollector(figures))

    def watch_gc(self, pauses: GcPauses) -> None:
        """Report the garbage collector's pauses (every collection, by generation) at every scrape."""
        self.registry.register(_GcCollector(pauses))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    def __init__(
        self,
        seconds: Callable[[], dict[str, float]],
        prefills: Callable[[], dict[str, int]] | None,
        rider_tokens: Callable[[], dict[str, int]] | None = None,
    ) -> None:
        self._seconds = seconds
        self._prefills = prefills
        self._rider_tokens = rider_tokens

    def collect(self) -> Iterator[Any]:
        family = CounterMetricFamily(
            "kvstitch_engine_seconds", "Engine thread wall time by phase (rates add up to ~1)", labels=["phase"]
        )
        for phase, seconds in self._seconds().items():
            family.add_metric([phase], seconds)
        yield family
        if self._prefills is None:
            return
        prefills = CounterMetricFamily(
            "kvstitch_question_prefills",
            "Turbo questions prefilled in batched forwards, by how: riding in a decode step's forward, apart, or "
            "early (at once on a second stream beside the running step)",
            labels=["how"],
        )
        for how, count in self._prefills().items():
            prefills.add_metric([how], count)
        yield prefills
        if self._rider_tokens is None:
            return
        tokens = CounterMetricFamily(
            "kvstitch_rider_tokens",
            "Token slots computed for questions riding in decode steps: the questions' own, and their graph "
            "buckets' padding (computed, thrown away, waited for by every running answer)",
            labels=["kind"],
        )
        for kind, count in self._rider_tokens().items():
            tokens.add_metric([kind], count)
        yield tokens


class _RetrievalCollector(Collector):
    def __init__(self, stats: Callable[[], RetrievalStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Any]:
        stats = self._stats()
        seconds = CounterMetricFamily(
            "kvstitch_retrieval_seconds",
            "Seconds questions spent in retrieval by stage: wait (for the round before theirs), embed, search",
            labels=["stage"],
        )
        for stage, value in stats.seconds().items():
            seconds.add_metric([stage], value)
        yield seconds
        yield CounterMetricFamily("kvstitch_retrieval_questions", "Questions retrieved", value=stats.questions)
        yield CounterMetricFamily("kvstitch_retrieval_rounds", "Rounds (one embedding, one search)", value=stats.rounds)


class _GcCollector(Collector):
    def __init__(self, pauses: GcPauses) -> None:
        self._pauses = pauses

    def collect(self) -> Iterator[Any]:
        family = HistogramMetricFamily(
            "kvstitch_gc_pause_seconds",
            "Python garbage collections by generation: each one stops every thread of the gateway",
            labels=["generation"],
        )
        for generation, pauses in self._pauses.by_generation.items():
            buckets = [(str(bound), n) for bound, n in zip(PAUSE_BUCKETS, pauses.bucket_counts, strict=True)]
            family.add_metric([str(generation)], [*buckets, ("+Inf", pauses.count)], pauses.seconds)
        yield family


class _PlacementCollector(Collector):
    def __init__(self, stats: Callable[[], PlacementStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Any]:
        stats = self._stats()
        yield GaugeMetricFamily("kvstitch_fleet_engines", "Engines in the routing view", value=stats.engines)
        blocks = GaugeMetricFamily(
            "kvstitch_fleet_blocks", "Blocks the routing view places on engines, by tier", labels=["tier"]
        )
        for tier, n in stats.blocks.items():
            blocks.add_metric([tier.value], n)
        mismatched = CounterMetricFamily(
            "kvstitch_fleet_mismatched_moves",
            "Tier moves of engines whose key space (model fingerprint, template, dtype, stored form) differs from the "
            "gateway's: ignored, each a cache miss routing could not avoid",
            labels=["engine"],
        )
        for engine, n in stats.mismatched_moves.items():
            mismatched.add_metric([engine], n)
        yield from (blocks, mismatched)
        yield CounterMetricFamily(
            "kvstitch_fleet_view_reloads", "Full loads of the routing view from Redis", value=stats.reloads
        )


class _ArenaCollector(Collector):
    def __init__(self, stats: Callable[[], ArenaStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Any]:
        stats = self._stats()
        arena_bytes = GaugeMetricFamily(
            "kvstitch_arena_bytes", "Shared chunk arena: bytes held by chunks (used) and its size (capacity)",
            labels=["kind"],
        )  # fmt: skip
        arena_bytes.add_metric(["used"], stats.used_bytes)
        arena_bytes.add_metric(["capacity"], stats.capacity_bytes)
        yield arena_bytes
        yield GaugeMetricFamily("kvstitch_arena_chunks", "Chunks resident in the shared arena", value=stats.chunks)
        yield GaugeMetricFamily(
            "kvstitch_arena_pinned_chunks", "Arena chunks read by a running answer (never evicted)",
            value=stats.pinned_chunks,
        )  # fmt: skip
        yield GaugeMetricFamily(
            "kvstitch_arena_readers", "Running answers reading their chunks from the shared arena", value=stats.readers
        )
        yield CounterMetricFamily(
            "kvstitch_arena_answers", "Answers admitted onto the shared chunk path", value=stats.answers
        )
        yield CounterMetricFamily(
            "kvstitch_arena_waits", "Shared answers that waited in line for arena room before admission",
            value=stats.waited,
        )  # fmt: skip
        yield CounterMetricFamily(
            "kvstitch_arena_evictions", "Unpinned chunks evicted from the shared arena", value=stats.evictions
        )
        yield CounterMetricFamily(
            "kvstitch_arena_resident_reads",
            "Chunks shared answers found in the arena at admission: no fetch (tier gpu in kvstitch_kv_blocks)",
            value=stats.resident_reads,
        )


class _FleetCollector(Collector):
    def __init__(self, figures: Callable[[], Mapping[str, EngineFigures]]) -> None:
        self._figures = figures

    def collect(self) -> Iterator[Any]:
        figures = self._figures()
        running = GaugeMetricFamily(
            "kvstitch_fleet_engine_running", "Answers this gateway has open on each engine", labels=["engine"]
        )
        mismatch = GaugeMetricFamily(
            "kvstitch_fleet_key_space_mismatch",
            "1 for an engine whose key space (model fingerprint, template, dtype, stored form) differs from the "
            "gateway's: never routed to",
            labels=["engine"],
        )
        for engine, f in sorted(figures.items()):
            running.add_metric([engine], f.running)
            mismatch.add_metric([engine], 1 if f.mismatched else 0)
        yield running
        yield mismatch
        yield GaugeMetricFamily(
            "kvstitch_fleet_engines_live",
            "Engines the gateway may route to now (answering, ready, same key space)",
            value=sum(1 for f in figures.values() if f.routable),
        )


class _StoreCollector(Collector):
    def __init__(self, stats: Callable[[], StoreStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Any]:
        stats = self._stats()
        tier_bytes = GaugeMetricFamily(
            "kvstitch_tier_bytes", "Bytes per KV tier: held (used) and allowed (budget)", labels=["tier", "kind"]
        )
        for tier, usage in stats.usage.items():
            used = math.nan if usage.used_bytes is None else usage.used_bytes  # unknown: the index is away
            tier_bytes.add_metric([tier.value, "used"], used)
            tier_bytes.add_metric([tier.value, "budget"], usage.budget_bytes)
        hits = CounterMetricFamily("kvstitch_kv_hits", "Block lookups served per tier", labels=["tier"])
        for tier, n in stats.hits.items():
            hits.add_metric([tier.value], n)
        evictions = CounterMetricFamily("kvstitch_kv_evictions", "Blocks evicted per tier", labels=["tier"])
        for tier, n in stats.evictions.items():
            evictions.add_metric([tier.value], n)
        yield from (tier_bytes, hits, evictions)
        yield CounterMetricFamily("kvstitch_kv_misses", "Blocks computed online", value=stats.misses)
        yield CounterMetricFamily("kvstitch_kv_corrupt", "Block files that failed a check", value=stats.corrupt)
        yield CounterMetricFamily(
            "kvstitch_kv_read_ahead",
            "Blocks read from disk into the host tier when their answer started, before its admission asked",
            value=stats.read_ahead,
        )
        yield CounterMetricFamily("kvstitch_kv_blocks_written", "Block files written", value=stats.blocks_written)
        write_errors = CounterMetricFamily(
            "kvstitch_kv_write_errors",
            "KV writes (block files, index updates) that failed, by reason: index, disk, no_space, other",
            labels=["reason"],
        )
        for reason, n in stats.write_errors.items():
            write_errors.add_metric([reason], n)
        yield write_errors
        yield GaugeMetricFamily(
            "kvstitch_kv_pending_writes", "Blocks waiting to be written", value=stats.pending_writes
        )
        if stats.shared is not None:
            yield from _shared_tier_families(stats.shared)


def _shared_tier_families(stats: SharedStats) -> Iterator[Any]:
    """The shared tier (S3) behind the disk tier: lookups, bytes, uploads and call latency."""
    yield CounterMetricFamily(
        "kvstitch_s3_hits", "Blocks the disk tier did not hold, read from the shared tier (S3)", value=stats.hits
    )
    misses = CounterMetricFamily(
        "kvstitch_s3_misses",
        "Shared-tier lookups that found no usable object, by reason: absent, corrupt (failed a check: refused), "
        "error (store unreachable or refusing), down (skipped after a recent error)",
        labels=["reason"],
    )
    for reason, n in stats.misses.items():
        misses.add_metric([reason], n)
    moved = CounterMetricFamily(
        "kvstitch_s3_bytes", "Bytes of block files read from and written to the shared tier", labels=["direction"]
    )
    moved.add_metric(["read"], stats.bytes_read)
    moved.add_metric(["written"], stats.bytes_written)
    uploads = CounterMetricFamily(
        "kvstitch_s3_uploads",
        "Block files offered to the shared tier, by result: stored, exists (written once already), failed, dropped",
        labels=["result"],
    )
    for result, n in stats.uploads.items():
        uploads.add_metric([result], n)
    latency = HistogramMetricFamily(
        "kvstitch_s3_seconds",
        "Shared-tier calls: get (a lookup) and put (an upload, its existence check included)",
        labels=["op"],
    )
    for op, calls in stats.latency.items():
        buckets = [(str(bound), n) for bound, n in zip(LATENCY_BUCKETS, calls.bucket_counts, strict=True)]
        latency.add_metric([op], [*buckets, ("+Inf", calls.count)], calls.seconds)
    yield from (misses, moved, uploads, latency)
    yield GaugeMetricFamily(
        "kvstitch_s3_pending_uploads",
        "Uploads (and deletes) of block files waiting or running",
        value=stats.pending_uploads,
    )
