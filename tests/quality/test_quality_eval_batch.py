"""`kvstitch eval --batch N`: each row's answers to N samples in one scheduler run give, on the tiny CPU models in
fp32, the answers of one sample at a time (token ids, text, scores, records in the same order), with the TTFT
column not measured; N outside 1..256 is refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from service.cli import main
from service.engine.engine import StitchEngine
from service.engine.kv_layout import ChunkContext
from service.engine.offline import OfflineScheduler
from service.engine.recompute_spec import parse_recompute
from service.engine.sampling import SamplingParams
from service.quality.dataset import read_samples
from service.quality.eval import evaluate, prepare, run_variant, run_variant_batch, table_variants
from service.quality.generator import write_qa_file

SAMPLES = 6  # not a multiple of the batch: the last batch is shorter
BATCH = 4
# Rows of both chunk contexts (the engine switched per row: `variant_engine`), with a recompute row in each.
CONTEXT_ARGS = ("--chunk-context", "alone", "--chunk-context", "prefix")
ROW_ARGS = (*CONTEXT_ARGS, "--recompute", "none", "--recompute", "selective:0.5")
ROWS = 7  # naive; per context: reordered, composite, reordered selective:0.5


@pytest.fixture
def qa_file(tmp_path: Path) -> Path:
    return write_qa_file(tmp_path / "qa.jsonl", questions=SAMPLES, chunks=3, seed=7, two_fact_share=0.5)


def _eval(model: Path, data: Path, out: Path, *extra: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The JSON record and the answers file's lines of one run."""
    answers = out.with_suffix(".jsonl")
    args = ["eval", "--model", str(model), "--data", str(data), "--device", "cpu", "--json", str(out)]
    assert main([*args, "--answers", str(answers), "--max-new-tokens", "6", *extra]) == 0
    lines = [json.loads(line) for line in answers.read_text(encoding="utf-8").splitlines()]
    record: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
    return record, lines


def _table_ttft_cells(table: str) -> list[str]:
    """The last cell (ttft_ms) of each row line of one printed table."""
    return [line.split()[-1] for line in table.splitlines()[2:]]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_batched_eval_answers_and_scores_as_one_at_a_time(
    tiny_model_dirs: dict[str, Path], qa_file: Path, tmp_path: Path, arch: str, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tiny_model_dirs[arch]
    one, one_lines = _eval(model, qa_file, tmp_path / "one.json", *ROW_ARGS)
    one_table = capsys.readouterr().out
    many, many_lines = _eval(model, qa_file, tmp_path / "many.json", *ROW_ARGS, "--batch", str(BATCH))
    many_table = capsys.readouterr().out
    assert (one["batch"], many["batch"], one["samples"], many["samples"]) == (1, BATCH, SAMPLES, SAMPLES)
    assert len(one_lines) == SAMPLES * ROWS
    timing = {"kl_first_token", "ttft_ms"}  # the records carry them for `--resume`: compared apart below
    untimed = [{k: v for k, v in line.items() if k not in timing} for line in many_lines]
    assert untimed == [{k: v for k, v in line.items() if k not in timing} for line in one_lines]  # same order
    assert all(line["ttft_ms"] is None for line in many_lines) and all(line["ttft_ms"] > 0 for line in one_lines)
    for got_line, want_line in zip(many_lines, one_lines, strict=True):
        assert got_line["kl_first_token"] == pytest.approx(want_line["kl_first_token"], rel=1e-4, abs=1e-9)
    assert len({line["answer"] for line in one_lines}) > 1  # the comparison is not of empty or constant answers
    for got, want in zip(many["rows"], one["rows"], strict=True):
        assert got["kl_first_token"] == pytest.approx(want["kl_first_token"], rel=1e-4, abs=1e-9)
        assert want["ttft_ms"] > 0.0 and got["ttft_ms"] is None
        drop = {"kl_first_token", "ttft_ms"}
        assert {k: v for k, v in got.items() if k not in drop} == {k: v for k, v in want.items() if k not in drop}
    assert _table_ttft_cells(many_table) == ["-"] * ROWS
    assert all(float(cell) > 0.0 for cell in _table_ttft_cells(one_table))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_a_batch_run_gives_each_case_the_token_ids_of_a_run_alone(get_engine: Any, arch: str, tmp_path: Path) -> None:
    """Every row kind (naive, reordered, composite, prefix:N and selective:R recompute, both chunk contexts, a
    context temperature) through `run_variant_batch`, batches of 4 then 1, against `run_variant` per case; the
    first-token logits kept by the scheduler are the separate prefill's up to float rounding."""
    engine: StitchEngine = get_engine(arch)
    samples = read_samples(write_qa_file(tmp_path / "qa.jsonl", questions=5, chunks=3, seed=5, two_fact_share=0.5))
    cases = [prepare(engine, sample, max_new_tokens=8) for sample in samples]
    recomputes = [parse_recompute(s) for s in ("none", "prefix:3", "selective:0.5")]
    variants = table_variants(recomputes, [ChunkContext.ALONE, ChunkContext.PREFIX], [1.0, 0.5])
    sampling = SamplingParams(max_new_tokens=8, temperature=0.0)
    runner = OfflineScheduler(engine)
    try:
        for variant in variants:
            alone = [run_variant(runner, case, variant, sampling) for case in cases]
            together = run_variant_batch(runner, cases[:4], variant, sampling)
            together += run_variant_batch(runner, cases[4:], variant, sampling)
            for got, want in zip(together, alone, strict=True):
                assert (got.token_ids, got.text) == (want.token_ids, want.text), variant.label
                assert got.ttft_ms is None and want.ttft_ms is not None
                assert int(got.first_logits.argmax()) == got.token_ids[0]
                torch.testing.assert_close(got.first_logits, want.first_logits, rtol=0.0, atol=1e-4)
    finally:
        runner.close()


def test_a_sample_that_cannot_be_built_ends_the_run_after_the_ones_before_it(
    tiny_model_dirs: dict[str, Path], qa_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A prompt too long for the model on line 3 of a batch of 4: lines 1 and 2 are answered and written first, as
    one at a time, and the run exits 2 naming the line."""
    good = qa_file.read_text(encoding="utf-8").splitlines()
    long_line = json.dumps({"question": "Q?", "chunks": ["word " * 5000], "answers": ["word"]})
    data = tmp_path / "long.jsonl"
    data.write_text("\n".join([*good[:2], long_line, good[2]]) + "\n", encoding="utf-8")
    written = {}
    for batch in ("1", str(BATCH)):
        answers = tmp_path / f"answers-{batch}.jsonl"
        args = ["eval", "--model", str(tiny_model_dirs["llama"]), "--data", str(data), "--device", "cpu"]
        assert main([*args, "--answers", str(answers), "--max-new-tokens", "4", "--batch", batch]) == 2
        assert "long.jsonl line 3: the prompt" in capsys.readouterr().err
        lines = answers.read_text(encoding="utf-8").splitlines()
        written[batch] = [{k: v for k, v in json.loads(line).items() if k != "ttft_ms"} for line in lines]
    assert len(written["1"]) == 2 * 3  # two samples, three rows
    assert [{k: v for k, v in r.items() if k != "kl_first_token"} for r in written[str(BATCH)]] == [
        {k: v for k, v in r.items() if k != "kl_first_token"} for r in written["1"]
    ]


@pytest.mark.parametrize("batch", ["0", "-2", "257"])
def test_a_batch_out_of_bounds_exits_2(
    tiny_model_dirs: dict[str, Path], qa_file: Path, batch: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["eval", "--model", str(tiny_model_dirs["qwen2"]), "--data", str(qa_file), "--device", "cpu"]
    assert main([*args, "--batch", batch]) == 2
    assert "error: --batch must be within 1..256" in capsys.readouterr().err


def test_evaluate_refuses_a_batch_out_of_bounds(get_engine: Any, tmp_path: Path) -> None:
    samples = read_samples(write_qa_file(tmp_path / "qa.jsonl", questions=1, chunks=2, seed=3))
    with pytest.raises(ValueError, match=r"batch must be within 1\.\.256, not 0"):
        evaluate(get_engine("llama"), samples, table_variants(), max_new_tokens=2, batch=0)
