"""The Grafana dashboard and its provisioning: valid JSON and YAML, every panel on the provisioned datasource, and
every query naming only metrics (with their sample suffixes) and labels that service/metrics.py exports."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from service.engine.arena_stats import ArenaStats
from service.fleet.placement import PlacementStats
from service.fleet.routing import RouteDecision, RouteReason
from service.kvcache.store import StoreStats, TierUsage
from service.kvcache.tiers import Tier
from service.metrics import INGEST_STATUSES, STAGES, Metrics
from service.retrieval.batcher import RetrievalStats
from service.serving.fleet_gateway import FleetEngineFigures
from service.serving.gc_pauses import GcPauses

ROOT = Path(__file__).resolve().parent.parent
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "kvstitch.json"
METRIC = re.compile(r"\bkvstitch_[a-z0-9_]+\b")
GROUPING = re.compile(r"\b(?:by|without|ignoring|on)\s*\(([^)]*)\)")
MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)\s*\"")
# Labels Prometheus itself adds (`le` comes with every histogram bucket).
BUILTIN_LABELS = {"le", "instance", "job"}


def store_stats() -> StoreStats:
    return StoreStats(
        usage={tier: TierUsage(1 << 20, 8 << 20, 3) for tier in (Tier.GPU, Tier.HOST, Tier.DISK)},
        hits={tier: 2 for tier in (Tier.GPU, Tier.HOST, Tier.DISK)},
        misses=1,
        corrupt=0,
        evictions={tier: 1 for tier in (Tier.GPU, Tier.HOST, Tier.DISK)},
        blocks_written=4,
        bytes_written=4 << 20,
        pending_writes=0,
        write_errors={"index": 1, "disk": 0, "no_space": 0, "other": 0},
    )


@pytest.fixture(scope="module")
def exported() -> dict[str, set[str]]:
    """Sample name → its label names, from a registry in which every metric has at least one sample."""
    metrics = Metrics()
    metrics.watch_store(store_stats)
    metrics.watch_queue_depth(lambda: 0)
    metrics.watch_batching(lambda: 2, lambda: 1 << 20, 1 << 30)
    metrics.watch_engine(
        lambda: {"idle": 1.0, "decode": 2.0},
        lambda: {"riding": 3, "apart": 1},
        lambda: {"question": 210, "padding": 46},
    )
    metrics.watch_retrieval(lambda: RetrievalStats(questions=4, rounds=2, wait_s=0.1, embed_s=0.2, search_s=0.3))
    metrics.watch_gc(GcPauses())
    metrics.batch_size.observe(2)
    metrics.preemptions.inc(0)
    metrics.watch_ingest_backlog(lambda: 0)
    timings = {stage: 1.0 for stage in STAGES}
    tiers = {tier.value: 1 for tier in Tier}
    for mode in ("turbo", "naive"):
        metrics.observe_answer(mode, "reordered", 12.0, timings, tiers, tiers, 5, "selective:0.2", 10)
    metrics.requests.labels("/ask", "200").inc()
    metrics.rejected.labels("busy").inc()
    metrics.disconnects.inc()
    metrics.ready.set(1)
    metrics.gate_diff.set(1e-6)
    metrics.gate_zero_copy_diff.set(2e-6)
    metrics.set_kv_path("shared", "on")
    metrics.watch_arena(lambda: ArenaStats(1 << 20, 8 << 20, 3, 2, 2, 5, 1, 4, 6))
    for status in INGEST_STATUSES:
        metrics.ingest_jobs.labels(status).inc()
    metrics.observe_shadow("reordered", "none", {"first_token": True, "answer": False}, kl=0.01)
    metrics.watch_fleet(lambda: {"e1": FleetEngineFigures(running=2, routable=True, mismatched=False)})
    metrics.watch_placement(lambda: PlacementStats(1, {Tier.GPU: 3, Tier.HOST: 1, Tier.DISK: 0}, {"e2": 4}, 1))
    metrics.observe_route(RouteDecision("e1", RouteReason.COST, 10.0, 10.0, (Tier.GPU, Tier.MISS)))
    metrics.fleet_reroutes.inc()
    names: dict[str, set[str]] = {}
    for family in metrics.registry.collect():
        assert family.samples, f"{family.name} has no sample: populate it above"
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    return names


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return loaded


def targets() -> list[dict[str, Any]]:
    return [t for p in dashboard()["panels"] for t in p.get("targets", [])]


def test_the_dashboard_is_valid_json_with_unique_panels_in_the_grid() -> None:
    board = dashboard()
    panels = board["panels"]

    assert board["uid"] == "kvstitch" and board["title"]
    assert len({p["id"] for p in panels}) == len(panels)
    for p in panels:
        grid = p["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24 and grid["h"] > 0, p["title"]
        assert p["type"] == "row" or p["targets"], f"{p['title']} has no query"
    assert len(targets()) >= 15


def test_the_dashboard_has_the_panels_the_issue_asks_for() -> None:
    exprs = " ".join(t["expr"] for t in targets())

    for quantile in ("0.5", "0.95", "0.99"):
        assert f"histogram_quantile({quantile}, sum by (le, mode) (rate(kvstitch_ttft_seconds_bucket" in exprs
    for needle in (
        "kvstitch_stage_seconds",  # stage breakdown
        "group_left sum(rate(kvstitch_kv_blocks_total",  # tier hit ratio
        "rate(kvstitch_output_tokens_total",  # tokens per second
        "kvstitch_queue_depth",
        "kvstitch_ingest_pending",  # ingest backlog
        'increase(kvstitch_shadow_agreement_total{outcome="agreed"}',  # fidelity on live traffic
        "kvstitch_shadow_kl_bucket",
    ):
        assert needle in exprs, needle


def test_every_query_names_an_exported_metric_and_its_labels(exported: dict[str, set[str]]) -> None:
    unknown: list[str] = []
    for target in targets():
        expr = target["expr"]
        used = set(METRIC.findall(expr))
        assert used, f"no kvstitch metric in {expr}"
        unknown += [f"{name} in {expr}" for name in used if name not in exported]
        labels = set().union(*(exported.get(name, set()) for name in used)) | BUILTIN_LABELS
        for group in GROUPING.findall(expr):
            unknown += [f"label {n} in {expr}" for n in (s.strip() for s in group.split(",")) if n not in labels]
        unknown += [f"label {n} in {expr}" for n in MATCHER.findall(expr) if n not in labels]
    assert unknown == []


def test_every_panel_uses_the_provisioned_datasource() -> None:
    provisioned = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    (source,) = provisioned["datasources"]
    providers = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "kvstitch.yml").read_text())["providers"]

    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    assert [p["options"]["path"] for p in providers] == ["/var/lib/grafana/dashboards"]
    for panel in dashboard()["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == source["uid"], panel["title"]
            assert {t["datasource"]["uid"] for t in panel["targets"]} == {source["uid"]}, panel["title"]
