"""The load generator at CI scale: a live gateway, a small generated corpus, two clients for a few seconds; its
figures agree with themselves and with the gateway's own metrics, and it writes its table, JSON and plot."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from app_server import LiveServer, server_of
from prometheus_client.parser import text_string_to_metric_families

from loadtest.load import LoadConfig, corpus, main, percentile, question, run_load, topic_name, zipf_weights

pytestmark = pytest.mark.slow

TOP_K = 2


@pytest.mark.parametrize("overlap", [False, True], ids=["read-each-step", "overlapped"])
def test_the_load_generator_reports_sane_figures_per_mode(
    live_server: Callable[..., LiveServer], tmp_path: Path, overlap: bool
) -> None:
    """Both modes through a live gateway, its decode steps read one by one (the CPU's default) or overlapped
    (CUDA's default: each step launched before the previous one is read)."""
    with live_server(overlap_decode=overlap) as server:
        scheduler = server_of(server.app).runtime.loop.scheduler
        assert scheduler is not None and scheduler.overlap is overlap
        config = LoadConfig(
            url=server.url,
            out_dir=tmp_path / "load",
            topics=8,
            sentences_per_topic=3,
            concurrency=2,
            duration_s=4.0,
            max_requests=60,
            top_k=TOP_K,
            max_new_tokens=4,
        )
        report = asyncio.run(run_load(config))
        scraped = httpx.get(f"{server.url}/metrics").text

    served = {
        s.labels["mode"]: s.value
        for family in text_string_to_metric_families(scraped)
        for s in family.samples
        if s.name == "kvstitch_ttft_seconds_count"
    }
    assert report.chunks >= config.topics
    assert [m.mode for m in report.modes] == ["turbo", "naive"]
    for mode in report.modes:
        assert mode.requests >= 2 and mode.errors == 0 and mode.refused == 0, mode.first_errors
        assert served[mode.mode] == mode.requests  # every answer the client counted, the gateway counted
        t = mode.ttft_ms
        assert 0 < t["p50"] <= t["p95"] <= t["p99"]
        assert 0 < mode.server_ttft_ms["p50"] <= t["p99"] + 1  # the server's clock stops before the bytes leave
        assert 0 < mode.tpot_ms["p50"] <= mode.tpot_ms["p95"]
        assert mode.output_tokens_per_s > 0
    turbo, naive = report.modes
    # Every turbo answer stitched TOP_K chunks' KV (stored by the worker: none is a miss); naive loads none.
    assert sum(turbo.kv.values()) == turbo.requests * TOP_K and turbo.kv["miss"] == 0
    assert sum(naive.kv.values()) == 0
    assert "| turbo |" in report.table and "| naive |" in report.table
    png = Path(report.plot).read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    saved = json.loads((config.out_dir / "report.json").read_text())
    assert [m["requests"] for m in saved["modes"]] == [turbo.requests, naive.requests]


def test_the_workload_is_zipf_skewed_and_distinct_per_topic() -> None:
    weights = zipf_weights(50, 1.1)
    documents = corpus(50, 3, seed=0)

    assert weights[0] / weights[9] == pytest.approx(10**1.1)
    assert len({topic_name(i) for i in range(500)}) == 500
    assert [d["id"] for d in documents] == [f"topic-{i}" for i in range(50)]
    assert topic_name(7) in documents[7]["text"] and topic_name(7) in question(7)
    assert corpus(50, 3, seed=0) == documents  # reproducible


def test_percentiles_interpolate_between_ranks() -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 0.95) == pytest.approx(4.8)
    assert math.isnan(percentile([], 0.5))


@pytest.mark.parametrize("url", ["http://10.0.0.1:8000", "http://example.com"])
def test_it_refuses_anything_but_loopback(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--url", url, "--duration", "1"]) == 2
    assert "only targets loopback" in capsys.readouterr().err
