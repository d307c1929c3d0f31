"""The shared-vs-copy batch benchmark end to end on the CPU with a tiny model (its timings are the GPU's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest.bench_shared_batch import main, prefill_plan
from service.engine import shared_decode


def test_both_paths_run_every_batch_and_the_shared_one_holds_tails_only(
    tiny_model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    argv = ["--model", str(tiny_model_dirs["qwen2"]), "--device", "cpu", "--batches", "1", "3", "--paths", "copy"]
    argv += ["shared", "--chunks", "6", "--chunk-tokens", "16", "--reads", "2", "--max-new-tokens", "4"]
    assert main([*argv, "--runs", "1", "--warmup", "0", "--out", str(out)]) == 0

    rows = json.loads((out / "report.json").read_text())["rows"]
    assert [(r["batch"], r["path"]) for r in rows] == [(1, "copy"), (1, "shared"), (3, "copy"), (3, "shared")]
    assert all("error" not in r for r in rows)
    for batch in (1, 3):
        copy, shared = (r for r in rows if r["batch"] == batch)
        assert 0 < shared["pool_bytes_per_answer"] < copy["pool_bytes_per_answer"]  # no chunk in a shared slab
        assert copy["distinct_chunks"] == shared["distinct_chunks"] <= 2 * batch
        assert all(r["tokens_per_s"] > 0 and r["full_steps"] == 3 for r in (copy, shared))  # 4 tokens: 3 steps


def test_ttft_times_lone_requests_on_each_path(tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """`--ttft N`: per path, N requests one after another on an idle scheduler, each timed to its first token."""
    out = tmp_path / "out"
    argv = ["--model", str(tiny_model_dirs["qwen2"]), "--device", "cpu", "--batches", "1", "--paths", "copy"]
    argv += ["shared", "--chunks", "6", "--chunk-tokens", "16", "--reads", "2", "--max-new-tokens", "4", "--ttft", "3"]
    assert main([*argv, "--runs", "1", "--warmup", "1", "--out", str(out)]) == 0

    lone = json.loads((out / "report.json").read_text())["ttft"]
    assert [r["path"] for r in lone] == ["copy", "shared"]
    for row in lone:
        assert "error" not in row and row["requests"] == 3
        assert 0 < row["ttft_min_ms"] <= row["ttft_p50_ms"] <= row["ttft_p90_ms"]


def test_kernels_profiles_the_largest_batch_on_each_path(
    tiny_model_dirs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    argv = ["--model", str(tiny_model_dirs["qwen2"]), "--device", "cpu", "--batches", "1", "2", "--paths", "copy"]
    argv += ["shared", "--chunks", "6", "--chunk-tokens", "16", "--reads", "2", "--max-new-tokens", "3"]
    assert main([*argv, "--runs", "1", "--warmup", "0", "--kernels", "5", "--out", str(out)]) == 0

    rows = json.loads((out / "report.json").read_text())["rows"]
    assert [("kernels" in r) for r in rows] == [False, False, True, True]  # the largest batch only
    for row in rows[2:]:
        kernels = row["kernels"]  # the profiler's tables: prefill alone, then the whole batch
        assert kernels.startswith("2 answers, first token only (prefill): ") and kernels.count("Name") == 2
        assert "2 answers, 3 tokens (whole): " in kernels
    printed = capsys.readouterr().out
    assert "## copy, 2 answers: kernels" in printed and "## shared, 2 answers: kernels" in printed


def test_a_negative_kernel_count_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as refused:
        main(["--device", "cpu", "--kernels", "-1"])
    assert refused.value.code == 2 and "--kernels takes a count" in capsys.readouterr().err


def test_the_by_chunk_path_plans_its_prefills_by_chunk_only_while_it_runs() -> None:
    """`shared-by-chunk` turns the by-request prefill plan off for its block and restores it after, even when the
    block fails; every other path keeps it on."""
    assert shared_decode.PREFILL_BY_REQUEST
    with prefill_plan("shared-by-chunk"):
        assert not shared_decode.PREFILL_BY_REQUEST
    with prefill_plan("shared"):
        assert shared_decode.PREFILL_BY_REQUEST
    with pytest.raises(RuntimeError), prefill_plan("shared-by-chunk"):
        raise RuntimeError("a failed measurement")
    assert shared_decode.PREFILL_BY_REQUEST
