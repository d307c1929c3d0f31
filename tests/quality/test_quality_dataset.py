"""The QA JSONL parser names the file, line and field of every bad line; the table's variants per recompute spec.

(The recompute spec parser is tested with the engine, in tests/test_engine_recompute.py.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from service.engine.kv_layout import ChunkContext
from service.engine.recompute_spec import parse_recompute
from service.quality.dataset import QADataError, parse_line, read_samples
from service.quality.eval import table_variants

GOOD = {
    "question": "Where was Zorvath Keel born?",
    "chunks": ["Zorvath Keel was born in Ommeria."],
    "answers": ["Ommeria"],
}


def _line(**changes: object) -> str:
    record = {**GOOD, **changes}
    return json.dumps({k: v for k, v in record.items() if v is not None})


def test_a_good_line_keeps_its_fields_and_ignores_metadata() -> None:
    sample = parse_line(_line(id="q1", hops=1), 7, "qa.jsonl")
    assert sample.question == GOOD["question"]
    assert sample.chunks == ("Zorvath Keel was born in Ommeria.",)
    assert sample.answers == ("Ommeria",)
    assert sample.line == 7
    assert sample.id == "q1"  # kept: it names the sample in an answers file
    assert parse_line(_line(id=12), 1).id == "12" and parse_line(_line(), 1).id is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "qa.jsonl line 3: not valid JSON"),
        ("[1, 2]", "qa.jsonl line 3: must be a JSON object"),
        (_line(question=None), 'qa.jsonl line 3: "question" must be a non-empty string'),
        (_line(question="   "), 'qa.jsonl line 3: "question" must be a non-empty string'),
        (_line(question=5), 'qa.jsonl line 3: "question" must be a non-empty string'),
        (_line(chunks=[]), 'qa.jsonl line 3: "chunks" must be a non-empty list of strings'),
        (_line(chunks="one chunk"), 'qa.jsonl line 3: "chunks" must be a non-empty list of strings'),
        (_line(chunks=["ok", 3]), 'qa.jsonl line 3: "chunks" must be a non-empty list of strings'),
        (_line(chunks=["ok", ""]), 'qa.jsonl line 3: "chunks" must be a non-empty list of strings'),
        (_line(answers=None), 'qa.jsonl line 3: "answers" must be a non-empty list of strings'),
        (_line(answers=[]), 'qa.jsonl line 3: "answers" must be a non-empty list of strings'),
        (_line(answers=["Ommeria", "The"]), "qa.jsonl line 3: \"answers\"[1] 'The' is empty after answer"),
        (_line(id=["q1"]), 'qa.jsonl line 3: "id" must be a string or a number'),
    ],
)
def test_bad_lines_name_line_and_field(text: str, message: str) -> None:
    with pytest.raises(QADataError) as caught:
        parse_line(text, 3, "qa.jsonl")
    assert str(caught.value).startswith(message)


def test_line_numbers_count_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text(_line() + "\n\n" + _line(answers=[]) + "\n", encoding="utf-8")
    with pytest.raises(QADataError, match=r'^data\.jsonl line 3: "answers"'):
        read_samples(path)


def test_limit_takes_the_first_samples_but_the_whole_file_is_checked(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    lines = [_line(question=f"Question {i}?") for i in range(4)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert [s.question for s in read_samples(path, limit=2)] == ["Question 0?", "Question 1?"]
    path.write_text("\n".join([*lines, "{broken"]) + "\n", encoding="utf-8")
    with pytest.raises(QADataError, match=r"data\.jsonl line 5"):
        read_samples(path, limit=2)


def test_offset_and_limit_take_a_shard(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(_line(question=f"Question {i}?") for i in range(5)) + "\n", encoding="utf-8")
    assert [s.line for s in read_samples(path, limit=2, offset=2)] == [3, 4]
    assert [s.line for s in read_samples(path, offset=3)] == [4, 5]
    assert [s.line for s in read_samples(path, limit=9, offset=4)] == [5]
    with pytest.raises(QADataError, match=r"^data\.jsonl: --offset 5 leaves nothing of its 5 samples"):
        read_samples(path, offset=5)


def test_an_empty_file_and_non_utf8_are_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n", encoding="utf-8")
    with pytest.raises(QADataError, match=r"empty\.jsonl: no samples"):
        read_samples(empty)
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(_line().encode() + b"\n\xff\xfe\n")
    with pytest.raises(QADataError, match=r"bin\.jsonl line 2: not UTF-8"):
        read_samples(binary)


def test_table_variants_add_turbo_rows_per_recompute_and_chunk_context() -> None:
    """Both positions without recompute, reordered alone with one (composite refuses a recompute); each chunk
    context its own rows."""
    variants = table_variants([parse_recompute("none"), parse_recompute("prefix:8")])
    assert [v.label for v in variants] == [
        "naive/-/none",
        "turbo/reordered/none",
        "turbo/composite/none",
        "turbo/reordered/prefix:8",
    ]
    both = table_variants([parse_recompute("query:0.2")], [ChunkContext.ALONE, ChunkContext.PREFIX])
    assert [v.label for v in both] == ["naive/-/none", "turbo/reordered/query:0.2", "turbo@prefix/reordered/query:0.2"]
