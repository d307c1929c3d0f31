"""The batched-decode benchmark runs end to end on a tiny model on the CPU (the H200 run is the lead's)."""

from __future__ import annotations

import json
from pathlib import Path

from loadtest.bench_batch_decode import main


def test_bench_batch_decode_smoke(tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    argv = ["--device", "cpu", "--model", str(tiny_model_dirs["qwen2"]), "--contexts", "200", "--batches", "1", "3"]
    argv += ["--tokens", "3", "--runs", "1", "--warmup", "0", "--chunk-tokens", "40", "--question-tokens", "20"]
    assert main([*argv, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 3]
    assert all(r["same_tokens"] and r["median_ms_per_step"] > 0 for r in rows)
