"""Every Prometheus metric of kvstitch, in one registry per process (one per app in tests).

Names are part of the contract with the Grafana dashboards in deploy/: change them only together.
Tier usage and hit counters are read from the KV store at scrape time, so they cannot drift from it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from service.kvcache.store import StoreStats

# TTFT is the headline figure: fine buckets where the stitched path lives (ms), coarse ones for naive/cold.
TTFT_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
STAGE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 30.0)
STAGES = ("retrieve", "load", "h2d", "precompute", "stitch", "prefill", "decode")


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvstitch_requests", "HTTP requests answered", ["route", "code"], registry=r)
        self.ttft = Histogram(
            "kvstitch_ttft_seconds", "Time to first token, request start to first token", ["mode"],
            buckets=TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        self.stage = Histogram(
            "kvstitch_stage_seconds", "Time per stage of a request", ["stage"], buckets=STAGE_BUCKETS, registry=r
        )
        self.kv_blocks = Counter(
            "kvstitch_request_kv_blocks", "Chunk KV blocks served to requests, by tier", ["tier"], registry=r
        )
        self.output_tokens = Counter("kvstitch_output_tokens", "Tokens generated", ["mode"], registry=r)
        self.rejected = Counter("kvstitch_rejected_requests", "Requests refused with 503", ["reason"], registry=r)
        self.engine_waiting = Gauge("kvstitch_engine_waiting", "Requests waiting for the engine", registry=r)
        self.ready = Gauge("kvstitch_ready", "1 when /readyz answers 200", registry=r)
        self.gate_diff = Gauge(
            "kvstitch_gate_max_abs_logit_diff", "Largest logit difference of the startup gate", registry=r
        )
        self.ingest_jobs = Counter("kvstitch_ingest_jobs", "Ingest jobs submitted", registry=r)
        self.disconnects = Counter("kvstitch_client_disconnects", "Streams stopped by the client", registry=r)

    def observe_answer(self, mode: str, ttft_ms: float, timings_ms: dict[str, float], kv: dict[str, int]) -> None:
        self.ttft.labels(mode).observe(ttft_ms / 1e3)
        for stage, ms in timings_ms.items():
            if stage in STAGES:
                self.stage.labels(stage).observe(ms / 1e3)
        for tier, n in kv.items():
            if n:
                self.kv_blocks.labels(tier).inc(n)

    def watch_store(self, stats: Callable[[], StoreStats]) -> None:
        """Report the KV store's tier usage, hits and evictions at every scrape."""
        self.registry.register(_StoreCollector(stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StoreCollector(Collector):
    def __init__(self, stats: Callable[[], StoreStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Any]:
        stats = self._stats()
        used = GaugeMetricFamily("kvstitch_kv_tier_used_bytes", "Bytes held per KV tier", labels=["tier"])
        budget = GaugeMetricFamily("kvstitch_kv_tier_budget_bytes", "Byte budget per KV tier", labels=["tier"])
        for tier, usage in stats.usage.items():
            used.add_metric([tier.value], usage.used_bytes)
            budget.add_metric([tier.value], usage.budget_bytes)
        hits = CounterMetricFamily("kvstitch_kv_hits", "Block lookups served per tier", labels=["tier"])
        for tier, n in stats.hits.items():
            hits.add_metric([tier.value], n)
        evictions = CounterMetricFamily("kvstitch_kv_evictions", "Blocks evicted per tier", labels=["tier"])
        for tier, n in stats.evictions.items():
            evictions.add_metric([tier.value], n)
        yield from (used, budget, hits, evictions)
        yield CounterMetricFamily("kvstitch_kv_misses", "Blocks computed online", value=stats.misses)
        yield CounterMetricFamily("kvstitch_kv_corrupt", "Block files that failed a check", value=stats.corrupt)
        yield GaugeMetricFamily(
            "kvstitch_kv_pending_writes", "Blocks waiting to be written", value=stats.pending_writes
        )
