"""The measured default recompute (`service/quality/measured.py`): which row `kvstitch eval --recommend` chooses,
the file it writes (atomic, self-checked on read), and what a server makes of it (`default_recompute`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from service.engine.recompute_spec import NO_RECOMPUTE, parse_recompute
from service.quality.measured import (
    MAX_FILE_BYTES,
    MEASURED,
    MEASURED_FILE,
    Candidate,
    MeasuredFileError,
    MeasuredRecompute,
    choose,
    default_recompute,
    read_measured,
    write_measured,
)
from service.settings import Settings

ROWS = (
    Candidate("none", "alone", 0.10, 0.40),
    Candidate("none", "prefix", 0.15, 0.60),
    Candidate("selective:0.2", "alone", 0.22, 0.88),
    Candidate("selective:0.2", "prefix", 0.21, 0.86),
    Candidate("selective:0.25", "alone", 0.24, 0.96),
)


def _measured(**changes: Any) -> MeasuredRecompute:
    fields: dict[str, Any] = {
        "recompute": "selective:0.2",
        "chunk_context": "alone",
        "met": True,
        "keep": 0.85,
        "fingerprint": "f" * 64,
        "dtype": "bfloat16",
        "samples": 342,
        "naive_accuracy": 0.25,
        "data": "real_passages.jsonl",
        "candidates": ROWS,
    }
    return MeasuredRecompute(**{**fields, **changes})


def test_the_first_recompute_in_order_that_keeps_enough_wins_in_its_more_accurate_context() -> None:
    assert choose(ROWS, 0.85) == (ROWS[2], True)  # selective:0.2 passes in both contexts; alone is more accurate
    assert choose(ROWS, 0.5) == (ROWS[1], True)  # plain turbo after the prefix already keeps 60 %
    assert choose(ROWS, 0.9) == (ROWS[4], True)  # only selective:0.25 keeps 90 %


def test_when_nothing_keeps_enough_the_most_accurate_row_is_chosen_and_flagged() -> None:
    assert choose(ROWS, 0.99) == (ROWS[4], False)
    with pytest.raises(ValueError, match="nothing to choose from"):
        choose([], 0.85)


def test_a_written_measurement_reads_back_equal_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    measured = _measured()

    path = write_measured(tmp_path, measured)

    assert path == tmp_path / MEASURED_FILE
    assert read_measured(path) == measured and read_measured(path).chosen == ROWS[2]
    assert sorted(p.name for p in tmp_path.iterdir()) == [MEASURED_FILE]


def _corrupt(tmp_path: Path, edit: Any) -> Path:
    data = _measured().as_json()
    edit(data)
    path = tmp_path / MEASURED_FILE
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(format="other/1"), "format is not"),
        (lambda d: d.update(recompute="selective:2"), "selective:R needs R"),
        (lambda d: d.update(recompute="selective:0.3"), "chosen setting is none of its candidates"),
        (lambda d: d.update(chunk_context="middle"), "chunk_context must be one of"),
        (lambda d: d.update(samples=True), "samples must be a int"),
        (lambda d: d.update(samples=0), "samples must be at least 1"),
        (lambda d: d.update(keep=1.5), "keep must be a number within 0..1"),
        (lambda d: d.pop("fingerprint"), "'fingerprint'"),
        (lambda d: d.update(candidates=[]), "candidates must be a list of 1..1000 rows"),
        (lambda d: d["candidates"][0].update(kept=float("nan")), "kept must be a number"),
    ],
)
def test_a_malformed_file_is_refused_naming_it_and_the_field(tmp_path: Path, edit: Any, message: str) -> None:
    path = _corrupt(tmp_path, edit)

    with pytest.raises(MeasuredFileError, match=message) as refused:
        read_measured(path)
    assert str(path) in str(refused.value)


def test_a_file_that_is_no_json_or_too_large_is_refused(tmp_path: Path) -> None:
    path = tmp_path / MEASURED_FILE
    path.write_bytes(b"\x80not json")
    with pytest.raises(MeasuredFileError, match="not JSON"):
        read_measured(path)
    path.write_bytes(b" " * (MAX_FILE_BYTES + 1))
    with pytest.raises(MeasuredFileError, match="larger than"):
        read_measured(path)


def test_the_server_default_is_the_measurement_only_for_its_weights_and_chunk_context(tmp_path: Path) -> None:
    write_measured(tmp_path, _measured())
    model = str(tmp_path)

    applied = default_recompute(MEASURED, model, "f" * 64, "alone")
    other_weights = default_recompute(MEASURED, model, "e" * 64, "alone")
    other_context = default_recompute(MEASURED, model, "f" * 64, "prefix")

    assert applied.spec == parse_recompute("selective:0.2")
    assert "kept 88% of naive's accuracy on 342 samples" in applied.source
    assert not applied.unapplied and other_weights.unapplied and other_context.unapplied
    assert other_weights.spec == NO_RECOMPUTE and "not applied" in other_weights.source
    assert "other weights or another dtype" in other_weights.source
    assert other_context.spec == NO_RECOMPUTE and "chunk context alone" in other_context.source


def test_a_measurement_below_its_target_applies_and_says_so(tmp_path: Path) -> None:
    write_measured(tmp_path, _measured(recompute="selective:0.25", met=False, keep=0.99))

    default = default_recompute(MEASURED, str(tmp_path), "f" * 64, "alone")

    assert default.spec == parse_recompute("selective:0.25") and "below the 99% asked" in default.source


def test_without_a_file_or_with_a_spec_set_the_default_is_plain(tmp_path: Path) -> None:
    missing = default_recompute(MEASURED, str(tmp_path), "f" * 64, "alone")
    given = default_recompute("prefix:4", str(tmp_path), "f" * 64, "alone")
    hub_id = default_recompute(MEASURED, "org/model-on-a-hub", "f" * 64, "alone")

    assert missing.spec == NO_RECOMPUTE and f"no {MEASURED_FILE}" in missing.source and not missing.unapplied
    assert given.spec == parse_recompute("prefix:4") and given.source == "KVSTITCH_RECOMPUTE=prefix:4"
    assert hub_id.spec == NO_RECOMPUTE


def test_the_setting_defaults_to_measured_and_refuses_a_bad_spec() -> None:
    assert Settings().recompute == MEASURED
    assert Settings(recompute=" measured ").recompute == MEASURED
    with pytest.raises(ValueError, match="recompute"):
        Settings(recompute="measure")
