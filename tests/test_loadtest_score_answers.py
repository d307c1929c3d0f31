"""`loadtest.score_answers`: shards of one eval joined, every row paired against the reference row over all
samples; overlapping shards and a missing reference are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest.score_answers import main
from service.quality.significance import paired


def _write(path: Path, rows: dict[str, list[bool]], ids: range) -> None:
    lines = []
    for variant, correct in rows.items():
        for i in ids:
            record = {
                "id": f"q{i}",
                "line": i + 1,
                "variant": variant,
                "correct": correct[i],
                "first_token_agreement": variant == "naive/-/none" or i % 2 == 0,
            }
            lines.append(json.dumps(record))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def test_shards_are_scored_together_against_the_reference_row(tmp_path: Path) -> None:
    naive = [True, True, False, True, False, True, True, False]
    turbo = [True, False, False, True, False, False, True, True]
    rows = {"naive/-/none": naive, "turbo@prefix/reordered/none": turbo}
    _write(tmp_path / "base_0.jsonl", rows, range(0, 5))
    _write(tmp_path / "base_1.jsonl", rows, range(5, 8))
    out = tmp_path / "rows.json"
    assert main([f"base={tmp_path}/base_*.jsonl", "--json", str(out)]) == 0
    scored = {r["variant"]: r for r in json.loads(out.read_text(encoding="utf-8"))}
    assert scored["naive/-/none"]["samples"] == 8 and scored["naive/-/none"]["accuracy"] == 5 / 8
    row = scored["turbo@prefix/reordered/none"]
    expected = paired(turbo, naive)  # the ids sort as q0..q7, the order written
    assert (row["accuracy"], row["kept"]) == (4 / 8, 0.8)
    assert (row["difference"], row["p_value"]) == (expected.difference, expected.p_value)
    assert row["first_token_agreement"] == 0.5


def test_overlapping_shards_and_a_missing_reference_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = {"naive/-/none": [True] * 4}
    _write(tmp_path / "a_0.jsonl", rows, range(0, 3))
    _write(tmp_path / "a_1.jsonl", rows, range(2, 4))
    assert main([f"a={tmp_path}/a_*.jsonl"]) == 2
    assert "sample q2 of naive/-/none is in two files" in capsys.readouterr().err
    _write(tmp_path / "a_1.jsonl", rows, range(3, 4))
    assert main([f"a={tmp_path}/a_*.jsonl", "--reference", "a:turbo"]) == 2
    assert "no row 'turbo' in run 'a'" in capsys.readouterr().err


def test_common_scores_every_row_on_the_samples_all_rows_answered(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The reference run was cut off after 5 of 8 samples: without --common the other run's rows are not tested;
    with it every row is paired on those 5, and the count is printed."""
    naive = [True, True, False, True, False, True, True, False]
    tuned = [True, False, False, True, True, False, True, True]
    _write(tmp_path / "base_0.jsonl", {"naive/-/none": naive}, range(0, 5))
    _write(tmp_path / "tuned_0.jsonl", {"naive/-/none": tuned}, range(0, 8))
    runs = [f"base={tmp_path}/base_*.jsonl", f"tuned={tmp_path}/tuned_*.jsonl"]
    out = tmp_path / "rows.json"
    assert main([*runs, "--json", str(out)]) == 0
    assert "tuned naive/-/none: 8 samples, not the reference's 5; not tested" in capsys.readouterr().out
    assert [r["run"] for r in json.loads(out.read_text(encoding="utf-8"))] == ["base"]

    assert main([*runs, "--json", str(out), "--common"]) == 0
    assert capsys.readouterr().out.startswith("5 samples answered by every row\n")
    scored = {r["run"]: r for r in json.loads(out.read_text(encoding="utf-8"))}
    expected = paired(tuned[:5], naive[:5])
    assert scored["tuned"]["samples"] == 5 and scored["tuned"]["accuracy"] == 3 / 5
    assert (scored["tuned"]["difference"], scored["tuned"]["p_value"]) == (expected.difference, expected.p_value)


def test_common_with_no_sample_in_common_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write(tmp_path / "base_0.jsonl", {"naive/-/none": [True] * 4}, range(0, 2))
    _write(tmp_path / "other_0.jsonl", {"naive/-/none": [True] * 4}, range(2, 4))
    assert main([f"base={tmp_path}/base_*.jsonl", f"other={tmp_path}/other_*.jsonl", "--common"]) == 2
    assert "no sample was answered by every row" in capsys.readouterr().err
