"""The routing simulation on a small trace: deterministic, and chunk-aware routing hits the GPU tier more often."""

from __future__ import annotations

import json
from pathlib import Path

from loadtest.sim_routing import main, simulate, zipf_trace

ENGINES, GPU_CHUNKS, RATE = 3, 60, 12.0


def test_chunk_aware_routing_hits_the_gpu_tier_more_than_round_robin_and_random() -> None:
    trace = zipf_trace(corpus=600, per_question=8, questions=1500, seed=3)

    aware, robin, rand = (
        simulate(trace, p, ENGINES, GPU_CHUNKS, RATE, seed=3) for p in ("chunk-aware", "round-robin", "random")
    )

    assert aware.gpu_hit_ratio > robin.gpu_hit_ratio + 0.02
    assert aware.gpu_hit_ratio > rand.gpu_hit_ratio + 0.02
    assert aware.mean_kv_cost < robin.mean_kv_cost
    assert aware.question_imbalance < 1.2  # the load term keeps the engines near an even share
    assert simulate(trace, "chunk-aware", ENGINES, GPU_CHUNKS, RATE, seed=3) == aware


def test_documents_make_the_gap_wide() -> None:
    trace = zipf_trace(corpus=600, per_question=8, questions=1500, seed=3, doc_chunks=20)

    aware, robin = (simulate(trace, p, ENGINES, GPU_CHUNKS, RATE, seed=3) for p in ("chunk-aware", "round-robin"))

    assert aware.gpu_hit_ratio > robin.gpu_hit_ratio + 0.15


def test_the_command_writes_its_reports_and_replays_a_written_trace(tmp_path: Path) -> None:
    common = ["--engines", "2", "--gpu-chunks", "40", "--corpus", "300", "--top-k", "6", "--questions", "300"]
    main([*common, "--write-trace", str(tmp_path / "trace.jsonl"), "--json", str(tmp_path / "a.json")])
    main([*common, "--trace", str(tmp_path / "trace.jsonl"), "--json", str(tmp_path / "b.json")])

    first, replayed = (json.loads((tmp_path / name).read_text())["reports"] for name in ("a.json", "b.json"))
    assert [r["policy"] for r in first] == ["chunk-aware", "round-robin", "random"]
    assert [r["gpu_hit_ratio"] for r in replayed] == [r["gpu_hit_ratio"] for r in first]
    assert len((tmp_path / "trace.jsonl").read_text().splitlines()) == 300
