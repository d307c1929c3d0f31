"""The prefill-attention benchmark's work count, configs, table and a CPU smoke run (the timing is the GPU's)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest
import torch

from loadtest import bench_prefill_attention
from loadtest.bench_prefill_attention import main, parse_config, request_config, table, useful_tflop
from loadtest.bench_segment_attention import HEAD_DIM, HEADS, build_workload
from service.engine import segment_launch, segment_plan
from service.engine.fused_stitch import triton_runs_on

INTERPRETED = triton_runs_on(torch.device("cpu"), interpreter=os.environ.get("TRITON_INTERPRET") == "1")


def test_the_useful_work_counts_every_chunk_key_and_each_rows_causal_tail() -> None:
    """2 requests x 3 rows over 2 chunks each: a row sees its request's chunk keys and tail slots up to its own."""
    work = build_workload("same", 2, 2, 50, 30, seed=3, rows_per_request=3)
    batch = work.batch
    chunk_keys = sum(batch.chunks[s.chunk].length for s in batch.requests[0].segments)
    tails = [r.tail.used for r in batch.requests]
    keys = sum(3 * chunk_keys + 3 * used - 3 for used in tails)  # rows see used - 2, used - 1, used
    assert useful_tflop(work) == pytest.approx(4 * HEADS * HEAD_DIM * keys / 1e12)


def test_configs_parse_and_set_the_tile_settings_only_inside_their_block() -> None:
    assert parse_config("128x8x3") == (128, 8, 3)
    for bad in ("64x4", "48x4x0", "64x3x0", "ax4x0"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_config(bad)
    before = _tile_settings()
    with request_config((32, 2, 0)):
        assert _tile_settings() == (32, 2, None)
    assert _tile_settings() == before


def _tile_settings() -> tuple[int, int, int | None]:
    return segment_plan.REQUEST_BLOCK_M, segment_launch.REQUEST_WARPS, segment_launch.REQUEST_STAGES


def test_the_table_gives_ms_and_tflops_and_marks_a_path_that_did_not_run() -> None:
    rows = [{"batch": 8, "tflop_per_layer": 0.01, "ms": {"by-chunk": 2.8, "sdpa": None}}]
    assert table(rows).splitlines()[2:] == ["| 8 | by-chunk | 2.80 | 100 |", "| 8 | sdpa | — | — |"]


def test_bad_arguments_are_refused() -> None:
    for argv in (["--rows", "0"], ["--splits", "-1"], ["--configs", "64x4"]):
        with pytest.raises(SystemExit):
            bench_prefill_attention.parse(argv)


@pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 and triton")
def test_a_cpu_smoke_run_under_the_interpreter(tmp_path: Path) -> None:
    """The whole script on tiny sizes in fp32: both plans checked against the reference, then timed."""
    out = tmp_path / "prefill.json"
    argv = ["--device", "cpu", "--dtype", "float32", "--batches", "2", "--rows", "3", "--reads", "2"]
    argv += ["--chunk-tokens", "20", "--configs", "16x4x0", "--splits", "0", "2", "--runs", "1", "--warmup", "0"]
    assert main([*argv, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert max(report["errors"].values()) < 1e-5
    (row,) = report["rows"]
    assert set(row["ms"]) == {"by-chunk", "by-request 16x4x0/auto", "by-request 16x4x0/2"}
    assert all(ms > 0 for ms in row["ms"].values())
