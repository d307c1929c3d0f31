"""The Table 5/6 benchmark on a tiny model on the CPU: a true batch gives each request its own tokens, and the
rows hold the batch figures (the H200 run is the lead's).

A true batch goes through the production path: a `Scheduler` as the server builds it, the chunk KV fetched at
admission by the server's KV source (`StoreChunks`) from the tier under test. Its tokens are compared with the same
request run alone through the scheduler, `offline.generate` (fp32 on the CPU: exact equality, as
`test_engine_batch.py`).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import loadtest.bench_tables as bench
from loadtest.true_batch import batch_scheduler, run_batch
from service.engine.batching_defaults import PREFILL_CHUNK
from service.engine.engine import GenerationMode, StitchEngine
from service.engine.offline import generate
from service.engine.prompt import PromptIds
from service.engine.sampling import SamplingParams
from service.engine.scheduler_config import release
from service.kvcache.tiers import Tier

DECODE_TOKENS = 5
# Chunks of 120 tokens to about 1,200 context tokens: the naive prompt is longer than the server's
# `prefill_chunk` (1,024), so the scheduler prefills it over two steps between the others' decode steps.
SETUP = argparse.Namespace(chunk_tokens=120, question_tokens=12, decode_tokens=DECODE_TOKENS, precompute_batch=16)
CONTEXT = 1200
SMALL_RUN = ["--chunk-tokens", "40", "--question-tokens", "12", "--decode-tokens", str(DECODE_TOKENS)]


@pytest.fixture
def three_prompts(get_engine: Callable[..., StitchEngine], tmp_path: Path) -> Iterator[bench.Context]:
    engine = get_engine("qwen2", "cpu")
    ctx = bench.Context.build(engine, CONTEXT, 3, SETUP, tmp_path)
    yield ctx
    ctx.close()


def alone(engine: StitchEngine, prompt: PromptIds, sampling: SamplingParams, tier: str) -> list[int]:
    """The request by itself through the scheduler, its chunk KV computed by the engine (turbo) or its whole prompt
    prefilled (naive)."""
    mode = GenerationMode.NAIVE if tier == "naive" else GenerationMode.TURBO
    return generate(engine, prompt, sampling, mode=mode).token_ids


@pytest.mark.parametrize("tier", bench.TIERS)
def test_a_true_batch_of_three_gives_every_request_its_tokens_alone(three_prompts: bench.Context, tier: str) -> None:
    ctx, engine = three_prompts, three_prompts.engine
    sampling = SamplingParams(max_new_tokens=DECODE_TOKENS, ignore_eos=True)
    assert all(len(p.joined()) > PREFILL_CHUNK for p in ctx.prompts)  # naive prompts take two prefill steps
    assert len({p.blocks for p in ctx.prompts}) == 3  # each request its own chunks
    scheduler = batch_scheduler(engine, ctx.prompts, sampling)
    try:
        run = run_batch(scheduler, ctx.prompts, sampling, ctx.prepare(tier, 3)(), bench.EXPECTED.get(tier))
        assert scheduler.pool.used_slots == 0  # every slab freed at its request's last token
    finally:
        release(scheduler)

    for answered, prompt in zip(run.answered, ctx.prompts, strict=True):
        assert answered.tokens == alone(engine, prompt, sampling, tier)
        assert (answered.fetch is None) == (tier == "naive")  # turbo fetched at admission, naive not at all
    # The three turbo questions were admitted in one step and prefilled in one forward (the server's minimum is 3).
    assert run.prefilled_together == (0 if tier == "naive" else 3)
    figures = run.figures()
    assert 0 < figures["first_ttft_ms"] <= figures["p50_ttft_ms"] <= figures["last_ttft_ms"] <= figures["batch_ms"]
    # Turbo requests decode together from the first step. Naive prompts share PREFILL_CHUNK tokens per step, oldest
    # first, in one batched forward (the first's tail beside the second's head): all three decode together before
    # the first has its 5 tokens (one chunk of one prompt per step, as before, gave only 2).
    assert figures["decode_batch"] == 3
    assert figures["decode_ms_per_step"] > 0


def _cells(report: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for row in report["rows"]:
        for tier, found in row["tiers"].items():
            for batch, entry in found["batches"].items():
                yield tier, batch, entry


def _run_main(tmp_path: Path, model: Path, *extra: str) -> tuple[dict[str, Any], str]:
    out, table = tmp_path / "tables.json", tmp_path / "tables.md"
    argv = ["--device", "cpu", "--model", str(model), "--contexts", "200", "--batches", "1", "3", *SMALL_RUN]
    argv += ["--runs", "2", "--warmup", "0", "--cache-dir", str(tmp_path), "--json", str(out), "--markdown", str(table)]
    assert bench.main([*argv, *extra]) == 0
    return json.loads(out.read_text()), table.read_text()


def test_the_rows_hold_each_true_batch_figure(tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    report, table = _run_main(tmp_path, tiny_model_dirs["qwen2"])

    assert report["batching"].startswith("true batches")
    assert report["batching_defaults"] == {"prefill_chunk": 1024, "batch_prefill_min": 3}
    cells = list(_cells(report))
    assert {(tier, batch) for tier, batch, _ in cells} == {(t, b) for t in bench.TIERS for b in ("1", "3")}
    for tier, batch, e in cells:
        assert e["mode"] == "true batch" and len(e["runs"]) == 2
        assert 0 < e["first_ttft_ms"] <= e["p50_ttft_ms"] <= e["last_ttft_ms"] <= e["batch_ms"], (tier, batch)
        assert e["decode_ms_per_step"] > 0 and e["decode_batch"] == int(batch)  # short prompts: all admitted at once
        assert e["median_ttft_ms"] >= e["median_prefill_ms"] > 0
        assert e["median_queue_ms"] >= 0 and e["median_decode_ms_per_token"] > 0
        assert e["prefilled_together"] == (3 if batch == "3" and tier != "naive" else 0)
    host = report["rows"][0]["tiers"]["host"]["batches"]["3"]
    assert host["median_h2d_ms"] >= 0 and host["median_fetch_ms"] > 0
    assert report["rows"][0]["tiers"]["miss"]["batches"]["3"]["median_precompute_ms"] > 0

    assert "Batching: true batches" in table
    assert "naive TTFT first / median / last ms" in table and "speedup vs naive on total" in table
    assert "| 200 (" in table and "failed" not in table


def test_a_failed_cell_is_reported_and_the_sweep_goes_on(
    tiny_model_dirs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = run_batch

    def out_of_memory_at_three(scheduler: Any, prompts: Any, sampling: Any, store: Any, expected: Any) -> Any:
        if len(prompts) == 3 and expected is Tier.GPU:
            raise RuntimeError("CUDA out of memory (simulated)")
        return real(scheduler, prompts, sampling, store, expected)

    monkeypatch.setattr(bench, "run_batch", out_of_memory_at_three)
    report, table = _run_main(tmp_path, tiny_model_dirs["qwen2"], "--tiers", "naive", "gpu", "host")

    tiers = report["rows"][0]["tiers"]
    assert tiers["gpu"]["batches"]["3"] == {"error": "RuntimeError: CUDA out of memory (simulated)"}
    assert "error" not in tiers["gpu"]["batches"]["1"] and "error" not in tiers["host"]["batches"]["3"]
    line = next(row for row in table.splitlines() if row.startswith("| 200 (") and "| 3 |" in row)
    assert line.count("failed") == 1


def test_the_sequential_rows_are_still_there_behind_a_flag(tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    report, table = _run_main(tmp_path, tiny_model_dirs["qwen2"], "--sequential", "--tiers", "naive", "gpu")

    assert report["batching"].startswith("sequential")
    assert "Batching: sequential" in table
    for tier, batch, e in _cells(report):
        assert 0 < e["first_ttft_ms"] <= e["p50_ttft_ms"] <= e["last_ttft_ms"] <= e["batch_ms"], (tier, batch)
        assert e["decode_batch"] == 1 and e["median_queue_ms"] == 0
        if batch == "3":  # the third request waited for the two before it, to their last tokens
            assert e["last_ttft_ms"] > e["first_ttft_ms"]
