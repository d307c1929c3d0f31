"""`kvstitch eval` on the tiny CPU models: deterministic rows, --limit, clear exit-2 errors, and the identities
(naive against an independent naive run agrees fully with zero KL; answers equal to the output score 1.0)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from service.cli import main
from service.engine.engine import StitchEngine
from service.engine.kv_layout import SERVED_CHUNK_CONTEXT
from service.engine.offline import OfflineScheduler, generate
from service.engine.prompt import build_template, encode
from service.engine.sampling import SamplingParams
from service.quality.commands import DEFAULT_INSTRUCTION
from service.quality.dataset import QASample, read_samples
from service.quality.eval import NAIVE, evaluate, prepare, run_variant, table_variants
from service.quality.generator import write_qa_file
from service.quality.metrics import answer_span, best_f1, contains_answer, normalize_answer, short_answer_correct

ROW_FIELDS = {
    "mode",
    "positions",
    "recompute",
    "accuracy",
    "contains",
    "f1",
    "accuracy_vs_naive",
    "p_mcnemar",
    "ci95_low",
    "ci95_high",
    "first_token_agreement",
    "answer_agreement",
    "kl_first_token",
    "ttft_ms",
}


@pytest.fixture
def qa_file(tmp_path: Path) -> Path:
    return write_qa_file(tmp_path / "qa.jsonl", questions=4, chunks=3, seed=11, two_fact_share=0.5)


def _eval_json(model: Path, data: Path, out: Path, *extra: str) -> dict[str, Any]:
    code = main(["eval", "--model", str(model), "--data", str(data), "--device", "cpu", "--json", str(out), *extra])
    assert code == 0
    record: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
    return record


def _without_timing(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows (or answers records) minus ttft_ms: wall-clock time is the one column that cannot repeat."""
    return [{k: v for k, v in row.items() if k != "ttft_ms"} for row in rows]


def test_eval_gives_the_same_numbers_twice(
    tiny_model_dirs: dict[str, Path], qa_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tiny_model_dirs["qwen2"]
    first = _eval_json(model, qa_file, tmp_path / "1.json", "--max-new-tokens", "6")
    second = _eval_json(model, qa_file, tmp_path / "2.json", "--max-new-tokens", "6")
    assert _without_timing(first["rows"]) == _without_timing(second["rows"])
    assert first["samples"] == 4 and first["max_new_tokens"] == 6
    assert [(r["mode"], r["positions"], r["recompute"]) for r in first["rows"]] == [
        ("naive", None, "none"),
        ("turbo@prefix", "reordered", "none"),
        ("turbo@prefix", "composite", "none"),
    ]
    for row in first["rows"]:
        assert set(row) == ROW_FIELDS
        assert row["first_token_agreement"] >= row["answer_agreement"]  # same answer implies same first token
        assert row["kl_first_token"] >= 0.0 and row["ttft_ms"] > 0.0
    tables = capsys.readouterr().out  # both runs' tables
    assert tables.count("4 samples, greedy, up to 6 new tokens") == 2 and tables.count("\nturbo@prefix ") == 4


def test_limit_takes_the_first_n_samples(tiny_model_dirs: dict[str, Path], qa_file: Path, tmp_path: Path) -> None:
    first_two = tmp_path / "two.jsonl"
    first_two.write_text("".join(qa_file.read_text(encoding="utf-8").splitlines(keepends=True)[:2]), encoding="utf-8")
    model = tiny_model_dirs["llama"]
    limited = _eval_json(model, qa_file, tmp_path / "limited.json", "--limit", "2", "--max-new-tokens", "4")
    direct = _eval_json(model, first_two, tmp_path / "direct.json", "--max-new-tokens", "4")
    assert limited["samples"] == direct["samples"] == 2
    assert _without_timing(limited["rows"]) == _without_timing(direct["rows"])


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_naive_against_a_separate_naive_run_agrees_fully(get_engine: Any, arch: str, tmp_path: Path) -> None:
    engine: StitchEngine = get_engine(arch)
    samples = read_samples(write_qa_file(tmp_path / "qa.jsonl", questions=3, chunks=3, seed=2))
    report = evaluate(engine, samples, [NAIVE, NAIVE, *table_variants()[1:]], max_new_tokens=5)
    naive, again, reordered, composite = report.rows
    for row in (naive, again):
        assert row.first_token_agreement == 1.0 and row.answer_agreement == 1.0
        assert row.kl_first_token == 0.0
    assert naive.accuracy == again.accuracy and naive.f1 == again.f1
    # A random model was never trained on block attention: composite positions move its first-token distribution.
    assert composite.kl_first_token > 0.0
    assert reordered.kl_first_token >= 0.0 and 0.0 <= reordered.answer_agreement <= 1.0


def _naive_answer(engine: StitchEngine, sample: QASample, tokens: int) -> str:
    chunks = [encode(engine.tokenizer, c) for c in sample.chunks]
    prompt = engine.template.prompt(chunks, engine.encode_question(sample.question))
    return generate(engine, prompt, SamplingParams(max_new_tokens=tokens), "naive").text


def test_answers_equal_to_the_naive_output_score_one(get_engine: Any, tmp_path: Path) -> None:
    engine: StitchEngine = get_engine("qwen2")
    samples = read_samples(write_qa_file(tmp_path / "qa.jsonl", questions=6, chunks=2, seed=4, two_fact_share=0.0))
    own = []
    for s in samples:
        text = answer_span(_naive_answer(engine, s, 6))  # what the short-answer rule reads of it
        if normalize_answer(text):  # the parser refuses answers that normalise to nothing
            own.append(QASample(s.question, s.chunks, (text,), s.line))
    assert own, "the tiny model produced no scorable answer"
    naive = evaluate(engine, own, [NAIVE], max_new_tokens=6).rows[0]
    assert naive.accuracy == 1.0 and naive.f1 == 1.0
    wrong = [QASample(s.question, s.chunks, ("Zzyzx Qworp",), s.line) for s in own]
    assert evaluate(engine, wrong, [NAIVE], max_new_tokens=6).rows[0].accuracy == 0.0


@pytest.mark.parametrize(
    ("third_line", "message"),
    [
        ('{"question": "Q?", "chunks": ["c"], "answers": []}', 'bad.jsonl line 3: "answers" must be a non-empty list'),
        ('{"question": "Q?", "chunks": "c", "answers": ["a"]}', 'bad.jsonl line 3: "chunks" must be a non-empty list'),
        ('{"chunks": ["c"], "answers": ["a"]}', 'bad.jsonl line 3: "question" must be a non-empty string'),
        ('{"question": "Q?", "chunks": ["c"], "answers": ["an"]}', 'bad.jsonl line 3: "answers"[0]'),
        ('"just a string"', "bad.jsonl line 3: must be a JSON object"),
        ('{"question": "Q?",', "bad.jsonl line 3: not valid JSON"),
    ],
)
def test_bad_lines_exit_2_naming_line_and_field(
    tiny_model_dirs: dict[str, Path],
    qa_file: Path,
    tmp_path: Path,
    third_line: str,
    message: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    good = qa_file.read_text(encoding="utf-8").splitlines()[:2]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join([*good, third_line, good[0]]) + "\n", encoding="utf-8")
    code = main(["eval", "--model", str(tiny_model_dirs["qwen2"]), "--data", str(bad), "--device", "cpu"])
    assert code == 2
    assert message in capsys.readouterr().err


def test_a_prompt_longer_than_the_context_names_its_line(
    tiny_model_dirs: dict[str, Path], qa_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    long_line = json.dumps({"question": "Q?", "chunks": ["word " * 5000], "answers": ["word"]})
    data = tmp_path / "long.jsonl"
    data.write_text(qa_file.read_text(encoding="utf-8").splitlines()[0] + "\n" + long_line + "\n", encoding="utf-8")
    code = main(["eval", "--model", str(tiny_model_dirs["qwen2"]), "--data", str(data), "--device", "cpu"])
    assert code == 2
    assert "long.jsonl line 2: the prompt" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("prefix:-3", "prefix:N needs N, a whole number of tokens"),
        ("selective:2", "selective:R needs R, a share of tokens within 0..1"),
        ("everything", "the kind must be none, prefix:N, selective:R[:F], query:R[:F] or auto"),
    ],
)
def test_a_malformed_recompute_spec_exits_2(
    tiny_model_dirs: dict[str, Path], qa_file: Path, spec: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["eval", "--model", str(tiny_model_dirs["qwen2"]), "--data", str(qa_file), "--device", "cpu"]
    assert main([*args, "--recompute", "none", "--recompute", spec]) == 2
    assert message in capsys.readouterr().err


def test_recompute_specs_give_rows_and_recomputing_everything_agrees_with_naive(
    tiny_model_dirs: dict[str, Path], qa_file: Path, tmp_path: Path
) -> None:
    """selective:1 and prefix:N over the longest block recompute every chunk token, which with reordered positions
    is the naive prefill: full agreement, KL at float noise. prefix:2 is a real row too; composite positions get
    no recompute rows (they refuse a recompute)."""
    extra = ["--recompute", "selective:1", "--recompute", "prefix:2", "--recompute", "prefix:4096"]
    record = _eval_json(tiny_model_dirs["qwen2"], qa_file, tmp_path / "r.json", *extra, "--max-new-tokens", "6")
    rows = {(r["positions"], r["recompute"]): r for r in record["rows"]}
    assert list(rows) == [
        (None, "none"),
        ("reordered", "selective:1"),
        ("reordered", "prefix:2"),
        ("reordered", "prefix:4096"),
    ]
    for spec in ("selective:1", "prefix:4096"):
        full = rows["reordered", spec]
        assert full["answer_agreement"] == 1.0 and full["first_token_agreement"] == 1.0
        assert full["kl_first_token"] < 1e-6
        assert full["accuracy"] == rows[None, "none"]["accuracy"] and full["f1"] == rows[None, "none"]["f1"]
    assert rows["reordered", "prefix:2"]["kl_first_token"] > rows["reordered", "selective:1"]["kl_first_token"]


def test_each_chunk_context_gets_its_rows(tiny_model_dirs: dict[str, Path], qa_file: Path, tmp_path: Path) -> None:
    """Rows for chunks precomputed alone and after the prefix: the prefix ones are labelled, and differ (their KV
    is another), while `query:1` in either context is the naive prefill again."""
    extra = ["--chunk-context", "alone", "--chunk-context", "prefix", "--recompute", "none", "--recompute", "query:1"]
    record = _eval_json(tiny_model_dirs["llama"], qa_file, tmp_path / "r.json", *extra, "--limit", "2")
    rows = {(r["mode"], r["positions"], r["recompute"]): r for r in record["rows"]}
    assert list(rows) == [
        ("naive", None, "none"),
        ("turbo", "reordered", "none"),
        ("turbo", "composite", "none"),
        ("turbo", "reordered", "query:1"),
        ("turbo@prefix", "reordered", "none"),
        ("turbo@prefix", "composite", "none"),
        ("turbo@prefix", "reordered", "query:1"),
    ]
    alone, prefix = rows["turbo", "reordered", "none"], rows["turbo@prefix", "reordered", "none"]
    assert alone["kl_first_token"] != prefix["kl_first_token"]
    for mode in ("turbo", "turbo@prefix"):
        assert rows[mode, "reordered", "query:1"]["kl_first_token"] < 1e-6


def test_recompute_none_runs_once(tiny_model_dirs: dict[str, Path], qa_file: Path, tmp_path: Path) -> None:
    extra = ["--recompute", "none", "--recompute", "none", "--limit", "1"]
    record = _eval_json(tiny_model_dirs["mistral"], qa_file, tmp_path / "r.json", *extra)
    assert [r["recompute"] for r in record["rows"]] == ["none", "none", "none"]


def test_the_first_token_distribution_is_the_one_decoding_started_from(get_engine: Any, tmp_path: Path) -> None:
    engine: StitchEngine = get_engine("llama")
    sample = read_samples(write_qa_file(tmp_path / "qa.jsonl", questions=1, chunks=4, seed=9))[0]
    case = prepare(engine, sample, max_new_tokens=3)
    sampling = SamplingParams(max_new_tokens=3)
    runner = OfflineScheduler(engine)
    for variant in table_variants():
        outcome = run_variant(runner, case, variant, sampling)
        assert int(outcome.first_logits.argmax()) == outcome.token_ids[0], variant.label
    runner.close()


def _answers(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_the_answers_file_holds_every_answer_and_adds_up_to_the_rows(
    tiny_model_dirs: dict[str, Path], qa_file: Path, tmp_path: Path
) -> None:
    answers = tmp_path / "answers.jsonl"
    record = _eval_json(
        tiny_model_dirs["qwen2"], qa_file, tmp_path / "r.json", "--answers", str(answers), "--max-new-tokens", "6"
    )
    lines = _answers(answers)
    samples = read_samples(qa_file)
    labels = [v.label for v in table_variants(contexts=[SERVED_CHUNK_CONTEXT])]
    assert [(a["id"], a["line"], a["variant"]) for a in lines] == [(s.id, s.line, v) for s in samples for v in labels]
    assert samples[0].id == "q000000"  # the generator's ids are kept
    for answer, sample in zip(lines, [s for s in samples for _ in labels], strict=True):
        assert answer["gold"] == list(sample.answers)
        assert answer["correct"] is short_answer_correct(answer["answer"], sample.answers, sample.question)
        assert answer["contains"] is contains_answer(answer["answer"], sample.answers)
        assert answer["f1"] == best_f1(answer_span(answer["answer"]), sample.answers)
    for row, label in zip(record["rows"], labels, strict=True):
        mine = [a for a in lines if a["variant"] == label]
        assert row["accuracy"] == sum(a["correct"] for a in mine) / len(mine)
        assert row["f1"] == pytest.approx(sum(a["f1"] for a in mine) / len(mine))
        assert row["answer_agreement"] == sum(a["answer_agreement"] for a in mine) / len(mine)
        assert row["first_token_agreement"] == sum(a["first_token_agreement"] for a in mine) / len(mine)
    naive = record["rows"][0]  # against an identical run: no difference, p = 1, an interval of a point
    assert (naive["accuracy_vs_naive"], naive["p_mcnemar"], naive["ci95_low"], naive["ci95_high"]) == (0, 1, 0, 0)
    for row in record["rows"]:
        assert row["ci95_low"] <= row["accuracy_vs_naive"] <= row["ci95_high"]
        assert row["accuracy_vs_naive"] == pytest.approx(row["accuracy"] - naive["accuracy"])


def test_offset_and_limit_shards_add_up_to_the_whole_file(
    tiny_model_dirs: dict[str, Path], qa_file: Path, tmp_path: Path
) -> None:
    model = tiny_model_dirs["llama"]
    whole, first, second = (tmp_path / f"{name}.jsonl" for name in ("whole", "first", "second"))
    _eval_json(model, qa_file, tmp_path / "w.json", "--answers", str(whole), "--max-new-tokens", "4")
    one = _eval_json(
        model, qa_file, tmp_path / "1.json", "--answers", str(first), "--limit", "3", "--max-new-tokens", "4"
    )
    two = _eval_json(
        model, qa_file, tmp_path / "2.json", "--answers", str(second), "--offset", "3", "--max-new-tokens", "4"
    )
    assert (one["samples"], one["offset"], one["limit"]) == (3, 0, 3)
    assert (two["samples"], two["offset"], two["limit"]) == (1, 3, None)
    assert {a["line"] for a in _answers(second)} == {4}
    untimed = [_without_timing(_answers(path)) for path in (first, second, whole)]
    assert untimed[0] + untimed[1] == untimed[2]


def test_an_offset_past_the_end_exits_2(
    tiny_model_dirs: dict[str, Path], qa_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["eval", "--model", str(tiny_model_dirs["qwen2"]), "--data", str(qa_file), "--device", "cpu"]
    assert main([*args, "--offset", "4"]) == 2
    assert "error: qa.jsonl: --offset 4 leaves nothing of its 4 samples" in capsys.readouterr().err
    assert main([*args, "--offset", "-1"]) == 2
    assert "error: --offset must be at least 0" in capsys.readouterr().err
    assert main([*args, "--instruction", "x" * 2001]) == 2
    assert "error: --instruction has 2001 characters; at most 2000" in capsys.readouterr().err


def test_the_short_answer_instruction_is_in_the_system_message_by_default(
    tiny_model_dirs: dict[str, Path], get_engine: Any, qa_file: Path, tmp_path: Path
) -> None:
    """By default the eval's prompt carries the instruction in its prefix; `--instruction ''` gives the served
    prompt: its naive answers are the ones the server's engine (the default template) gives."""
    engine: StitchEngine = get_engine("qwen2")
    served = engine.template
    instructed = build_template(engine.tokenizer, system_extra=DEFAULT_INSTRUCTION)
    assert instructed.prefix != served.prefix and instructed.version != served.version
    assert DEFAULT_INSTRUCTION in engine.tokenizer.decode(list(instructed.prefix))
    assert DEFAULT_INSTRUCTION not in engine.tokenizer.decode(list(served.prefix))
    # Only the system message changes: the chunk wrappers and the question's pieces are the served ones.
    assert (instructed.doc_open, instructed.question_head, instructed.question_tail) == (
        served.doc_open,
        served.question_head,
        served.question_tail,
    )

    model = tiny_model_dirs["qwen2"]
    plain, default = tmp_path / "plain.jsonl", tmp_path / "default.jsonl"
    record = _eval_json(model, qa_file, tmp_path / "d.json", "--answers", str(default), "--max-new-tokens", "5")
    assert record["instruction"] == DEFAULT_INSTRUCTION
    record = _eval_json(
        model, qa_file, tmp_path / "p.json", "--answers", str(plain), "--instruction", "", "--max-new-tokens", "5"
    )
    assert record["instruction"] == ""
    naive = [a["answer"] for a in _answers(plain) if a["variant"] == NAIVE.label]
    assert naive == [_naive_answer(engine, s, 5) for s in read_samples(qa_file)]


def test_the_table_shows_the_paired_tests(
    tiny_model_dirs: dict[str, Path], qa_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    record = _eval_json(
        tiny_model_dirs["mistral"], qa_file, tmp_path / "r.json", "--limit", "2", "--max-new-tokens", "3"
    )
    header, naive_line = capsys.readouterr().out.splitlines()[1:3]
    assert header.split() == [
        "mode",
        "positions",
        "recompute",
        "accuracy",
        "vs_naive",
        "ci95",
        "p",
        "contains",
        "f1",
        "ftok_agree",
        "ans_agree",
        "kl_ftok",
        "ttft_ms",
    ]
    cells = naive_line.split()
    assert cells[:7] == [
        "naive",
        "-",
        "none",
        f"{record['rows'][0]['accuracy']:.3f}",
        "+0.000",
        "[+0.000,+0.000]",
        "1.0000",
    ]


def test_eval_rows_per_context_temperature(
    tiny_model_dirs: dict[str, Path], qa_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tiny_model_dirs["llama"]
    extra = ("--max-new-tokens", "4", "--limit", "2", "--context-temperature", "1", "--context-temperature", "0.5")
    rows = _eval_json(model, qa_file, tmp_path / "t.json", *extra)["rows"]
    modes = [(r["mode"], r["positions"]) for r in rows]
    assert modes == [
        ("naive", None),
        ("turbo@prefix", "reordered"),
        ("turbo@prefix", "composite"),
        ("turbo@prefix:T0.5", "reordered"),
        ("turbo@prefix:T0.5", "composite"),
    ]
    # A temperature of 0.5 doubles every chunk score: the first-token distribution moves away from naive's.
    assert rows[3]["kl_first_token"] != rows[1]["kl_first_token"]
    code = main(["eval", "--model", str(model), "--data", str(qa_file), "--context-temperature", "9"])
    assert code == 2
    assert "--context-temperature 9 is outside 0.25..4" in capsys.readouterr().err


def test_recommend_writes_the_first_recompute_that_keeps_enough_with_the_models_fingerprint(
    get_engine: Any, tiny_model_dirs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from service.kvcache.keys import model_fingerprint
    from service.quality.measured import MEASURED_FILE, read_measured

    engine: StitchEngine = get_engine("qwen2")
    samples = read_samples(write_qa_file(tmp_path / "qa.jsonl", questions=5, chunks=3, seed=8, two_fact_share=0.0))
    lines = [
        json.dumps({"question": s.question, "chunks": list(s.chunks), "answers": [answer_span(text)]})
        for s in samples
        if normalize_answer(answer_span(text := _naive_answer(engine, s, 6)))
    ]
    assert lines, "the tiny model produced no scorable answer"
    own = tmp_path / "own.jsonl"
    own.write_text("\n".join(lines) + "\n", encoding="utf-8")
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dirs["qwen2"], model)
    specs = ["--recompute", "none", "--recompute", "selective:1", "--chunk-context", "alone"]

    record = _eval_json(
        model, own, tmp_path / "rows.json", *specs, "--instruction", "", "--max-new-tokens", "6", "--recommend", "1"
    )

    rows = {(r["mode"], r["positions"], r["recompute"]): r["accuracy"] for r in record["rows"]}
    naive = rows[("naive", None, "none")]
    assert naive == 1.0  # the answers are naive's own
    assert rows[("turbo", "reordered", "selective:1")] == naive  # recomputing every token is naive
    expected = "none" if rows[("turbo", "reordered", "none")] == naive else "selective:1"
    measured = read_measured(model / MEASURED_FILE)
    assert (measured.recompute, measured.chunk_context, measured.met) == (expected, "alone", True)
    assert measured.fingerprint == model_fingerprint(engine.model) and measured.dtype == "float32"
    assert (measured.samples, measured.naive_accuracy, measured.data) == (len(lines), 1.0, "own.jsonl")
    assert [c.recompute for c in measured.candidates] == ["none", "selective:1"]
    assert f"recommended recompute {expected}" in capsys.readouterr().out


def test_recommend_is_refused_before_answering_where_it_cannot_be_written(
    tiny_model_dirs: dict[str, Path], qa_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["eval", "--model", str(tiny_model_dirs["qwen2"]), "--data", str(qa_file), "--device", "cpu"]

    assert main([*base, "--recommend", "1.5"]) == 2
    assert "within (0, 1]" in capsys.readouterr().err
    assert main(["eval", "--model", "org/hub-id", "--data", str(qa_file), "--recommend"]) == 2
    assert "no writable folder" in capsys.readouterr().err
    questions = tmp_path / "q.txt"
    questions.write_text("What?\n", encoding="utf-8")
    corpus = ["eval", "--model", str(tiny_model_dirs["qwen2"]), "--data-dir", str(tmp_path), "--questions"]
    assert main([*corpus, str(questions), "--recommend"]) == 2
    assert "needs --data" in capsys.readouterr().err
