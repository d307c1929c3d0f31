"""`kvstitch make-qa`: deterministic per seed, parseable by the eval, answers in the chunks, two-fact questions
that really need two chunks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from service.cli import main
from service.quality.dataset import parse_line, read_samples
from service.quality.generator import generate_records
from service.quality.metrics import contains_answer


def _make(tmp_path: Path, name: str, *args: str) -> Path:
    out = tmp_path / name
    assert main(["make-qa", "--out", str(out), *args]) == 0
    return out


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path: Path) -> None:
    first = _make(tmp_path, "a.jsonl", "--questions", "20", "--chunks", "5", "--seed", "7")
    again = _make(tmp_path, "b.jsonl", "--questions", "20", "--chunks", "5", "--seed", "7")
    other = _make(tmp_path, "c.jsonl", "--questions", "20", "--chunks", "5", "--seed", "8")
    assert first.read_bytes() == again.read_bytes()
    assert first.read_bytes() != other.read_bytes()


def test_every_line_passes_the_eval_parser(tmp_path: Path) -> None:
    path = _make(tmp_path, "qa.jsonl", "--questions", "30", "--chunks", "4", "--seed", "1", "--two-fact-share", "0.4")
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 30
    samples = [parse_line(text, n, path.name) for n, text in enumerate(lines, start=1)]
    assert samples == read_samples(path)
    assert all(len(s.chunks) == 4 for s in samples)
    assert len({s.question for s in samples}) == 30


def test_answers_are_in_the_chunks_and_two_fact_questions_need_two_chunks() -> None:
    records = list(generate_records(questions=40, chunks=5, seed=3, two_fact_share=0.5))
    two_fact = [r for r in records if r["hops"] == 2]
    assert len(two_fact) == 20
    for r in records:
        chunks, answers = r["chunks"], r["answers"]
        assert isinstance(chunks, list) and isinstance(answers, list)
        holding = [c for c in chunks if contains_answer(c, answers)]
        assert holding, r
        if r["hops"] == 2:
            org = str(r["question"]).split("founder of the ", 1)[1].removesuffix(" born?")
            naming_org = [c for c in chunks if org in c]
            # The organisation's chunk names the founder but not the answer; the answer's chunk never names it.
            assert naming_org and not any(contains_answer(c, answers) for c in naming_org)
            founder = naming_org[0].split(" was founded by ", 1)[1].split(" in ", 1)[0]
            assert any(c.startswith(f"{founder} was born") for c in holding)


def test_each_question_has_a_near_miss_entity() -> None:
    for r in generate_records(questions=10, chunks=3, seed=5, two_fact_share=0.0):
        assert isinstance(r["chunks"], list)
        chunks = [str(c) for c in r["chunks"]]
        subjects = [c.split(" was ", 1)[0].removeprefix("The ") for c in chunks]
        near = [
            (a, b)
            for i, a in enumerate(subjects)
            for b in subjects[i + 1 :]
            if len(a) == len(b) and sum(x != y for x, y in zip(a, b, strict=True)) == 1
        ]
        assert near, subjects


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--questions", "0", "--chunks", "3"], "--questions must be at least 1"),
        (["--questions", "5", "--chunks", "1", "--two-fact-share", "0.2"], "--chunks must be at least 2"),
        (["--questions", "5", "--chunks", "3", "--two-fact-share", "1.5"], "--two-fact-share must be within 0..1"),
    ],
)
def test_bad_options_exit_2(tmp_path: Path, args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["make-qa", "--out", str(tmp_path / "x.jsonl"), "--seed", "1", *args]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x.jsonl").exists()


def test_one_chunk_is_enough_without_two_fact_questions(tmp_path: Path) -> None:
    path = _make(tmp_path, "one.jsonl", "--questions", "5", "--chunks", "1", "--seed", "2", "--two-fact-share", "0")
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert all(len(r["chunks"]) == 1 and contains_answer(r["chunks"][0], r["answers"]) for r in records)
