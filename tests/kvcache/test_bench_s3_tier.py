"""The shared-tier benchmark runs end to end on CPU against a real S3 (the session's SeaweedFS) and times each
source only when every block came from it (it raises otherwise)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest import bench_s3_tier
from service.devtools.seaweed import SeaweedS3


@pytest.mark.slow
def test_the_benchmark_times_recompute_disk_and_s3(
    s3_credentials: SeaweedS3, tiny_model_dirs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "s3.json"
    args = ["--device", "cpu", "--model", str(tiny_model_dirs["qwen2"]), "--context", "600", "--chunk-tokens", "128"]
    args += ["--runs", "5", "--warmup", "0", "--endpoint", s3_credentials.endpoint, "--bucket", "kvstitch-test"]
    args += ["--cache-dir", str(tmp_path)]

    code = bench_s3_tier.main([*args, "--json", str(out)])
    report = json.loads(out.read_text())
    shown = capsys.readouterr().out

    assert code == 0 and list(report["sources"]) == list(bench_s3_tier.SOURCES)
    assert report["blocks"] >= 3 and report["file_bytes"] > report["kv_bytes"] > 0
    assert report["sources"]["recompute"]["x_recompute"] == 1.0
    for source, row in report["sources"].items():
        assert row["min_ms"] <= row["median_ms"], source
        assert row["x_recompute"] > 0, source
        assert row["gbps"] == pytest.approx(report["kv_bytes"] / 1e9 / (row["median_ms"] / 1e3)), source
    assert report["s3_get_mean_ms"] > 0
    assert "s3" in shown and "x recompute" in shown
    assert sorted(tmp_path.glob("kvstitch-bench-s3-*")) == []  # its cache dir is gone
