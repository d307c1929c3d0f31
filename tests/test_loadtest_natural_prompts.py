"""The self-distillation prompts over natural text (loadtest/natural_prompts.py): the eval's text never leaks in."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from loadtest.natural_prompts import (
    CHUNKS_PER_SAMPLE,
    EVAL_SETS,
    PASSAGE_CHARS,
    EvalSources,
    copyright_texts,
    eval_sources,
    licence_texts,
    package_texts,
    passages,
    samples,
    shingles_of,
)


def words(count: int, stem: str) -> str:
    return " ".join(f"{stem}{i}" for i in range(count)) + "."


def paragraph(stem: str) -> str:
    """About 120 words of distinct tokens in sentences of 10 words, so `sentences` finds questions in it."""
    return " ".join(words(10, f"{stem}w{s}x").capitalize() for s in range(12))


def test_the_eval_sources_name_each_kind_and_its_chunks_shingles() -> None:
    found = eval_sources()
    assert {"bzip2", "gzip", "ssh"} <= found.pages
    assert {"turtle", "hashlib", "json"} <= found.modules  # `python:json.JSONDecoder.__init__` excludes all of json
    assert {"gpl-3", "apache-2.0", "mpl-2.0"} <= found.licences
    assert {"sympy", "defusedxml"} <= found.packages
    first = json.loads(EVAL_SETS[0].read_text(encoding="utf-8").splitlines()[0])
    assert shingles_of(first["chunks"][0]) <= found.shingles


def test_set_b_sources_and_chunks_are_excluded_too() -> None:
    """Set B (real_passages_b.jsonl) confirms results found on set A: its sources are eval sources as well."""
    found = eval_sources()
    assert {"wget", "gawk", "find"} <= found.pages
    assert {"difflib", "configparser", "urllib", "email"} <= found.modules  # `python:urllib.parse` excludes urllib
    assert {"gpl-2", "lgpl-2.1", "gfdl-1.3"} <= found.licences
    assert {"xxhash", "sortedcontainers"} <= found.packages
    last = json.loads(EVAL_SETS[1].read_text(encoding="utf-8").splitlines()[-1])
    assert all(shingles_of(chunk) <= found.shingles for chunk in last["chunks"])
    assert eval_sources(EVAL_SETS[:1]).pages.isdisjoint({"wget", "gawk"})  # the assertions above can fail


def test_set_b_licences_and_their_aliases_are_not_trained_on(tmp_path: Path) -> None:
    for name in ("GPL-2", "LGPL-2.1", "GFDL-1.3", "GFDL-1.2", "BSD"):
        (tmp_path / name).write_text(f"text of {name}", encoding="utf-8")
    (tmp_path / "GFDL").symlink_to(tmp_path / "GFDL-1.3")
    found = dict(licence_texts(tmp_path, eval_sources().licences))
    assert set(found) == {"license:GFDL-1.2", "license:BSD"}


def test_shingles_ignore_case_and_edge_punctuation_and_need_eight_words() -> None:
    assert shingles_of("one two three four five six seven") == set()
    assert shingles_of("One, two three four five six seven EIGHT.") == {
        ("one", "two", "three", "four", "five", "six", "seven", "eight")
    }


def test_a_passage_quoting_an_eval_chunk_is_dropped_and_the_rest_sampled_round_robin() -> None:
    eval_chunk = paragraph("leak")
    eval_set = EvalSources(frozenset(), frozenset(), frozenset(), frozenset(), frozenset(shingles_of(eval_chunk)))
    clean = "\n\n".join(paragraph(f"a{i}") for i in range(5))
    quoting = "\n\n".join([*(paragraph(f"b{i}") for i in range(4)), eval_chunk])
    made = samples(40, seed=3, texts=[("pkg:clean", clean), ("copyright:quoting", quoting)], eval_set=eval_set)

    assert [m["source"] for m in made].count("pkg:clean") == 20  # round-robin: neither source dominates
    for sample in made:
        chunks = sample["chunks"]
        assert isinstance(chunks, list) and len(chunks) == CHUNKS_PER_SAMPLE and len(set(chunks)) == CHUNKS_PER_SAMPLE
        assert all("leakw" not in chunk for chunk in chunks)
        answer = sample["answers"][0]  # type: ignore[index]
        assert any(answer in chunk for chunk in chunks)
        assert all(chunk in (clean if sample["source"] == "pkg:clean" else quoting) for chunk in chunks)


def test_a_source_left_under_four_passages_by_the_shingles_is_not_used() -> None:
    eval_chunk = paragraph("leak")
    eval_set = EvalSources(frozenset(), frozenset(), frozenset(), frozenset(), frozenset(shingles_of(eval_chunk)))
    three_and_a_quote = "\n\n".join([*(paragraph(f"c{i}") for i in range(3)), eval_chunk])
    with pytest.raises(SystemExit, match="four passages"):
        samples(4, seed=0, texts=[("license:x", three_and_a_quote)], eval_set=eval_set)


def test_licences_skip_the_eval_licence_its_aliases_and_family(tmp_path: Path) -> None:
    for name in ("GPL-3", "LGPL-3", "GPL-2", "BSD"):
        (tmp_path / name).write_text(f"text of {name}", encoding="utf-8")
    (tmp_path / "GPL").symlink_to(tmp_path / "GPL-3")
    found = dict(licence_texts(tmp_path, frozenset({"gpl-3"})))
    assert found == {"license:BSD": "text of BSD", "license:GPL-2": "text of GPL-2"}
    assert list(licence_texts(tmp_path / "absent", frozenset())) == []


def test_copyright_files_skip_packages_named_like_eval_sources_and_stop_at_the_limit(tmp_path: Path) -> None:
    for package in ("bzip2", "libbz2-1.0", "zlib1g", "coreutils", "libpng16-16"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "copyright").write_text(f"copyright of {package}", encoding="utf-8")
    found = dict(copyright_texts(tmp_path, frozenset({"bzip2"}), 10, random.Random(0)))
    assert set(found) == {"copyright:libbz2-1.0", "copyright:zlib1g", "copyright:coreutils", "copyright:libpng16-16"}
    assert len(list(copyright_texts(tmp_path, frozenset(), 2, random.Random(0)))) == 2


def test_package_descriptions_skip_the_eval_packages_and_this_project() -> None:
    found = dict(package_texts(frozenset({"sympy", "pydantic-core"})))
    assert "pkg:sympy" not in found and "pkg:pydantic-core" not in found and "pkg:kvstitch" not in found
    assert "pkg:pydantic" in found and "Pydantic" in found["pkg:pydantic"]


def test_a_passage_of_few_words_but_many_characters_is_dropped() -> None:
    """A README's badge row: under 200 words, 50,000 characters, 28,000 tokens; the prose beside it stays."""
    long_url = "https://example.org/" + "x" * 400
    badges = " ".join(f"[![badge{i}]({long_url}/{i}.svg)](https://example.org/{i})" for i in range(100))
    prose = paragraph("p")
    found = passages(f"{prose}\n\n{badges}\n\n{paragraph('q')}")
    assert len(badges.split()) <= 200 < len(badges) // PASSAGE_CHARS * 100
    assert found == [prose, paragraph("q")]
    assert all(len(passage) <= PASSAGE_CHARS for passage in found)
