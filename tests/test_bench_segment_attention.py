"""The segment-attention benchmark's workloads, table and start-up check on the CPU (the timing is the GPU's)."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import pytest
import torch

from loadtest.bench_segment_attention import (
    LAYERS,
    build_workload,
    check_kernels,
    kv_bytes_per_answer,
    main,
    parse,
    qwen2_rotary,
    table,
)
from service.engine.fused_stitch import triton_runs_on


@pytest.mark.parametrize(("level", "distinct"), [("same", 16), ("pool192", None), ("zipf4000", None)])
def test_workloads_place_each_requests_chunks_after_the_prefix(level: str, distinct: int | None) -> None:
    work = build_workload(level, 32, 16, 520, 100, seed=1)
    batch = work.batch
    assert len(batch.requests) == len(batch.rows) == 32
    if distinct is not None:
        assert len(batch.chunks) == distinct
    else:
        assert 16 < len(batch.chunks) <= 32 * 16
    for row, request in enumerate(batch.requests):
        chunks = [s.chunk for s in request.segments]
        assert len(set(chunks)) == len(chunks) == 16
        offsets = [s.offset for s in request.segments]
        lengths = [batch.chunks[c].length for c in chunks]
        assert offsets == [24 + sum(lengths[:i]) for i in range(16)]  # back to back after the prefix
        assert all(500 <= n <= 540 for n in lengths) and 90 <= request.tail.used <= 110
        # The decode row is the tail's last token: after the chunks and the tail's own tokens past the prefix.
        assert batch.positions[row] == offsets[-1] + lengths[-1] + request.tail.used - 24 - 1
        assert work.context[row] == sum(lengths) + request.tail.used
    tails = [(r.tail.start, r.tail.used) for r in batch.requests]
    assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(tails))  # tails end to end
    assert sum(c.length for c in batch.chunks) == work.arena_tokens


def test_zipf_sharing_lies_between_the_same_chunks_and_a_uniform_draw() -> None:
    distinct = {
        level: len(build_workload(level, 64, 16, 520, 100, seed=2).batch.chunks)
        for level in ("same", "pool192", "zipf4000")
    }
    assert distinct["same"] == 16 < distinct["pool192"] <= 192 < distinct["zipf4000"]


def test_kv_bytes_per_answer() -> None:
    """Copy: the slab (context + tail) x 28 layers x K,V x 4 heads x 128 x 2 bytes; segment: tail + 1/B of the arena."""
    work = build_workload("same", 8, 16, 520, 100, seed=0)
    copy, segment = kv_bytes_per_answer(work)
    per_token = LAYERS * 2 * 4 * 128 * 2
    assert copy == pytest.approx(sum(work.context) / 8 * per_token / 2**20)
    assert segment == pytest.approx((work.tail_tokens + work.arena_tokens) / 8 * per_token / 2**20)
    assert copy / segment > 6


def test_table_marks_paths_that_did_not_run() -> None:
    row = {"level": "same", "batch": 8, "distinct_chunks": 16, "plan_ms": 0.4, "segment_graph_ms": 2.8}
    row |= {"segment_eager_ms": 5.6, "copy_flash_varlen_graph_ms": None, "copy_sdpa_gather_graph_ms": 14.0}
    row |= {"kv_mib_copy": 460.0, "kv_mib_segment": 62.2}
    line = table([row]).splitlines()[-1]
    assert line == "| same | 8 | 16 | 0.100 | 2.800 | — | 14.000 | 5.0x | 5.600 | 460 | 62.2 | 0.4 | — |"
    row["segment_padded_ms"] = {"0": 3.5, "256": 2.9, "64": None}
    line = table([row]).splitlines()[-1]
    assert line.endswith("| 0.4 | 3.500 (per tile), 2.900 (256), — (64) |")


def test_a_negative_padded_program_count_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as refused:
        parse(["--padded-programs", "256", "-1"])
    assert refused.value.code == 2 and "--padded-programs takes counts" in capsys.readouterr().err
    assert parse(["--padded-programs", "0", "256"]).padded_programs == [0, 256]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_main_refuses_without_cuda() -> None:
    assert main(["--batches", "1"]) == 1


@pytest.mark.skipif(
    not triton_runs_on(torch.device("cpu"), interpreter=os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs TRITON_INTERPRET=1 and triton",
)
def test_the_start_up_check_at_the_real_shape_under_the_interpreter() -> None:
    errors = check_kernels(torch.device("cpu"), qwen2_rotary(torch.device("cpu")), (torch.float32, torch.float16))
    assert errors["float32"] < 1e-5 and errors["float16"] < 5e-3


@pytest.mark.skipif(
    not triton_runs_on(torch.device("cpu"), interpreter=os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs TRITON_INTERPRET=1 and triton",
)
def test_a_cpu_smoke_run_under_the_interpreter(tmp_path: Path) -> None:
    """The whole script on tiny sizes: every path timed but flash (absent on the CPU), errors checked first."""
    out = tmp_path / "seg.json"
    argv = ["--device", "cpu", "--dtype", "float16", "--batches", "3", "--levels", "same", "zipf40"]
    argv += ["--reads", "2", "--chunk-tokens", "30", "--tail-tokens", "10", "--runs", "1", "--warmup", "0"]
    assert main([*argv, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["errors"]["float32"] < 1e-5 and report["errors"]["float16"] < 5e-3
    rows = report["rows"]
    assert [(r["level"], r["batch"]) for r in rows] == [("same", 3), ("zipf40", 3)]
    assert all(r["segment_graph_ms"] > 0 and r["copy_sdpa_gather_graph_ms"] > 0 for r in rows)
    assert all(r["copy_flash_varlen_graph_ms"] is None for r in rows)
    assert rows[0]["distinct_chunks"] == 2 and rows[0]["kv_mib_segment"] < rows[0]["kv_mib_copy"]
    assert rows[0]["pairs"] == 3 * 2 + 3 and rows[1]["pairs"] >= rows[0]["pairs"]
