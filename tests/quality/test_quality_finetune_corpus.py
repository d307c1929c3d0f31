"""`kvstitch finetune --data-dir DIR`: questions made from the sentences of an ingested corpus, their chunks
retrieved and prompted as /ask does, the teacher's answers distilled; the saved folder loads and passes the gate,
nothing in the data dir is written, and bad input exits 2 with one line."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from quality_corpus import ingest_corpus

from service.cli import main
from service.engine.engine import StitchEngine
from service.engine.gate import run_gate
from service.engine.model import load_model
from service.engine.prompt import build_template, encode_text
from service.quality.corpus_eval import CorpusError
from service.quality.generator import write_qa_file
from service.settings import Settings
from workers.training.corpus_prompts import QUESTION_FORMS, corpus_prompts, make_questions, sentences
from workers.training.finetune import REPORT_NAME

SETTINGS = {"CHUNK_SIZE": "48", "CHUNK_OVERLAP": "8", "MAX_PRECOMPUTE_TOKENS": "256", "HOST_CACHE_MB": "4"}
DOCUMENTS = {
    "otters.md": "# Otters\n\nSea otters hold hands while they sleep, so that the current does not part them. "
    "Otters eat sea urchins and crabs from the kelp forests of the Pacific coast.",
    "bread.txt": "Sourdough rises because wild yeast ferments the flour. The starter is fed every day with flour "
    "and water. Bakers in Ommeria kept one starter alive from 1873 until 1990.",
    "volcanoes.txt": " ".join(f"Volcano number {n} erupted {n + 3} times in {1900 + 7 * n}." for n in range(9)),
}


def test_questions_come_from_the_chunks_sentences_and_spread_over_the_corpus() -> None:
    chunks = [
        ("b", 0, "Short one. Zorvath Keel was born in Ommeria in 1873 and founded a guild."),
        ("a", 1, "The Brask Guild was founded by Zorvath Keel in the northern city of Tamb."),
        ("a", 0, "Too short. Also short!"),
    ]
    assert sentences(chunks[0][2]) == ["Zorvath Keel was born in Ommeria in 1873 and founded a guild."]
    first = make_questions(chunks, 2, random.Random(7))
    assert make_questions(chunks, 2, random.Random(7)) == first  # seeded
    assert sorted(source for _, source in first) == [("a", 1), ("b", 0)]  # each usable chunk once before repeats
    many = make_questions(chunks, 7, random.Random(3))
    assert len(many) == 7 and {source for _, source in many} == {("a", 1), ("b", 0)}
    openings = {form.split("{")[0] for form in QUESTION_FORMS}
    for question, (doc, index) in many:
        assert any(question.startswith(o) for o in openings)
        quoted = question.split('"')[1].removesuffix(" ...")
        source = next(text for d, i, text in chunks if (d, i) == (doc, index))
        assert quoted in source and len(quoted.split()) >= 2  # a span of the chunk's own words
    with pytest.raises(CorpusError, match="no ingested chunk has a sentence of 6 to 60 words"):
        make_questions([chunks[2]], 3, random.Random(0))


@pytest.fixture
def data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_model_dirs: dict[str, Path]) -> Path:
    """A corpus ingested into an embedded data dir, with a clean KVSTITCH_* environment and no .env."""
    return ingest_corpus(tmp_path, monkeypatch, tiny_model_dirs["qwen2"], SETTINGS, DOCUMENTS)


def _files(folder: Path) -> dict[str, int]:
    return {p.relative_to(folder).as_posix(): p.stat().st_size for p in folder.rglob("*") if p.is_file()}


@pytest.mark.slow  # an embedded ingest, prompts over it and two short fine-tunes: ~40 s on 2 cores
def test_finetune_over_an_ingested_corpus_distils_served_prompts_and_saves_a_gated_folder(
    data_dir: Path, tmp_path: Path, tiny_model_dirs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    base = tiny_model_dirs["qwen2"]
    model = load_model(base)
    template = build_template(model.tokenizer)
    settings = Settings(model=str(base), data_dir=data_dir)
    made = corpus_prompts(model, template, settings, count=6, top_k=2, answer_tokens=8, seed=0)
    assert len(made) == 6
    texts = {text for text in DOCUMENTS.values()}
    for item in made:
        assert item.prompt.prefix == template.prefix
        assert item.prompt.question == template.question_suffix(encode_text(model.tokenizer, item.question))
        assert 1 <= len(item.prompt.blocks) <= 2
        for block in item.prompt.blocks:
            assert block[: len(template.doc_open)] == template.doc_open
            chunk = model.tokenizer.decode(list(block[len(template.doc_open) : -len(template.doc_close)]))
            assert any(chunk.strip() in " ".join(t.split()) or chunk.strip() in t for t in texts)
        assert item.question.split('"')[1].removesuffix(" ...").split()[0] in " ".join(texts)

    kv_files = _files(data_dir / "kv")
    out = tmp_path / "tuned"
    argv = ["finetune", "--model", str(base), "--data-dir", str(data_dir), "--out", str(out), "--device", "cpu"]
    steps = ["--steps", "2", "--batch-size", "4", "--prompts", "6", "--top-k", "2", "--answer-tokens", "6"]
    assert main([*argv, *steps, "--lr", "1e-3", "--warmup-steps", "0"]) == 0
    printed = capsys.readouterr().out
    assert "0 labelled, 8 self-distilled over 6 distillation prompts" in printed
    record = json.loads((out / REPORT_NAME).read_text(encoding="utf-8"))
    assert record["distill_samples"] == 8 and record["labelled_samples"] == 0 and record["distill_prompts"] == 6
    assert record["config"]["data_dir"] == str(data_dir) and record["samples_per_s"] > 0
    assert all(loss >= 0 for loss in record["losses"])
    preview = record["distill_preview"]
    assert len(preview) == 5 and all(p["question"] and isinstance(p["answer"], str) for p in preview)
    tuned = load_model(out)
    changed = [
        name for name, weight in model.hf.named_parameters() if not torch.equal(weight, tuned.hf.get_parameter(name))
    ]
    assert "model.layers.0.self_attn.q_proj.weight" in changed
    assert run_gate(StitchEngine(tuned)).passed
    assert main(["verify", "--model", str(out), "--device", "cpu"]) == 0
    assert _files(data_dir / "kv") == kv_files  # the KV cache was read by nobody and written by nobody

    # labelled QA beside the corpus: the share of each step's samples that are labelled
    qa = write_qa_file(tmp_path / "qa.jsonl", questions=4, chunks=2, seed=1, two_fact_share=0.0)
    mixed = tmp_path / "mixed"
    more = ["--data", str(qa), "--label-share", "0.25", "--out", str(mixed)]
    assert main([*argv[:-4], *more, "--device", "cpu", *steps]) == 0
    record = json.loads((mixed / REPORT_NAME).read_text(encoding="utf-8"))
    assert (record["labelled_samples"], record["distill_samples"]) == (2, 6)


def test_a_prompts_file_is_distilled_without_reading_its_answers(
    tmp_path: Path, tiny_model_dirs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """`--distill-data`: a QA file's questions over its chunks are the prompts; the teacher answers them (the file's
    answers are replaced by nonsense to show they are never read) and the saved folder passes the gate."""
    qa = write_qa_file(tmp_path / "qa.jsonl", questions=5, chunks=2, seed=3, two_fact_share=0.0)
    lines = [json.loads(line) for line in qa.read_text(encoding="utf-8").splitlines() if line.strip()]
    qa.write_text("".join(json.dumps({**r, "answers": ["zzz never read"]}) + "\n" for r in lines), encoding="utf-8")
    out = tmp_path / "tuned"
    base = tiny_model_dirs["llama"]
    argv = ["finetune", "--model", str(base), "--distill-data", str(qa), "--out", str(out), "--device", "cpu"]
    assert main([*argv, "--steps", "2", "--batch-size", "3", "--answer-tokens", "5", "--warmup-steps", "0"]) == 0
    assert "0 labelled, 6 self-distilled over 5 distillation prompts" in capsys.readouterr().out
    record = json.loads((out / REPORT_NAME).read_text(encoding="utf-8"))
    assert [p["question"] for p in record["distill_preview"]] == [r["question"] for r in lines]
    assert all("zzz" not in p["answer"] for p in record["distill_preview"])
    assert run_gate(StitchEngine(load_model(out))).passed


def test_finetune_without_data_or_corpus_exits_2_naming_the_options(
    tiny_model_dirs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["finetune", "--model", str(tiny_model_dirs["qwen2"]), "--out", str(tmp_path / "o"), "--device", "cpu"]
    assert main(argv) == 2
    assert "give --data FILE.jsonl (labelled QA), --data-dir DIR (an ingested corpus) or --distill-data" in (
        capsys.readouterr().err
    )
    assert main([*argv, "--data-dir", str(tmp_path / "nowhere")]) == 2
    assert f"{tmp_path / 'nowhere'}: no ingested corpus here (no qdrant/ folder)" in capsys.readouterr().err
    assert main([*argv, "--data-dir", str(tmp_path), "--top-k", "51"]) == 2
    assert "--top-k must be within 1..50 (KVSTITCH_MAX_TOP_K)" in capsys.readouterr().err
    assert main([*argv, "--data-dir", str(tmp_path), "--label-share", "2"]) == 2
    assert "--label-share must be within 0..1" in capsys.readouterr().err
    assert not (tmp_path / "o").exists() and not (tmp_path / "nowhere").exists()


def test_the_mix_takes_the_label_share_of_each_step() -> None:
    from workers.training.finetune import FinetuneConfig

    both: dict[str, Any] = {"data_dir": "d", "batch_size": 8}
    assert FinetuneConfig("m", "qa", "o", **both).labelled_per_step() == 4
    assert FinetuneConfig("m", "qa", "o", **both, label_share=0.25).labelled_per_step() == 2
    assert FinetuneConfig("m", None, "o", **both).labelled_per_step() == 0
    assert FinetuneConfig("m", "qa", "o", batch_size=8).labelled_per_step() == 8


def test_an_instruction_goes_into_every_training_prompts_system_message(
    tiny_model_dirs: dict[str, Path], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """`--instruction`: the training prompts' prefix (the system message) carries it, as the eval's does; none by
    default (as /ask); an overlong one exits 2 naming the limit."""
    from workers.training.finetune import FinetuneConfig, training_template

    model = load_model(tiny_model_dirs["qwen2"])
    text = "Answer in three words."
    plain = training_template(model, FinetuneConfig("m", None, "o"))
    told = training_template(model, FinetuneConfig("m", None, "o", instruction=text))
    assert text not in model.tokenizer.decode(list(plain.prefix))
    assert text in model.tokenizer.decode(list(told.prefix))
    assert told.question_tail == plain.question_tail
    argv = ["finetune", "--model", str(tiny_model_dirs["qwen2"]), "--out", str(tmp_path / "o"), "--device", "cpu"]
    assert main([*argv, "--distill-data", "x.jsonl", "--instruction", "x" * 2001]) == 2
    assert "--instruction has 2001 characters; at most 2000" in capsys.readouterr().err
