"""GET /metrics after an ingest and two questions: every metric of issue 6 with the values the requests imply."""

from __future__ import annotations

import gc

import pytest
from api_support import DOCS, ask_events, ingest
from app_server import MakeApp, wait_ready
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(client: TestClient) -> Samples:
    reply = client.get("/metrics")
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain")
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(reply.text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def test_metrics_count_answers_stages_tiers_and_ingestion(client: TestClient) -> None:
    status = ingest(client)
    turbo = ask_events(client, mode="turbo", positions="composite", top_k=3, max_new_tokens=6)[-1][1]
    naive = ask_events(client, mode="naive", top_k=3, max_new_tokens=6)[-1][1]

    m = scrape(client)

    assert value(m, "kvstitch_ttft_seconds_count", mode="turbo", positions="composite") == 1
    assert value(m, "kvstitch_ttft_seconds_count", mode="naive", positions="reordered") == 1
    # The done event rounds to microseconds.
    assert value(m, "kvstitch_ttft_seconds_sum", mode="turbo", positions="composite") == pytest.approx(
        turbo["ttft_ms"] / 1e3, abs=1e-6
    )
    for stage in ("retrieve", "queue", "load", "h2d", "stitch", "prefill", "decode"):
        assert value(m, "kvstitch_stage_seconds_count", stage=stage) == 2, stage
    # The worker stored every chunk's KV on disk; the turbo question's 3 blocks came from there, or from the host
    # tier where its read ahead (started with the answer) landed them first; naive reads none.
    assert turbo["kv"]["host"] + turbo["kv"]["disk"] == 3
    loaded = {tier: m.get(("kvstitch_kv_blocks_total", frozenset({("tier", tier)})), 0) for tier in ("host", "disk")}
    assert loaded == {"host": turbo["kv"]["host"], "disk": turbo["kv"]["disk"]}
    assert ("kvstitch_kv_blocks_total", frozenset({("tier", "miss")})) not in m
    assert value(m, "kvstitch_output_tokens_total", mode="turbo") == turbo["output_tokens"]
    assert value(m, "kvstitch_output_tokens_total", mode="naive") == naive["output_tokens"]
    tpot = turbo["timings_ms"]["decode"] / 1e3 / (turbo["output_tokens"] - 1)
    assert abs(value(m, "kvstitch_time_per_output_token_seconds_sum", mode="turbo") - tpot) < 1e-5
    assert value(m, "kvstitch_requests_total", route="/ask", status="200") == 2
    assert value(m, "kvstitch_requests_total", route="/ingest", status="202") == 1
    assert value(m, "kvstitch_requests_total", route="/ingest/{job_id}", status="200") >= 1
    assert value(m, "kvstitch_queue_depth") == 0
    # One turbo question at a time is prefilled alone: no batched question prefill, riding or apart.
    assert value(m, "kvstitch_question_prefills_total", how="riding") == 0
    assert value(m, "kvstitch_question_prefills_total", how="apart") == 0
    assert value(m, "kvstitch_question_prefills_total", how="early") == 0
    assert value(m, "kvstitch_rider_tokens_total", kind="question") == 0
    assert value(m, "kvstitch_rider_tokens_total", kind="padding") == 0
    assert value(m, "kvstitch_ingest_jobs_total", status="submitted") == 1
    assert value(m, "kvstitch_ingest_jobs_total", status="done") == 1
    assert value(m, "kvstitch_ingest_jobs_total", status="failed") == 0
    assert value(m, "kvstitch_ingest_chunks_total", kv="precomputed") == status["chunks_precomputed"]
    assert value(m, "kvstitch_ingest_chunks_total", kv="reused") == status["chunks_reused"]
    assert status["chunks"] >= len(DOCS)
    assert value(m, "kvstitch_ingest_pending") == 0  # the job was acked
    assert value(m, "kvstitch_tier_bytes", tier="host", kind="budget") == 8 << 20  # API_SETTINGS' host_cache_mb
    assert value(m, "kvstitch_tier_bytes", tier="disk", kind="used") > 0
    assert value(m, "kvstitch_kv_corrupt_total") == 0
    assert value(m, "kvstitch_kv_read_ahead_total") == turbo["kv"]["host"]  # each host hit was read ahead
    # ingestion writes its blocks itself (not through the answer path's write-back): every one is counted
    assert status["chunks_precomputed"] > 0
    assert value(m, "kvstitch_kv_blocks_written_total") == status["chunks_precomputed"]


def test_static_files_are_counted_under_their_mount(client: TestClient) -> None:
    assert client.get("/static/style.css").status_code == 200
    assert client.get("/static/app.js").status_code == 200
    assert client.get("/static/missing.js").status_code == 404
    assert client.get("/no-such-page").status_code == 404

    m = scrape(client)

    assert value(m, "kvstitch_requests_total", route="/static", status="200") == 2
    assert value(m, "kvstitch_requests_total", route="/static", status="404") == 1
    assert value(m, "kvstitch_requests_total", route="unmatched", status="404") == 1


def test_a_second_ingest_of_the_same_documents_counts_reused_chunks(client: TestClient) -> None:
    first = ingest(client)
    ingest(client, [{**doc, "id": f"copy-{doc['id']}"} for doc in DOCS])  # same text: KV is content-addressed

    m = scrape(client)

    assert value(m, "kvstitch_ingest_jobs_total", status="submitted") == 2
    assert value(m, "kvstitch_ingest_jobs_total", status="done") == 2
    assert value(m, "kvstitch_ingest_chunks_total", kv="precomputed") == first["chunks_precomputed"]
    assert value(m, "kvstitch_ingest_chunks_total", kv="reused") == first["chunks"]


def test_a_ready_server_froze_its_start_up_heap_and_reports_every_collection(make_app: MakeApp) -> None:
    frozen_before, threshold_before = gc.get_freeze_count(), gc.get_threshold()
    app = make_app(gc_freeze=True, gc_gen0_threshold=12_345)
    try:
        with TestClient(app) as client:
            wait_ready(app)
            # torch, transformers, the tokenizer and the embedder alone are hundreds of thousands of objects
            assert gc.get_freeze_count() > frozen_before + 100_000
            assert gc.get_threshold() == (12_345, *threshold_before[1:])
            before = scrape(client)
            gc.collect()
            after = scrape(client)
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold_before)
    count = value(after, "kvstitch_gc_pause_seconds_count", generation="2")
    assert count >= value(before, "kvstitch_gc_pause_seconds_count", generation="2") + 1
    assert value(after, "kvstitch_gc_pause_seconds_sum", generation="2") > 0
    assert value(after, "kvstitch_gc_pause_seconds_bucket", generation="2", le="+Inf") == count


def test_question_prefills_are_exported_from_the_schedulers_counts() -> None:
    from service.metrics import Metrics

    metrics = Metrics()
    counts = {"riding": 0, "apart": 0, "early": 0}
    metrics.watch_engine(lambda: {"idle": 1.0}, lambda: dict(counts))
    counts.update(riding=5, apart=2, early=3)  # read at every scrape, not at registration
    m = {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
    }
    assert value(m, "kvstitch_question_prefills_total", how="riding") == 5
    assert value(m, "kvstitch_question_prefills_total", how="apart") == 2
    assert value(m, "kvstitch_question_prefills_total", how="early") == 3
