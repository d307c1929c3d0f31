"""The real-passage QA sets (loadtest/qa/real_passages.jsonl, set A, and real_passages_b.jsonl, set B) keep their
promises: enough samples, four passages each, every answer verbatim (after the eval's normalisation) in exactly one
passage (the gold one) and not in the question, unique ids, passages of 60-200 words, the gold index spread over
the positions, and every source named in the README with its licence file shipped. The two sets share no source
and no id, so that set B can confirm what set A finds."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from service.quality.dataset import read_samples
from service.quality.metrics import normalize_answer

QA = Path(__file__).resolve().parents[2] / "loadtest" / "qa"
SET_A = QA / "real_passages.jsonl"
SET_B = QA / "real_passages_b.jsonl"
# The fewest samples each set promises (set B was written larger: it confirms results found on set A).
MINIMUM = {SET_A: 120, SET_B: 150}


def _contains(text: str, answer: str) -> bool:
    """Whole-word containment after normalisation: the eval's `contains_answer` rule."""
    return f" {normalize_answer(answer)} " in f" {normalize_answer(text)} "


def _read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


@pytest.fixture(scope="module", params=[SET_A, SET_B], ids=["set-a", "set-b"])
def data(request: pytest.FixtureRequest) -> Path:
    path: Path = request.param
    return path


@pytest.fixture(scope="module")
def records(data: Path) -> list[dict[str, Any]]:
    return _read(data)


def test_the_eval_reads_every_sample(data: Path, records: list[dict[str, Any]]) -> None:
    samples = read_samples(data)
    assert len(samples) == len(records) >= MINIMUM[data]
    assert [s.id for s in samples] == [r["id"] for r in records]


def test_ids_are_unique_and_samples_have_four_chunks(records: list[dict[str, Any]]) -> None:
    ids = [r["id"] for r in records]
    assert len(set(ids)) == len(ids)
    assert all(len(r["chunks"]) == 4 for r in records)
    assert all(len(r["chunk_sources"]) == 4 for r in records)


def test_every_answer_is_in_the_gold_chunk_only(records: list[dict[str, Any]]) -> None:
    for record in records:
        for answer in record["answers"]:
            assert normalize_answer(answer), (record["id"], answer)
            holders = [i for i, chunk in enumerate(record["chunks"]) if _contains(chunk, answer)]
            assert holders == [record["gold"]], (record["id"], answer, holders)
            assert not _contains(record["question"], answer), (record["id"], answer)


def test_answers_are_short_and_passages_sized(records: list[dict[str, Any]]) -> None:
    for record in records:
        assert all(1 <= len(a.split()) <= 6 for a in record["answers"]), record["id"]
        assert all(60 <= len(c.split()) <= 200 for c in record["chunks"]), record["id"]
        assert record["question"].endswith("?"), record["id"]


def test_distractors_come_from_the_gold_source_family(records: list[dict[str, Any]]) -> None:
    """Hard distractors: the same kind of source as the gold (a manual page among manual pages, a docstring among
    docstrings, ...), and for most samples the very same source."""
    same = 0
    for record in records:
        kinds = {s.split(":")[0] for s in record["chunk_sources"]}
        assert kinds == {record["source"].split(":")[0]}, record["id"]
        assert record["chunk_sources"][record["gold"]] == record["source"]
        same += record["chunk_sources"].count(record["source"]) == 4
    assert same >= len(records) // 2


def test_the_gold_index_varies(records: list[dict[str, Any]]) -> None:
    counts = Counter(r["gold"] for r in records)
    assert set(counts) == {0, 1, 2, 3}
    assert max(counts.values()) - min(counts.values()) <= 2


def test_at_least_three_kinds_of_source_each_named_with_a_shipped_licence(records: list[dict[str, Any]]) -> None:
    readme = (QA / "README.md").read_text(encoding="utf-8")
    assert len({r["source"].split(":")[0] for r in records}) >= 3
    named = set(re.findall(r"`((?:man|python|license|pkg):[^`\[]+)", readme))
    for record in records:
        source = record["source"]
        assert source in named or source.startswith("python:"), source
        licence_file = re.search(r"\(licenses/([^)]+)\)", record["license"])
        assert licence_file and (QA / "licenses" / licence_file.group(1)).is_file(), record["license"]


def _source_key(source: str) -> str:
    """What a source is, for disjointness: a standard-library module by its top-level package
    (`python:urllib.parse.urlsplit` is `python:urllib`), any other source by its lower-cased name."""
    kind, _, name = source.partition(":")
    return f"{kind}:{name.split('.')[0]}" if kind == "python" else f"{kind}:{name.lower()}"


def test_the_two_sets_share_no_source_and_no_id() -> None:
    set_a, set_b = _read(SET_A), _read(SET_B)
    sources_a = {_source_key(s) for r in set_a for s in [r["source"], *r["chunk_sources"]]}
    sources_b = {_source_key(s) for r in set_b for s in [r["source"], *r["chunk_sources"]]}
    assert sources_a and sources_b
    assert sources_a.isdisjoint(sources_b), sorted(sources_a & sources_b)
    assert {r["id"] for r in set_a}.isdisjoint({r["id"] for r in set_b})
    chunks_a = {c for r in set_a for c in r["chunks"]}
    assert chunks_a.isdisjoint({c for r in set_b for c in r["chunks"]})
