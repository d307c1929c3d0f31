"""A real Prometheus server (Debian's `prometheus`) scrapes a live gateway on loopback every second, and the TTFT
histogram of a few questions comes back through Prometheus' own HTTP API, labels and buckets included."""

from __future__ import annotations

import math
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from api_support import ask_events, ingest
from app_server import LiveServer

from service.devtools.ports import free_port
from service.metrics import TTFT_BUCKETS

pytestmark = pytest.mark.slow

PROMETHEUS = shutil.which("prometheus")
SCRAPE_TIMEOUT_S = 60


class PrometheusServer:
    """`prometheus` on a free loopback port with a one-target config and its own TSDB under `root`."""

    def __init__(self, root: Path, target: str) -> None:
        assert PROMETHEUS is not None
        config = root / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            "scrape_configs:\n"
            "  - job_name: kvstitch-gateway\n"
            f"    static_configs:\n      - targets: ['{target}']\n",
            encoding="utf-8",
        )
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = root / "prometheus.log"
        self.command = [
            PROMETHEUS,
            f"--config.file={config}",
            f"--storage.tsdb.path={root / 'tsdb'}",
            f"--web.listen-address={self.url.removeprefix('http://')}",
        ]
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> PrometheusServer:
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.process is not None
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)

    def query(self, promql: str) -> list[dict[str, Any]]:
        """The instant vector of `promql` (empty while nothing matches or Prometheus is starting)."""
        try:
            reply = httpx.get(f"{self.url}/api/v1/query", params={"query": promql}, timeout=5)
        except httpx.TransportError:
            return []
        body = reply.json()
        assert body["status"] == "success", body
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def wait_for(self, promql: str, done: Callable[[list[dict[str, Any]]], bool]) -> list[dict[str, Any]]:
        deadline = time.monotonic() + SCRAPE_TIMEOUT_S
        result: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            assert self.process is not None and self.process.poll() is None, self.log_tail()
            result = self.query(promql)
            if done(result):
                return result
            time.sleep(0.5)
        raise AssertionError(f"{promql} never satisfied the check; last {result}\n{self.log_tail()}")

    def log_tail(self) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")[-3000:]


@pytest.fixture
def gateway_and_prometheus(
    live_server: Callable[..., LiveServer], tmp_path: Path
) -> Iterator[tuple[LiveServer, PrometheusServer]]:
    if PROMETHEUS is None:
        pytest.skip("Debian's `prometheus` is not installed (the README's set-up command installs it)")
    root = tmp_path / "prometheus"
    root.mkdir()
    with live_server() as server, PrometheusServer(root, server.url.removeprefix("http://")) as prometheus:
        yield server, prometheus


def test_prometheus_scrapes_the_ttft_histogram_of_the_gateway(
    gateway_and_prometheus: tuple[LiveServer, PrometheusServer],
) -> None:
    server, prometheus = gateway_and_prometheus
    with httpx.Client(base_url=server.url, timeout=60) as client:
        assert ingest(client)["status"] == "done"
        answers = [
            ask_events(client, mode=mode, top_k=2, max_new_tokens=4)[-1][1] for mode in ("turbo", "turbo", "naive")
        ]

    total = prometheus.wait_for(
        "sum(kvstitch_ttft_seconds_count)", lambda r: bool(r) and float(r[0]["value"][1]) >= len(answers)
    )
    by_mode = {
        s["metric"]["mode"]: float(s["value"][1])
        for s in prometheus.query("sum by (mode) (kvstitch_ttft_seconds_count)")
    }
    up = prometheus.query('up{job="kvstitch-gateway"}')
    # Cumulative buckets, no rate(): the quantile of every answer so far.
    p99 = prometheus.query("histogram_quantile(0.99, sum by (le) (kvstitch_ttft_seconds_bucket))")
    ttft_sum = prometheus.query("sum(kvstitch_ttft_seconds_sum)")

    assert float(total[0]["value"][1]) == 3
    assert by_mode == {"turbo": 2.0, "naive": 1.0}
    assert [float(s["value"][1]) for s in up] == [1.0]
    assert float(ttft_sum[0]["value"][1]) == pytest.approx(sum(a["ttft_ms"] for a in answers) / 1e3, abs=1e-5)
    # With three observations the p99 falls in the bucket of the slowest answer, interpolated inside it.
    largest = max(a["ttft_ms"] for a in answers) / 1e3
    upper = next((b for b in TTFT_BUCKETS if largest <= b), math.inf)
    lower = max((b for b in TTFT_BUCKETS if b < upper), default=0.0)
    assert lower <= float(p99[0]["value"][1]) <= upper
