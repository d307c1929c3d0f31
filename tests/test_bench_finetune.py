"""The fine-tuning benchmark runs end to end on a tiny model on the CPU (the GPU run is the lead's): old loop,
batched labelled and batched self-distillation rates, in one JSON line."""

from __future__ import annotations

import json
from pathlib import Path

from loadtest.bench_finetune import main


def test_bench_finetune_smoke(tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    argv = ["--device", "cpu", "--model", str(tiny_model_dirs["qwen2"]), "--questions", "4", "--chunks", "2"]
    argv += ["--old-batch-size", "2", "--batch-sizes", "2,4", "--old-steps", "1", "--new-steps", "1", "--warmup", "0"]
    assert main([*argv, "--answer-tokens", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text(encoding="utf-8"))
    assert result["samples"] == 4 and result["device"] == "cpu" and result["tokens_per_sample"] > 20
    assert 1 <= result["teacher_answer_tokens"] <= 2
    for key in ("old_samples_per_s", "new_samples_per_s@2", "distill_samples_per_s@4", "teacher_answers_per_s"):
        assert result[key] > 0, key
    assert result["speedup@4"] == result["new_samples_per_s@4"] / result["old_samples_per_s"]
