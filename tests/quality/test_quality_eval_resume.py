"""`kvstitch eval --resume`: a run cut off mid-range answers only what its answers file lacks, drops a partly
answered sample's records, tables the whole range, and refuses an answers file it did not write."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from service.cli import main
from service.quality.answers import resume_answers, run_fingerprint, sample_key
from service.quality.commands import DEFAULT_INSTRUCTION
from service.quality.dataset import QADataError
from service.quality.generator import write_qa_file

ROWS = ("naive/-/none", "turbo@prefix/reordered/none", "turbo@prefix/composite/none")  # the default rows, in order


@pytest.fixture(scope="module")
def whole_run(tiny_model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One uninterrupted eval of 4 samples: its data, answers file and JSON."""
    folder = tmp_path_factory.mktemp("whole")
    data = write_qa_file(folder / "qa.jsonl", questions=4, chunks=3, seed=11, two_fact_share=0.5)
    paths = {"model": tiny_model_dirs["llama"], "data": data, "answers": folder / "a.jsonl", "json": folder / "a.json"}
    assert _eval(paths["model"], data, paths["answers"], paths["json"]) == 0
    return paths


def _eval(model: Path, data: Path, answers: Path, out: Path, *extra: str) -> int:
    argv = ["eval", "--model", str(model), "--data", str(data), "--device", "cpu", "--max-new-tokens", "4"]
    return main([*argv, "--answers", str(answers), "--json", str(out), *extra])


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _write(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _untimed(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k != "ttft_ms"} for r in records]


def test_a_resumed_run_answers_only_what_is_left_and_tables_the_whole_range(
    whole_run: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    whole = _lines(whole_run["answers"])
    assert [r["variant"] for r in whole] == list(ROWS) * 4
    kept = [{**r, "answer": "KEPT"} for r in whole[:3]]  # sample 1 finished; a re-answer would not say KEPT
    partial = {**whole[3], "answer": "PARTIAL"}  # sample 2 cut off after its first row
    cut = _write(tmp_path / "cut.jsonl", [*kept, partial])
    capsys.readouterr()

    assert _eval(whole_run["model"], whole_run["data"], cut, tmp_path / "r.json", "--resume") == 0

    resumed = _lines(cut)
    assert resumed[:3] == kept  # read back, not answered again
    assert len(resumed) == 3 + 3 * 3 and not any(r["answer"] == "PARTIAL" for r in resumed)  # 3 samples answered
    keys = [(sample_key(r["id"], r["line"]), r["variant"]) for r in resumed]
    assert len(set(keys)) == len(keys) == 12  # the partial sample's first row is in the file once
    assert _untimed(resumed[3:]) == _untimed(whole[3:])
    report, original = (json.loads(p.read_text(encoding="utf-8")) for p in (tmp_path / "r.json", whole_run["json"]))
    assert (report["samples"], report["resumed_samples"], original["resumed_samples"]) == (4, 1, 0)
    assert _untimed(report["rows"]) == _untimed(original["rows"])  # the whole range, as one run tables it
    printed = capsys.readouterr()
    assert "1 of 4 samples answered by every row, 1 records of partly answered samples removed, 3 to answer" in (
        printed.err
    )
    assert "4 samples (1 read back from the answers file), greedy, up to 4 new tokens" in printed.out


def _no_model_loads(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("a finished range loaded the model")


def test_a_finished_range_is_tabled_from_its_answers_without_loading_the_model(
    whole_run: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    answers = tmp_path / "done.jsonl"
    answers.write_bytes(whole_run["answers"].read_bytes())
    monkeypatch.setattr("service.engine.model.load_model", _no_model_loads)  # the same --model: the same run

    assert _eval(whole_run["model"], whole_run["data"], answers, tmp_path / "r.json", "--resume") == 0

    assert answers.read_bytes() == whole_run["answers"].read_bytes()
    report, original = (json.loads(p.read_text(encoding="utf-8")) for p in (tmp_path / "r.json", whole_run["json"]))
    assert (report["samples"], report["resumed_samples"]) == (4, 4)
    assert report["rows"] == original["rows"]  # every number read back, the TTFTs included


def test_without_resume_an_existing_answers_file_is_overwritten(whole_run: dict[str, Path], tmp_path: Path) -> None:
    answers = _write(tmp_path / "old.jsonl", [{"not": "an answer"}])
    assert _eval(whole_run["model"], whole_run["data"], answers, tmp_path / "r.json", "--limit", "1") == 0
    assert [r["variant"] for r in _lines(answers)] == list(ROWS)


RUN = run_fingerprint("model", "qa.jsonl", 4, "", "float32")


def _record(sample_id: str, variant: str, gold: list[str], **changes: Any) -> dict[str, Any]:
    answered = bool(gold)
    record = {
        "id": sample_id,
        "line": 1,
        "variant": variant,
        "answer": "Paris",
        "gold": gold,
        "correct": True if answered else None,
        "contains": True if answered else None,
        "f1": 1.0 if answered else None,
        "reference_correct": False if answered else None,
        "first_token_agreement": True,
        "answer_agreement": False,
        "kl_first_token": 0.25,
        "ttft_ms": 3.5,
        "run": RUN,
    }
    return {**record, **changes}


GOLDS = {"q1": ("Paris",), "q2": ("Rome",), "q3": ("Oslo",)}


def test_partly_answered_samples_are_removed_from_the_file_and_finished_ones_kept(tmp_path: Path) -> None:
    finished = [_record("q1", row, ["Paris"]) for row in ROWS]
    partial = [_record("q2", row, ["Rome"]) for row in ROWS[:2]]
    path = tmp_path / "answers.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [partial[0], *finished, partial[1]]), encoding="utf-8")

    resumed = resume_answers(path, GOLDS, ROWS, RUN)

    assert (resumed.kept, resumed.done, resumed.dropped) == (finished, frozenset({"q1"}), 2)
    assert _lines(path) == finished
    assert [p.name for p in tmp_path.iterdir()] == ["answers.jsonl"]  # the temporary file was moved over it


def test_a_last_record_without_its_newline_gets_one_before_anything_is_appended(tmp_path: Path) -> None:
    records = [_record("q1", row, ["Paris"]) for row in ROWS]
    path = tmp_path / "answers.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records), encoding="utf-8")
    assert resume_answers(path, GOLDS, ROWS, RUN).dropped == 0
    assert path.read_text(encoding="utf-8").endswith("}\n") and _lines(path) == records


def test_no_answers_file_yet_resumes_nothing(tmp_path: Path) -> None:
    resumed = resume_answers(tmp_path / "none.jsonl", GOLDS, ROWS, RUN)
    assert (resumed.kept, resumed.done, resumed.dropped) == ([], frozenset(), 0)
    assert not (tmp_path / "none.jsonl").exists()


GOOD = json.dumps(_record("q1", ROWS[0], ["Paris"]))


@pytest.mark.parametrize(
    ("second_line", "message"),
    [
        ('{"id": "q1", "line"', "line 2: not a JSON record"),
        ("[1, 2]", "line 2: not a JSON object"),
        (json.dumps({k: v for k, v in _record("q2", ROWS[0], ["Rome"]).items() if k != "ttft_ms"}), 'no "ttft_ms"'),
        (json.dumps(_record("q2", ROWS[0], ["Rome"], correct="yes")), '"correct" must be bool or null, not "yes"'),
        (json.dumps(_record("q2", ROWS[0], ["Rome"], line=True)), 'line 2: "line" must be int, not true'),
        (json.dumps(_record("q2", ROWS[0], ["Rome"], f1=None)), "must be set exactly when"),
        (json.dumps(_record("q9", ROWS[0], ["Rome"])), "line 2: sample q9 is not in this run's --offset/--limit range"),
        (json.dumps(_record("q2", "turbo/reordered/prefix:8", ["Rome"])), "line 2: row turbo/reordered/prefix:8 is"),
        (json.dumps(_record("q2", ROWS[0], ["Roma"])), "line 2: sample q2's gold answers differ from the data file's"),
        (GOOD, "line 2: sample q1 of row naive/-/none is in the file twice"),
        (
            json.dumps({k: v for k, v in _record("q2", ROWS[0], ["Rome"]).items() if k != "run"}),
            'no "run" (written before --resume checked the run\'s settings, so which run wrote it is unknown: '
            "start the run afresh, without --resume)",
        ),
        (json.dumps(_record("q2", ROWS[0], ["Rome"], run=7)), '"run" must be str, not 7'),
        (
            json.dumps(_record("q2", ROWS[0], ["Rome"], run="0123456789abcdef")),
            f"line 2: written by a run of other settings (run 0123456789abcdef, this run's is {RUN}: ",
        ),
    ],
)
def test_an_answers_file_this_run_did_not_write_is_refused_naming_its_line(
    tmp_path: Path, second_line: str, message: str
) -> None:
    path = tmp_path / "answers.jsonl"
    path.write_text(f"{GOOD}\n{second_line}\n", encoding="utf-8")
    before = path.read_bytes()
    with pytest.raises(QADataError) as refused:
        resume_answers(path, GOLDS, ROWS, RUN)
    assert str(refused.value).startswith(f"{path} line 2: ") and message in str(refused.value)
    assert path.read_bytes() == before  # nothing dropped, nothing rewritten


def test_a_cut_off_last_line_is_refused_not_dropped(tmp_path: Path) -> None:
    path = tmp_path / "answers.jsonl"
    path.write_text(f"{GOOD}\n{GOOD[:40]}", encoding="utf-8")
    with pytest.raises(QADataError, match=r"line 2: not a JSON record .*without a newline: a cut-off write\?"):
        resume_answers(path, GOLDS, ROWS, RUN)


def test_the_cli_refuses_a_malformed_answers_file_before_loading_the_model(
    whole_run: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    answers = tmp_path / "bad.jsonl"
    answers.write_text(whole_run["answers"].read_text(encoding="utf-8") + "not json\n", encoding="utf-8")
    assert _eval(tmp_path / "no-model", whole_run["data"], answers, tmp_path / "r.json", "--resume") == 2
    assert f"error: {answers} line 13: not a JSON record" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


def test_resume_needs_an_answers_file_and_a_qa_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = write_qa_file(tmp_path / "qa.jsonl", questions=1, chunks=2, seed=1)
    assert main(["eval", "--model", "unused", "--data", str(data), "--resume"]) == 2
    assert "--resume takes --data FILE.jsonl and --answers FILE" in capsys.readouterr().err


def test_a_batched_runs_untimed_answers_resume_and_the_table_times_only_the_timed(
    whole_run: dict[str, Path], tmp_path: Path
) -> None:
    """A `--batch 2` run writes `ttft_ms: null` (nothing timed); resumed one at a time, its records are read back,
    the rest answered, and the TTFT column is the median of the timed answers alone."""
    answers = tmp_path / "b.jsonl"
    args = (whole_run["model"], whole_run["data"], answers)
    assert _eval(*args, tmp_path / "b.json", "--limit", "2", "--batch", "2") == 0
    batched = _lines(answers)
    assert len(batched) == 2 * len(ROWS) and all(r["ttft_ms"] is None for r in batched)

    assert _eval(*args, tmp_path / "r.json", "--resume") == 0

    resumed = _lines(answers)
    assert resumed[:6] == batched and all(r["ttft_ms"] > 0 for r in resumed[6:]) and len(resumed) == 4 * len(ROWS)
    report = json.loads((tmp_path / "r.json").read_text(encoding="utf-8"))
    assert (report["samples"], report["resumed_samples"]) == (4, 2)
    for row, label in zip(report["rows"], ROWS, strict=True):
        timed = sorted(r["ttft_ms"] for r in resumed[6:] if r["variant"] == label)
        assert row["ttft_ms"] == pytest.approx(sum(timed) / 2)  # the median of the two timed answers


def test_every_record_carries_the_fingerprint_of_the_settings_that_change_answers(whole_run: dict[str, Path]) -> None:
    expected = run_fingerprint(str(whole_run["model"]), str(whole_run["data"]), 4, DEFAULT_INSTRUCTION, "float32")
    assert {r["run"] for r in _lines(whole_run["answers"])} == {expected}
    assert len(expected) == 16 and int(expected, 16) >= 0  # 16 hex digits


@pytest.mark.parametrize(
    ("changed", "changes"),
    [
        ("model", {"model": "other-model"}),
        ("data file", {"data": "other.jsonl"}),
        ("max_new_tokens", {"max_new_tokens": 5}),
        ("instruction", {"instruction": "Answer in French."}),
        ("dtype", {"dtype": "bfloat16"}),
    ],
)
def test_the_fingerprint_changes_with_each_setting_but_not_the_data_files_folder(
    changed: str, changes: dict[str, Any]
) -> None:
    settings: dict[str, Any] = {
        "model": "m",
        "data": "runs/qa.jsonl",
        "max_new_tokens": 4,
        "instruction": "",
        "dtype": "float32",
    }
    base = run_fingerprint(**settings)
    assert run_fingerprint(**{**settings, **changes}) != base, changed
    assert run_fingerprint(**{**settings, "data": "/elsewhere/qa.jsonl"}) == base


def _cut_answers(whole_run: dict[str, Path], folder: Path) -> Path:
    """The whole run's answers file cut off mid-sample: a resume that went ahead would rewrite it."""
    return _write(folder / "cut.jsonl", _lines(whole_run["answers"])[:4])


@pytest.mark.parametrize(
    "other_settings",
    [("--max-new-tokens", "5"), ("--instruction", "Answer in one word."), ("--instruction", "")],
)
def test_a_resume_with_other_settings_is_refused_and_leaves_the_file_as_it_was(
    whole_run: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], other_settings: tuple[str, str]
) -> None:
    answers = _cut_answers(whole_run, tmp_path)
    before = answers.read_bytes()
    written = _lines(answers)[0]["run"]

    assert _eval(whole_run["model"], whole_run["data"], answers, tmp_path / "r.json", "--resume", *other_settings) == 2

    err = capsys.readouterr().err
    assert f"error: {answers} line 1: written by a run of other settings (run {written}, this run's is " in err
    assert written not in err.split("this run's is ")[1]  # the expected fingerprint is another
    assert answers.read_bytes() == before  # the partial sample's record not removed: nothing rewritten
    assert not (tmp_path / "r.json").exists()


def test_the_fingerprint_ignores_the_device_but_not_its_default_dtype(
    whole_run: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The whole run was CPU fp32; `--device cuda --dtype float32` is the same run (a GPU run and a CPU run resume
    each other; the range is answered, so no model loads and no GPU is needed). The device's default dtype
    counts: cuda's is bf16, another run."""
    answers = tmp_path / "done.jsonl"
    answers.write_bytes(whole_run["answers"].read_bytes())
    elsewhere = tmp_path / "copy"  # the same data file, from another folder
    elsewhere.mkdir()
    data = elsewhere / whole_run["data"].name
    data.write_bytes(whole_run["data"].read_bytes())
    gpu = ("--resume", "--device", "cuda")  # no GPU needed: the range is answered, no model loads

    assert _eval(whole_run["model"], data, answers, tmp_path / "r.json", *gpu, "--dtype", "float32") == 0
    assert _eval(whole_run["model"], data, answers, tmp_path / "bf16.json", *gpu) == 2

    assert "written by a run of other settings" in capsys.readouterr().err
    assert answers.read_bytes() == whole_run["answers"].read_bytes()
    report = json.loads((tmp_path / "r.json").read_text(encoding="utf-8"))
    assert (report["samples"], report["resumed_samples"]) == (4, 4)
