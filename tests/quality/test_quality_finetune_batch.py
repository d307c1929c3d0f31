"""Batched block fine-tuning and self-distillation: a padded batch gives each sample exactly its one-sample loss
(cross-entropy and KL, served and full attention, several lengths), the teacher's batched greedy answers are its
one-at-a-time answers, a few distillation steps lower the KL on their batch, and length buckets keep epochs."""

from __future__ import annotations

import copy
import importlib.util
import json
import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from service.cli import main
from service.engine.engine import StitchEngine
from service.engine.gate import run_gate
from service.engine.kv_layout import ChunkContext
from service.engine.model import load_model
from service.engine.prompt import PromptIds, encode
from service.engine.stitch import PositionMode
from service.quality.generator import write_qa_file
from workers.training.batch import IGNORE, collate, sample_losses
from workers.training.distill import FrozenTeacher, stop_ids, until_stop
from workers.training.finetune import (
    BUCKET_BATCHES,
    REPORT_NAME,
    Example,
    FinetuneConfig,
    FinetuneReport,
    Pools,
    Precision,
    answer_ids,
    attention_sample,
    bucketed_batches,
    forward_logits,
    sample_loss,
    train,
)

FP32 = Precision(torch.float32, torch.float32)
CPU = torch.device("cpu")
FACTS = [
    ["Zorvath Keel was born in Ommeria in 1873.", "The Brask Guild was founded by Zorvath Keel."],
    ["Sea otters hold hands while they sleep.", "Sourdough rises because wild yeast ferments the flour.", "Ommeria!"],
    ["Volcano number 4 erupted 7 times in 1928."],
    ["Paris is the capital of France.", "Berlin is the capital of Germany.", "The fox jumps.", "Numbers 1 2 3."],
]
QUESTIONS = ["When was the founder of the Brask Guild born?", "Why does bread rise?", "When?", "Capital of France?"]
ANSWERS = ["1873", "Because wild yeast ferments the flour", "1928", "Paris"]


def _prompts(engine: StitchEngine) -> list[PromptIds]:
    return [
        engine.template.prompt([encode(engine.tokenizer, c) for c in chunks], engine.encode_question(question))
        for chunks, question in zip(FACTS, QUESTIONS, strict=True)
    ]


def _labelled(engine: StitchEngine) -> list[Example]:
    eos = int(engine.tokenizer.eos_token_id)
    return [
        Example(prompt, (*answer_ids(engine.template, engine.tokenizer, answer), eos), distill=False)
        for prompt, answer in zip(_prompts(engine), ANSWERS, strict=True)
    ]


def _perturbed(hf: Any, seed: int = 1, scale: float = 0.02) -> Any:
    """A copy of the model with every weight nudged: a student that differs from its teacher everywhere."""
    student = copy.deepcopy(hf)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in student.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * scale)
    return student


def _one_sample_kl(student: Any, teacher: Any, example: Example, positions: PositionMode | None) -> torch.Tensor:
    """KL(teacher || student) averaged over the target tokens of one unpadded sample, from the plain forwards."""
    sample = attention_sample(example.prompt, example.target, positions, distill=True)
    naive = attention_sample(example.prompt, example.target, None)
    student_lp = torch.log_softmax(forward_logits(student, sample, CPU, torch.float32)[:-1], -1)
    teacher_lp = torch.log_softmax(forward_logits(teacher, naive, CPU, torch.float32)[:-1], -1)
    learnt = sample.labels[1:] != IGNORE
    kl = (teacher_lp.exp() * (teacher_lp - student_lp)).sum(-1)
    return kl[learnt].mean()


@pytest.mark.parametrize("positions", list(PositionMode))
def test_a_padded_batch_gives_every_sample_its_one_sample_cross_entropy(
    get_engine: Any, arch: str, positions: PositionMode
) -> None:
    engine: StitchEngine = get_engine(arch)
    examples = _labelled(engine)
    samples = [attention_sample(e.prompt, e.target, positions if i % 2 == 0 else None) for i, e in enumerate(examples)]
    assert len({len(s.input_ids) for s in samples}) == len(samples)  # every one padded by a different amount
    with torch.no_grad():
        batched = sample_losses(engine.model.hf, collate(samples, pad_id=0), CPU, torch.float32)
        alone = torch.stack([sample_loss(engine.model.hf, s, CPU, FP32) for s in samples])
    assert batched.shape == (len(samples),)
    assert torch.allclose(batched, alone, rtol=1e-5, atol=1e-5), (batched, alone)
    # and the mean over the batch is the old loop's step loss (each sample's loss divided by the step size)
    assert float(batched.mean()) == pytest.approx(float(alone.sum() / len(samples)), rel=1e-5)


@pytest.mark.parametrize("positions", list(PositionMode))
def test_a_padded_batch_gives_every_sample_its_one_sample_kl(get_engine: Any, positions: PositionMode) -> None:
    engine: StitchEngine = get_engine("llama")
    teacher = FrozenTeacher.frozen_copy(engine.model.hf, torch.float32)
    student = _perturbed(engine.model.hf)
    examples = [Example(e.prompt, e.target, distill=True) for e in _labelled(engine)]
    attention = [positions, None, positions, None]
    samples = [attention_sample(e.prompt, e.target, a, distill=True) for e, a in zip(examples, attention, strict=True)]
    # a labelled sample in the same batch keeps its cross-entropy beside the KL rows
    labelled = _labelled(engine)[1]
    samples.append(attention_sample(labelled.prompt, labelled.target, positions))
    with torch.no_grad():
        batched = sample_losses(student, collate(samples, pad_id=0), CPU, torch.float32, teacher)
        alone = [_one_sample_kl(student, teacher.hf, e, a) for e, a in zip(examples, attention, strict=True)]
        alone.append(sample_loss(student, samples[-1], CPU, FP32))
    assert torch.allclose(batched, torch.stack(alone), rtol=1e-4, atol=1e-6), (batched, alone)
    assert all(float(v) > 0 for v in batched)


def test_with_its_own_weights_the_student_matches_the_teacher_under_full_attention_only(get_engine: Any) -> None:
    engine: StitchEngine = get_engine("qwen2")
    teacher = FrozenTeacher.frozen_copy(engine.model.hf, torch.float32)
    examples = [Example(e.prompt, e.target, distill=True) for e in _labelled(engine)]
    full = [attention_sample(e.prompt, e.target, None, distill=True) for e in examples]
    block = [attention_sample(e.prompt, e.target, PositionMode.REORDERED, distill=True) for e in examples]
    with torch.no_grad():
        losses = sample_losses(engine.model.hf, collate(full + block, pad_id=0), CPU, torch.float32, teacher)
    assert float(losses[: len(full)].abs().max()) < 1e-6  # same weights, same attention: KL 0
    assert float(losses[len(full) :].min()) > 1e-4  # the served mask changes what the model computes


def test_the_teachers_batched_answers_are_its_one_at_a_time_greedy_answers(get_engine: Any) -> None:
    engine: StitchEngine = get_engine("qwen2")
    teacher = FrozenTeacher.frozen_copy(engine.model.hf, torch.float32)
    prompts = _prompts(engine)
    stops = stop_ids(engine.tokenizer, engine.model.hf)
    batched = teacher.answers(prompts, stops, max_new_tokens=6, batch_size=3, pad_id=0)
    for prompt, answer in zip(prompts, batched, strict=True):
        ids, greedy = list(prompt.joined()), []
        with torch.no_grad():
            for _ in range(6):  # the plain greedy loop: a full forward per token, no padding, no cache
                token = int(teacher.hf(input_ids=torch.tensor([ids + greedy])).logits[0, -1].argmax())
                greedy.append(token)
                if token in stops:
                    break
        assert list(answer) == greedy
    assert until_stop([5, 7, 2, 9, 2], {2}) == (5, 7, 2) and until_stop([5, 7], {2}) == (5, 7)


def test_a_few_distillation_steps_lower_the_kl_on_their_batch(get_engine: Any) -> None:
    engine: StitchEngine = get_engine("llama")
    teacher = FrozenTeacher.frozen_copy(engine.model.hf, torch.float32)
    prompts = _prompts(engine)
    answers = teacher.answers(prompts, stop_ids(engine.tokenizer, engine.model.hf), 5, 4, pad_id=0)
    examples = [Example(p, a, distill=True) for p, a in zip(prompts, answers, strict=True)]
    student = copy.deepcopy(engine.model.hf).requires_grad_(True)
    batch = collate([attention_sample(e.prompt, e.target, PositionMode.REORDERED, True) for e in examples], 0)

    def kl() -> float:
        with torch.no_grad():
            return float(sample_losses(student, batch, CPU, torch.float32, teacher).mean())

    before = kl()
    config = FinetuneConfig("m", None, "o", data_dir="d", steps=6, batch_size=4, lr=1e-4, warmup_steps=0)
    config = FinetuneConfig(**{**config.__dict__, "full_attention_share": 0.0})
    report = train(student.train(), Pools([], examples), config, FP32, FinetuneReport("o"), teacher)
    after = kl()
    assert report.distill_samples == 24 and report.block_samples == 24 and report.labelled_samples == 0
    assert before > 1e-3 and after < 0.5 * before, (before, after, report.losses)
    assert report.losses[0] == pytest.approx(before, rel=1e-4)  # the first step's loss is this batch's KL


def test_micro_batches_give_the_whole_steps_loss(get_engine: Any) -> None:
    engine: StitchEngine = get_engine("mistral")
    examples = _labelled(engine)

    def first_loss(micro: int | None) -> float:
        student = copy.deepcopy(engine.model.hf).requires_grad_(True)
        config = FinetuneConfig("m", "d", "o", steps=1, batch_size=4, micro_batch_size=micro, lr=1e-3)
        return train(student.train(), Pools(examples, []), config, FP32, FinetuneReport("o")).losses[0]

    assert first_loss(1) == pytest.approx(first_loss(None), rel=1e-5)
    assert first_loss(3) == pytest.approx(first_loss(None), rel=1e-5)


def test_length_buckets_draw_every_sample_once_per_epoch_and_pad_little() -> None:
    rng = random.Random(4)
    lengths = [rng.randint(10, 1000) for _ in range(8 * BUCKET_BATCHES * 2)]  # two windows of 8 batches of 8
    draw = bucketed_batches(lengths, 8, random.Random(0))
    epoch = [next(draw) for _ in range(2 * BUCKET_BATCHES)]
    assert all(len(b) == 8 for b in epoch)
    assert Counter(i for b in epoch for i in b) == Counter(range(len(lengths)))
    padded = sum(8 * max(lengths[i] for i in b) for b in epoch)
    assert padded < 1.15 * sum(lengths)  # random batches of these lengths pad by about half
    orders = [tuple(b) for b in epoch]
    assert orders != sorted(orders, key=lambda b: lengths[b[0]])  # the buckets come in a shuffled order


@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft (optional) is not installed")
def test_with_lora_the_teacher_is_the_base_with_its_adapters_off(get_engine: Any) -> None:
    from workers.training.finetune import with_lora

    engine: StitchEngine = get_engine("qwen2")
    inner = copy.deepcopy(engine.model.hf)
    teacher = FrozenTeacher(inner, torch.float32)
    examples = [Example(e.prompt, e.target, distill=True) for e in _labelled(engine)]
    batch = collate([attention_sample(e.prompt, e.target, PositionMode.REORDERED, True) for e in examples], 0)
    wrapped = with_lora(inner)
    teacher.off = wrapped.disable_adapter
    config = FinetuneConfig("m", None, "o", data_dir="d", steps=3, batch_size=4, lr=1e-3, warmup_steps=0, lora=True)
    config = FinetuneConfig(**{**config.__dict__, "full_attention_share": 0.0})
    with torch.no_grad():
        before = sample_losses(inner, batch, CPU, torch.float32, teacher)
    train(inner.train(), Pools([], examples), config, FP32, FinetuneReport("o"), teacher)
    with torch.no_grad():
        after = sample_losses(inner, batch, CPU, torch.float32, teacher)
        # the teacher still scores with the base weights: its answers' log-probabilities are the untouched model's
        reference = FrozenTeacher.frozen_copy(engine.model.hf, torch.float32)
        places = torch.arange(4)
        assert torch.allclose(
            teacher.log_probs(batch.input_ids[:1], places), reference.log_probs(batch.input_ids[:1], places)
        )
    assert float(after.mean()) < 0.5 * float(before.mean())


@pytest.mark.parametrize("positions", list(PositionMode))
def test_with_chunks_after_the_prefix_training_logits_equal_the_served_ones(
    get_engine: Any, arch: str, positions: PositionMode
) -> None:
    """--chunk-context prefix: in composite one masked forward; in reordered the prefix copied before each later
    chunk (its K/V as precomputed at P.., its keys at its slot). Either way the question's logits are the
    engine's stitched prefill over chunks precomputed after the prefix."""
    base: StitchEngine = get_engine(arch)
    engine = StitchEngine(base.model, base.template, chunk_context=ChunkContext.PREFIX)
    example = _labelled(engine)[1]  # three chunks: the second and third are moved away from P
    prompt = example.prompt
    sample = attention_sample(prompt, example.target, positions, context=ChunkContext.PREFIX)
    with torch.no_grad():
        trained = forward_logits(engine.model.hf, sample, CPU, torch.float32)
    _, served, _ = engine.prefill_stitched(
        engine.precompute(prompt.blocks), prompt.question, positions, all_logits=True
    )
    end = len(sample.input_ids) - len(example.target)
    question = trained[end - len(prompt.question) : end]
    assert float((question - served).abs().max()) < 1e-4
    alone = attention_sample(prompt, example.target, positions)
    with torch.no_grad():
        other = forward_logits(engine.model.hf, alone, CPU, torch.float32)[
            len(prompt.joined()) - len(prompt.question) :
        ]
    assert float((other[: len(prompt.question)] - served).abs().max()) > 1e-3  # the context really differs
    if positions is PositionMode.REORDERED:
        copies = len(prompt.blocks) - 1
        assert len(sample.input_ids) == len(prompt.joined()) + len(example.target) + copies * len(prompt.prefix)
        assert torch.equal(sample.teacher_input, torch.tensor([*prompt.joined(), *example.target]))


def test_a_padded_batch_gives_moved_chunk_samples_their_one_sample_kl(get_engine: Any) -> None:
    engine: StitchEngine = get_engine("qwen2")
    teacher = FrozenTeacher.frozen_copy(engine.model.hf, torch.float32)
    student = _perturbed(engine.model.hf, seed=2)
    examples = [Example(e.prompt, e.target, distill=True) for e in _labelled(engine)]
    reordered, prefix = PositionMode.REORDERED, ChunkContext.PREFIX
    samples = [attention_sample(e.prompt, e.target, reordered, True, prefix) for e in examples]
    with torch.no_grad():
        batched = sample_losses(student, collate(samples, pad_id=0), CPU, torch.float32, teacher)
        alone = []
        for example, sample in zip(examples, samples, strict=True):
            naive = attention_sample(example.prompt, example.target, None)
            student_lp = torch.log_softmax(forward_logits(student, sample, CPU, torch.float32)[:-1], -1)
            teacher_lp = torch.log_softmax(forward_logits(teacher.hf, naive, CPU, torch.float32)[:-1], -1)
            learnt = len(example.target)
            kl = (teacher_lp[-learnt:].exp() * (teacher_lp[-learnt:] - student_lp[-learnt:])).sum(-1)
            alone.append(kl.mean())
    assert torch.allclose(batched, torch.stack(alone), rtol=1e-4, atol=1e-6), (batched, alone)


def test_the_command_trains_the_chosen_chunk_context(
    tiny_model_dirs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    qa = write_qa_file(tmp_path / "qa.jsonl", questions=4, chunks=3, seed=2, two_fact_share=0.0)
    out = tmp_path / "prefix"
    argv = ["finetune", "--model", str(tiny_model_dirs["llama"]), "--data", str(qa), "--out", str(out)]
    more = ["--chunk-context", "prefix", "--full-attention-share", "0", "--steps", "1", "--batch-size", "2"]
    assert main([*argv, "--device", "cpu", *more]) == 0
    assert "2 block, 0 full-attention samples; 2 labelled" in capsys.readouterr().out
    record = json.loads((out / REPORT_NAME).read_text(encoding="utf-8"))
    assert record["config"]["chunk_context"] == "prefix" and record["config"]["positions"] == "reordered"
    assert run_gate(StitchEngine(load_model(out), chunk_context=ChunkContext.PREFIX)).passed
