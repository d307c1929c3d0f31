"""The fine-tune / eval / score sweep (loadtest/quality_sweep.py) over a tiny model on the CPU."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from loadtest.quality_sweep import (
    BASE,
    Variant,
    eval_jobs,
    join_eval_data,
    main,
    parse_variant,
    scores,
    shard_bounds,
)
from loadtest.score_answers import NAIVE, read_run
from service.quality.generator import write_qa_file
from workers.training.finetune import REPORT_NAME


def test_a_variant_is_a_name_and_flag_value_pairs() -> None:
    assert parse_variant("a:steps=150,full-attention-share=0.3") == Variant(
        "a", ("--steps", "150", "--full-attention-share", "0.3")
    )
    assert parse_variant("plain") == Variant("plain", ())
    for bad in ("base:steps=1", "a:steps", "a:Steps=1", "a:steps=", ":steps=1", "a b:steps=1"):
        with pytest.raises(ValueError, match="variant"):
            parse_variant(bad)


@pytest.mark.parametrize(("samples", "shards"), [(146, 8), (10, 3), (2, 8), (8, 8), (1, 1)])
def test_shards_cover_every_sample_once_and_none_is_empty(samples: int, shards: int) -> None:
    bounds = shard_bounds(samples, shards)
    covered = [i for offset, limit in bounds for i in range(offset, offset + limit)]
    assert covered == list(range(samples))
    assert len(bounds) <= shards and all(limit > 0 for _, limit in bounds)


def test_the_sweep_trains_evaluates_scores_names_a_failure_and_resumes(
    tiny_model_dirs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = write_qa_file(tmp_path / "prompts.jsonl", questions=4, chunks=2, seed=1)
    data = write_qa_file(tmp_path / "eval_a.jsonl", questions=2, chunks=2, seed=2)
    second = with_id_prefix(write_qa_file(tmp_path / "eval_b.jsonl", questions=1, chunks=2, seed=3), "b-")
    out = tmp_path / "sweep"
    common = [
        "--model",
        str(tiny_model_dirs["llama"]),
        "--distill-data",
        str(prompts),
        "--eval-data",
        str(data),
        "--eval-data",
        str(second),
        "--out",
        str(out),
        "--finetune-args",
        "--device cpu --batch-size 2 --answer-tokens 3 --warmup-steps 0 --lr 1e-3",
        "--eval-args",
        "--device cpu --max-new-tokens 3",
        "--shards",
        "2",
    ]
    code = main([*common, "--variant", "a:steps=1", "--variant", "bad:steps=0"])
    printed = capsys.readouterr()

    assert code == 1  # the refused variant fails the sweep, the rest is still scored
    assert "finetune bad failed (exit 2)" in printed.err and "bad.finetune.log" in printed.err
    assert (out / "a" / REPORT_NAME).is_file() and not (out / "bad").exists()
    answers = sorted(p.name for p in (out / "answers").iterdir())
    assert answers == ["a_0.jsonl", "a_1.jsonl", "base_0.jsonl", "base_1.jsonl"]
    parts = json.loads((out / "scores.json").read_text(encoding="utf-8"))
    assert list(parts) == ["all", "eval_a", "eval_b"]  # both files scored together, then each alone
    assert [r["samples"] for r in parts["eval_a"]] == [2] * 6 and [r["samples"] for r in parts["eval_b"]] == [1] * 6
    rows = {(r["run"], r["variant"]): r for r in parts["all"]}
    reference = rows[("base", "naive/-/none")]
    assert reference["samples"] == 3 and reference["difference"] == 0.0 and reference["p_value"] == 1.0
    assert ("a", "naive/-/none") in rows and ("a", "turbo@prefix/reordered/none") in rows
    assert all(r["samples"] == 3 for r in rows.values())
    assert "| a | turbo@prefix/reordered/none | 3 |" in (out / "scores.md").read_text(encoding="utf-8")
    assert "| a | turbo@prefix/reordered/none | 1 |" in (out / "scores.md").read_text(encoding="utf-8")

    trained_log = out / "logs" / "a.finetune.log"
    written = trained_log.stat().st_mtime_ns
    cut_shard, whole_shard = out / "answers" / "a_0.jsonl", out / "answers" / "a_1.jsonl"
    answered = cut_shard.read_text(encoding="utf-8").splitlines()
    cut_shard.write_text("\n".join(answered[:-1]) + "\n", encoding="utf-8")  # cut off before its last row
    whole = whole_shard.read_bytes()
    code = main([*common, "--variant", "a:steps=1", "--base-answers", str(out / "answers" / "base_*.jsonl")])
    assert code == 0
    assert trained_log.stat().st_mtime_ns == written  # a finished fine-tune is not trained again
    assert whole_shard.read_bytes() == whole  # a finished shard is not answered again
    before = [json.loads(line) for line in answered]
    resumed = [json.loads(line) for line in cut_shard.read_text(encoding="utf-8").splitlines()]
    assert len(before) == len(resumed) == 2 * 3  # 2 samples, 3 rows each
    assert resumed[:3] == before[:3]  # the finished sample is kept as it was (its TTFTs included)
    untimed = [[{k: v for k, v in r.items() if k != "ttft_ms"} for r in rs[3:]] for rs in (before, resumed)]
    assert untimed[0] == untimed[1]  # the cut-off sample answered again, every row once
    again = json.loads((out / "scores.json").read_text(encoding="utf-8"))
    assert again == parts


def with_id_prefix(path: Path, prefix: str) -> Path:
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    path.write_text("".join(json.dumps({**r, "id": prefix + r["id"]}) + "\n" for r in records), encoding="utf-8")
    return path


def test_eval_files_sharing_a_sample_id_are_refused_before_anything_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = write_qa_file(tmp_path / "eval.jsonl", questions=2, chunks=2, seed=2)
    out = tmp_path / "sweep"
    argv = ["--model", "unused", "--distill-data", str(data), "--eval-data", str(data), "--eval-data", str(data)]
    assert main([*argv, "--out", str(out), "--variant", "a:steps=1"]) == 2
    assert "is in two eval files" in capsys.readouterr().err
    assert not (out / "logs").exists()


def test_joined_samples_are_keyed_as_their_answers_are_read_with_or_without_ids(tmp_path: Path) -> None:
    """Per-file scores pick each file's samples from the answers by these keys: an id where a sample has one, else
    its line in the joined file (what `kvstitch eval --answers` writes as `line` and `score_answers` falls back to)."""
    plain = write_qa_file(tmp_path / "plain.jsonl", questions=2, chunks=2, seed=2)
    records = [json.loads(line) for line in plain.read_text(encoding="utf-8").splitlines()]
    plain.write_text("\n" + "".join(json.dumps({k: v for k, v in r.items() if k != "id"}) + "\n" for r in records))
    named = with_id_prefix(write_qa_file(tmp_path / "named.jsonl", questions=1, chunks=2, seed=3), "b-")
    joined = tmp_path / "joined.jsonl"

    sets = join_eval_data([named, plain], joined)

    assert sets == {"named": {"b-q000000"}, "plain": {"2", "3"}}
    lines = joined.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 3 and "id" not in json.loads(lines[1]) and json.loads(lines[0])["id"] == "b-q000000"
    answers = tmp_path / "answers.jsonl"
    rows = [{"id": "b-q000000", "line": 1}, {"id": None, "line": 2}, {"id": None, "line": 3}]
    answers.write_text("".join(json.dumps({**r, "variant": "naive/-/none"}) + "\n" for r in rows))
    assert set(read_run([str(answers)])["naive/-/none"]) == sets["named"] | sets["plain"]


def test_every_eval_shard_resumes() -> None:
    args = argparse.Namespace(out=Path("sweep"), shards=2, eval_args="--device cpu", base_eval_args="")
    jobs = eval_jobs(args, {BASE: "base-model", "a": "sweep/a"}, samples=3)
    assert [j.label for j in jobs] == ["eval base shard 0", "eval base shard 1", "eval a shard 0", "eval a shard 1"]
    for job in jobs:
        answers = job.command[job.command.index("--answers") + 1]
        assert Path(answers).parent == Path("sweep/answers") and "--resume" in job.command


def _answers(path: Path, rows: dict[str, list[int]]) -> None:
    """Records of samples s0, s1, ... per row: correct where the sample's number is even."""
    records = [
        {"id": f"s{i}", "line": i + 1, "variant": row, "correct": i % 2 == 0, "first_token_agreement": True}
        for row, numbers in rows.items()
        for i in numbers
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


TURBO = "turbo@prefix/reordered/none"


def test_rows_lacking_samples_are_all_scored_on_the_samples_every_row_answered(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = argparse.Namespace(out=tmp_path, base_answers=None)
    _answers(tmp_path / "answers" / "base_0.jsonl", {NAIVE: [0, 1, 2, 3], TURBO: [0, 1, 2, 3]})
    _answers(tmp_path / "answers" / "a_0.jsonl", {NAIVE: [0, 1, 2, 3], TURBO: [0, 1, 3]})  # cut off before s2
    _answers(tmp_path / "answers" / "b_0.jsonl", {NAIVE: [0, 1, 2]})  # a shard of s3 failed
    sets = {"x": {"s0", "s1"}, "y": {"s1", "s2"}, "z": {"s2", "s3"}}

    text = scores(args, ["a", "b"], sets)

    assert text.startswith("scored on the 2 of 4 samples answered by every row\n")
    assert text == (tmp_path / "scores.md").read_text(encoding="utf-8").rstrip("\n")
    assert "z: no sample answered by every row" in text and "not tested" not in capsys.readouterr().out
    parts = json.loads((tmp_path / "scores.json").read_text(encoding="utf-8"))
    tested = [(r["run"], r["variant"], r["samples"]) for r in parts["all"]]
    assert tested == [("base", NAIVE, 2), ("base", TURBO, 2), ("a", NAIVE, 2), ("a", TURBO, 2), ("b", NAIVE, 2)]
    assert all(r["accuracy"] == 0.5 for r in parts["all"])  # s0 right, s1 wrong: s2 and s3 left out
    assert [r["samples"] for r in parts["x"]] == [2] * 5 and [r["samples"] for r in parts["y"]] == [1] * 5
    assert parts["z"] == []


def test_rows_with_no_sample_in_common_are_refused(tmp_path: Path) -> None:
    _answers(tmp_path / "answers" / "base_0.jsonl", {NAIVE: [0, 1]})
    _answers(tmp_path / "answers" / "a_0.jsonl", {NAIVE: [2]})
    with pytest.raises(ValueError, match="no sample of the 3 answered was answered by every row of every run"):
        scores(argparse.Namespace(out=tmp_path, base_answers=None), ["a"], {"x": {"s0", "s1", "s2"}})


def test_children_share_the_cores_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    from loadtest.quality_sweep import child_environment

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("MKL_NUM_THREADS", "3")
    environment = child_environment(processes=24, cores=16)
    assert environment["OMP_NUM_THREADS"] == "1" and environment["MKL_NUM_THREADS"] == "3"
    assert child_environment(processes=4, cores=16)["OMP_NUM_THREADS"] == "4"
    assert child_environment(processes=0, cores=16)["OMP_NUM_THREADS"] == "16"
