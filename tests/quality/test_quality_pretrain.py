"""The base model trained here from scratch: its tokenizer copies words as single ids, its samples are the served
prompts, its batched loss equals the per-sample loss, its schedule ends where it should, and the whole
demonstration driver runs on the CPU (slow): loss falls, both models pass the gate, every row is there."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from loadtest.quality_demo import main as demo_main
from service.engine.model import load_model
from service.engine.prompt import build_template, encode
from service.quality.dataset import QASample, read_samples
from service.quality.generator import write_qa_file
from workers.training.finetune import IGNORE, Precision, encode_samples, eos_id, full_attention_sample, sample_loss
from workers.training.pretrain import (
    EOS_TOKEN,
    TIMING_STEPS,
    WARM_STEPS,
    ModelShape,
    PretrainConfig,
    StepBudget,
    answer_loss,
    build_qa_tokenizer,
    collate,
    corpus,
    curriculum_pool,
    encode_batch,
    exact_match,
    lr_at,
    pretrain,
    save_untrained,
    training_pairs,
)

SHAPE = ModelShape(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, max_positions=1024)


@pytest.fixture(scope="module")
def samples(tmp_path_factory: pytest.TempPathFactory) -> list[QASample]:
    path = write_qa_file(tmp_path_factory.mktemp("qa") / "train.jsonl", questions=40, chunks=3, seed=5)
    return read_samples(path)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory, samples: list[QASample]) -> Path:
    return save_untrained(tmp_path_factory.mktemp("base"), SHAPE, samples, vocab_size=600, seed=0)


def test_a_year_or_name_is_the_same_ids_in_a_chunk_in_a_question_and_in_the_answer(samples: list[QASample]) -> None:
    tokenizer = build_qa_tokenizer(corpus(samples), vocab_size=600)
    template = build_template(tokenizer)
    sample = next(s for s in samples if s.answers[0].isdigit())
    answer = encode(tokenizer, sample.answers[0])
    gold = next(c for c in sample.chunks if sample.answers[0] in c)
    ids = encode(tokenizer, gold)
    assert any(ids[i : i + len(answer)] == answer for i in range(len(ids)))  # copied, not re-spelt
    assert encode(tokenizer, " " + sample.answers[0]) == answer
    assert tokenizer.decode(list(answer)).strip() == sample.answers[0]
    # The chat template of the tiny models, the markers as one token each, EOS ends the assistant's turn.
    assert len(template.doc_open) == 1 and tokenizer.eos_token == EOS_TOKEN
    assert template.question_tail[0] == tokenizer.convert_tokens_to_ids(EOS_TOKEN)


def test_the_batched_encoding_is_finetunes_encoding(base_dir: Path, samples: list[QASample]) -> None:
    model = load_model(base_dir)
    template = build_template(model.tokenizer)
    assert encode_batch(model.tokenizer, template, samples, model.spec.max_context) == encode_samples(
        model, template, samples, "train.jsonl"
    )
    with pytest.raises(ValueError, match=r"line 1: the sample does not fit the model's 40 positions"):
        encode_batch(model.tokenizer, template, samples, 40)


def test_the_padded_batch_loss_is_the_mean_of_the_per_sample_losses(base_dir: Path, samples: list[QASample]) -> None:
    model = load_model(base_dir)
    encoded = encode_batch(model.tokenizer, build_template(model.tokenizer), samples[:3], model.spec.max_context)
    eos = eos_id(model)
    pairs = training_pairs(encoded, eos)
    assert len({len(ids) for ids, _ in pairs}) > 1  # the batch really is padded
    batch = collate(pairs, pad_id=int(model.tokenizer.pad_token_id))
    total, answer = answer_loss(model.hf, batch, torch.device("cpu"), torch.float32)
    batched = float(answer)
    assert float(total) == batched  # no context loss by default
    fp32 = Precision(torch.float32, torch.float32)
    singles = [full_attention_sample(e.prompt, e.answer, eos) for e in encoded]
    per_sample = [float(sample_loss(model.hf, s, torch.device("cpu"), fp32)) for s in singles]
    weights = [len(e.answer) + 1 for e in encoded]  # the batch averages over answer tokens, not samples
    expected = sum(w * v for w, v in zip(weights, per_sample, strict=True)) / sum(weights)
    assert batched == pytest.approx(expected, rel=1e-4)
    assert batched > 0
    with_context, answer_part = answer_loss(model.hf, batch, torch.device("cpu"), torch.float32, context_weight=0.5)
    assert float(answer_part) == pytest.approx(batched, rel=1e-6) and float(with_context) > batched + 0.5


def test_the_schedule_warms_up_then_decays_to_its_floor() -> None:
    config = PretrainConfig(lr=1e-3, warmup_steps=10, min_lr_ratio=0.1, steps=110)
    assert lr_at(0, 110, config) == pytest.approx(1e-4)
    assert lr_at(9, 110, config) == pytest.approx(1e-3)
    assert lr_at(60, 110, config) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))
    assert lr_at(110, 110, config) == pytest.approx(1e-4)
    with pytest.raises(ValueError, match="exactly one of steps and seconds"):
        PretrainConfig(steps=5, seconds=1.0).check()


def test_a_time_budget_trains_and_stops(base_dir: Path, samples: list[QASample]) -> None:
    model = load_model(base_dir)
    hf = model.hf.requires_grad_(True)
    encoded = encode_batch(model.tokenizer, build_template(model.tokenizer), samples, model.spec.max_context)
    before = [p.detach().clone() for p in hf.parameters()]
    config = PretrainConfig(batch_size=4, warmup_steps=2, seconds=0.5)
    report = pretrain(hf, encoded, eos_id(model), int(model.tokenizer.pad_token_id), config)
    assert report.steps >= WARM_STEPS + TIMING_STEPS + 1  # the warm and timing steps always run, then one
    assert len(report.losses) == report.steps
    assert all(math.isfinite(v) for v in report.losses)
    assert any(not torch.equal(a, b) for a, b in zip(before, hf.parameters(), strict=True))
    assert not hf.training


@pytest.mark.slow
def test_the_demo_driver_runs_end_to_end_on_the_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "demo.json"
    argv = ["--work-dir", str(tmp_path / "work"), "--json", str(out), "--device", "cpu", "--tiny"]
    argv += ["--vocab-size", "512", "--train-questions", "64", "--test-questions", "3", "--chunks", "3"]
    argv += ["--pretrain-steps", "30", "--pretrain-batch-size", "8", "--pretrain-warmup", "3", "--pretrain-lr", "3e-3"]
    argv += ["--finetune-steps", "2", "--finetune-batch-size", "2", "--max-new-tokens", "3", "--selective", "0.5"]
    argv += ["--probe-every", "10", "--curriculum-share", "0.2"]
    assert demo_main(argv) == 0

    record: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
    pretrained = record["pretrain"]
    assert pretrained["steps"] == 30 and pretrained["parameters"] > 0
    curve = [loss for _, loss in pretrained["loss_curve"]]
    assert curve[-1] < curve[0] - 0.5  # it learns (answer-token loss, from ~ln(vocab))
    assert record["finetune"]["steps"] == 2
    assert record["finetune"]["block_samples"] + record["finetune"]["full_attention_samples"] == 4
    for name in ("base", "block-finetuned"):
        result = record["eval"][name]
        assert result["verify"]["passed"] is True and result["samples"] == 3
        fp32 = result["verify_fp32"]
        assert fp32["passed"] is True and fp32["max_abs_logit_diff"] <= fp32["tolerance"] == 1e-4
        labels = [(r["mode"], r["positions"], r["recompute"]) for r in result["rows"]]
        assert labels == [
            ("naive", None, "none"),
            ("turbo", "composite", "none"),
            ("turbo", "reordered", "none"),
            ("turbo", "reordered", "prefix:8"),
            ("turbo", "reordered", "selective:0.5"),
        ]
        naive = result["rows"][0]
        assert naive["answer_agreement"] == 1.0 and naive["kl_first_token"] == 0.0
        for row in result["rows"]:
            assert 0.0 <= row["accuracy"] <= 1.0 and 0.0 <= row["f1"] <= 1.0 and row["kl_first_token"] >= 0.0
        assert (tmp_path / "work" / "models" / name / "config.json").is_file()
    assert {name: d["chunks"] for name, d in record["data"].items()} == {
        "train-k1": 1,
        "train-k2": 2,
        "train-k3": 3,
        "train-k5": 5,
        "finetune": 3,
        "test": 3,
        "probe": 3,
    }
    assert len({d["seed"] for d in record["data"].values()}) == 7  # every set from its own seed
    assert record["data"]["train-k1"]["two_fact_share"] == 0.0 and record["data"]["test"]["two_fact_share"] == 0.3
    probes = pretrained["held_out_exact_match"]
    assert [step for step, _ in probes] == [10, 20, 30] and all(0.0 <= share <= 1.0 for _, share in probes)
    for d in record["data"].values():
        assert len(read_samples(tmp_path / "work" / "qa" / d["file"])) == d["questions"]
    tables = capsys.readouterr().out
    assert tables.count("3 samples, greedy, up to 3 new tokens") == 2


def greedy_continuation(hf: Any, ids: torch.Tensor, length: int) -> list[int]:
    """`length` tokens decoded greedily after `ids`, a full forward per token (the slow, obvious way)."""
    out = ids.tolist()
    with torch.no_grad():
        for _ in range(length):
            out.append(int(hf(input_ids=torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids) :]


def test_exact_match_is_the_share_that_greedy_decoding_answers_exactly(base_dir: Path, samples: list[QASample]) -> None:
    model = load_model(base_dir)
    pad = int(model.tokenizer.pad_token_id)
    encoded = encode_batch(model.tokenizer, build_template(model.tokenizer), samples[:4], model.spec.max_context)
    # Labels the model answers greedily by construction: its own argmax continuation (2 to 5 tokens, so the batch
    # is padded and every answer token is checked, not only the first).
    pairs = []
    for length, item in enumerate(encoded, start=2):
        prompt = torch.tensor(item.prompt.joined())
        continuation = torch.tensor(greedy_continuation(model.hf, prompt, length))
        labels = torch.cat([torch.full_like(prompt, IGNORE), continuation])
        pairs.append((torch.cat([prompt, continuation]), labels))
    assert exact_match(model.hf, pairs, pad, batch_size=3) == 1.0
    ids, labels = pairs[2]
    labels = labels.clone()
    labels[-2] = (labels[-2] + 1) % len(model.tokenizer)  # one token, not the first, is not what greedy decodes
    pairs[2] = (ids, labels)
    assert exact_match(model.hf, pairs, pad, batch_size=3) == 0.75
    assert exact_match(model.hf, training_pairs(encoded, eos_id(model)), pad) == 0.0  # random weights
    assert not model.hf.training


def test_the_curriculum_pool_holds_the_samples_with_the_fewest_chunks(tmp_path: Path, base_dir: Path) -> None:
    model = load_model(base_dir)
    mixed = [*read_samples(write_qa_file(tmp_path / "k3.jsonl", 5, 3, seed=1))]
    mixed += read_samples(write_qa_file(tmp_path / "k2.jsonl", 4, 2, seed=2))
    encoded = encode_batch(model.tokenizer, build_template(model.tokenizer), mixed, model.spec.max_context)
    assert curriculum_pool(encoded) == [5, 6, 7, 8]


def test_the_step_budget_follows_slower_steps_after_a_fast_phase(monkeypatch: pytest.MonkeyPatch) -> None:
    # 10 s of budget: the first 300 steps (the one-chunk curriculum) take 10 ms each, every later one 20 ms, so
    # 3 s + 350 x 20 ms fill it at step 650. An estimate from the average since the start would say ~900.
    clock = {"now": 0.0}
    monkeypatch.setattr("workers.training.pretrain.time.perf_counter", lambda: clock["now"])
    budget = StepBudget(10.0, torch.device("cpu"))
    total, step = 10**9, 0
    while step < total and not budget.overrun(step):
        total = budget.steps(step, total)
        clock["now"] += 0.010 if step < 300 else 0.020
        step += 1
    assert 640 <= step <= 680
    assert clock["now"] == pytest.approx(10.0, abs=0.4)  # ends at the budget, not at the 110 % cut-off
