"""`kvstitch eval --data-dir DIR --questions FILE`: questions over a corpus ingested with `kvstitch ingest --embedded`,
retrieved as /ask retrieves them; deterministic rows, naive's self-agreement, nothing written to the data dir, and
clear exit-2 errors for bad question files and data dirs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from quality_corpus import ingest_corpus

from service.cli import main

pytestmark = pytest.mark.slow  # an embedded ingest and two evals over it: ~20 s on 2 cores

# The settings of the embedded ingest CLI tests (tests/workers): small chunks, a small host pool.
SETTINGS = {"CHUNK_SIZE": "48", "CHUNK_OVERLAP": "8", "MAX_PRECOMPUTE_TOKENS": "256", "HOST_CACHE_MB": "4"}
DOCUMENTS = {
    "otters.md": "# Otters\n\nSea otters hold hands while they sleep, so that the current does not part them.",
    "bread.txt": "Sourdough rises because wild yeast ferments the flour. The starter is fed every day.",
    "volcanoes.txt": " ".join(f"Volcano number {n} erupted {n + 3} times in {1900 + 7 * n}." for n in range(9)),
}
QUESTIONS = "Why does sourdough rise?\n\nDo otters hold hands?\nWhen did volcano number 4 erupt?\n"


@pytest.fixture
def data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_model_dirs: dict[str, Path]) -> Path:
    """A corpus ingested into an embedded data dir, with a clean KVSTITCH_* environment and no .env."""
    return ingest_corpus(tmp_path, monkeypatch, tiny_model_dirs["qwen2"], SETTINGS, DOCUMENTS)


def _eval(model: Path, data: Path, questions: Path, *extra: str) -> int:
    argv = ["eval", "--model", str(model), "--data-dir", str(data), "--questions", str(questions), "--device", "cpu"]
    return main([*argv, "--max-new-tokens", "4", *extra])


def _files(folder: Path) -> dict[str, int]:
    return {p.relative_to(folder).as_posix(): p.stat().st_size for p in folder.rglob("*") if p.is_file()}


def test_questions_over_an_ingested_corpus_repeat_and_write_nothing(
    data_dir: Path, tmp_path: Path, tiny_model_dirs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    questions = tmp_path / "questions.txt"
    questions.write_text(QUESTIONS, encoding="utf-8")
    model = tiny_model_dirs["qwen2"]
    kv_files = _files(data_dir / "kv")
    records: list[dict[str, Any]] = []
    answers = tmp_path / "answers.jsonl"
    for run in ("1", "2"):
        out = tmp_path / f"{run}.json"
        assert _eval(model, data_dir, questions, "--top-k", "2", "--json", str(out), "--answers", str(answers)) == 0
        records.append(json.loads(out.read_text(encoding="utf-8")))

    first = records[0]
    assert first["samples"] == 3 and first["top_k"] == 2 and first["questions"] == str(questions)
    assert first["instruction"] == "" and first["offset"] == 0  # the served prompt: no added instruction
    lines = [json.loads(line) for line in answers.read_text(encoding="utf-8").splitlines()]
    assert [(a["line"], a["variant"]) for a in lines[:3]] == [
        (1, "naive/-/none"),
        (1, "turbo@prefix/reordered/none"),
        (1, "turbo@prefix/composite/none"),
    ]
    assert len(lines) == 9 and {a["line"] for a in lines} == {1, 3, 4}  # question lines, the blank one skipped
    assert all(a["correct"] is None and a["f1"] is None and a["gold"] == [] for a in lines)
    strip = [[{k: v for k, v in row.items() if k != "ttft_ms"} for row in r["rows"]] for r in records]
    assert strip[0] == strip[1]  # greedy: every number but the TTFT repeats
    naive, *turbo = first["rows"]
    assert (naive["mode"], naive["answer_agreement"], naive["kl_first_token"]) == ("naive", 1.0, 0.0)
    assert [(r["positions"], r["recompute"]) for r in turbo] == [("reordered", "none"), ("composite", "none")]
    for row in first["rows"]:
        assert row["accuracy"] is None and row["f1"] is None  # no reference answers in this form
        assert 0.0 <= row["answer_agreement"] <= row["first_token_agreement"] <= 1.0
        assert row["kl_first_token"] >= 0.0 and row["ttft_ms"] > 0.0
    assert any(r["kl_first_token"] > 0.0 for r in turbo)  # the chunks really were stitched from several blocks
    assert _files(data_dir / "kv") == kv_files  # the KV cache was read by nobody and written by nobody
    table = capsys.readouterr().out
    assert "3 samples, greedy, up to 4 new tokens" in table and "naive         -          none           -  " in table
    assert " p " in table and "ci95" in table


def test_a_bad_question_file_or_data_dir_exits_2_naming_it(
    data_dir: Path, tmp_path: Path, tiny_model_dirs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    model = tiny_model_dirs["qwen2"]
    bad = tmp_path / "bad.txt"
    cases = [
        (b"Why does sourdough rise?\n\xff\xfe\n", data_dir, (), "error: bad.txt line 2: not UTF-8 text\n"),
        (b"\n  \n", data_dir, (), "error: bad.txt: no questions (one per line)\n"),
        (b"ok?\n" + b"x" * 4001 + b"\n", data_dir, (), "error: bad.txt line 2: the question has 4001 characters"),
        (b"ok?\n", data_dir, ("--top-k", "0"), "error: --top-k must be within 1..50 (KVSTITCH_MAX_TOP_K)\n"),
        (b"a?\n\nb?\n", data_dir, ("--offset", "2"), "error: bad.txt: --offset 2 leaves nothing of its 2 questions\n"),
        (b"ok?\n", tmp_path / "nowhere", (), f"error: {tmp_path / 'nowhere'}: no ingested corpus here (no qdrant/"),
    ]
    for content, folder, extra, message in cases:
        bad.write_bytes(content)
        assert _eval(model, folder, bad, *extra) == 2
        assert capsys.readouterr().err.startswith(message)
    assert not (tmp_path / "nowhere").exists()  # looking did not create a data dir
    assert main(["eval", "--model", str(model), "--data-dir", str(data_dir)]) == 2
    assert "give either --data FILE.jsonl, or --data-dir DIR with --questions FILE.txt" in capsys.readouterr().err
