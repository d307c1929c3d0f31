"""The soak at CI scale (issue 15): a real `kvstitch serve` with the tiny model, 8 clients for 20 seconds mixing
streaming and JSON answers, /v1 chat, dropped streams and ingests; no error but 503 with Retry-After, resident
memory, descriptors and threads stable after the warm-up. The 64-client, 5-minute run is `python -m loadtest.soak`
(figures in docs/benchmarks.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest.soak import KINDS, SoakConfig, soak
from service.devtools.ports import free_port

pytestmark = pytest.mark.slow


def test_a_short_soak_keeps_every_invariant(tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    config = SoakConfig(
        duration_s=20, clients=8, warmup_s=8, sample_s=2, out_dir=tmp_path / "soak", model=tiny_model_dirs["qwen2"]
    )

    report = soak(config, free_port())

    assert report["errors"] == {}, report["error_examples"]
    assert set(report["requests_ok"]) == set(KINDS), report["requests_ok"]  # every kind of client got through
    assert report["client_disconnects"] >= 1  # the dropped streams were seen as such by the server
    assert report["rss_growth"] < 0.10, report["rss_mb"]
    assert report["fds"]["end_of_load"] <= report["fds"]["after_warmup"] + 16, report["fds"]
    assert report["threads"]["end_of_load"] <= report["threads"]["after_warmup"] + 8, report["threads"]
    assert report["passed"] and report["server_exit_code"] == 0
    assert len(report["samples"]) >= 10 and (tmp_path / "soak" / "soak.json").is_file()
