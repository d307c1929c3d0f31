"""Block fine-tuning: the training sample is the served prompt (mask, positions, logits), one step changes the
weights, and the saved folder loads through `load_model` and passes the correctness gate."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from service.cli import main
from service.engine.engine import StitchEngine
from service.engine.gate import run_gate
from service.engine.model import load_model
from service.engine.prompt import PromptIds, encode
from service.engine.reference import independent_mask, reference_positions
from service.engine.stitch import PositionMode
from service.quality.generator import write_qa_file
from workers.training.finetune import (
    IGNORE,
    REPORT_NAME,
    FinetuneConfig,
    Precision,
    answer_ids,
    block_sample,
    choose_precision,
    finetune,
    forward_logits,
    full_attention_sample,
)

CHUNKS = ["Zorvath Keel was born in Ommeria in 1873.", "The Brask Guild was founded by Zorvath Keel.", "Ommeria!"]
QUESTION = "In which year was the founder of the Brask Guild born?"


def _prompt(engine: StitchEngine) -> tuple[PromptIds, tuple[int, ...], int]:
    chunks = [encode(engine.tokenizer, c) for c in CHUNKS]
    prompt = engine.template.prompt(chunks, engine.encode_question(QUESTION))
    return prompt, answer_ids(engine.template, engine.tokenizer, "1873"), int(engine.tokenizer.eos_token_id)


def _lengths(prompt: PromptIds) -> list[int]:
    return [len(prompt.prefix), *(len(b) for b in prompt.blocks)]


@pytest.mark.parametrize("positions", list(PositionMode))
def test_the_training_mask_and_positions_are_the_references(
    get_engine: Any, arch: str, positions: PositionMode
) -> None:
    prompt, answer, eos = _prompt(get_engine(arch))
    sample = block_sample(prompt, answer, eos, positions)
    lengths, tail = _lengths(prompt), len(prompt.question) + len(answer) + 1
    assert torch.equal(sample.allowed, independent_mask(lengths, tail))
    # The prompt's square is exactly the mask the gate's reference uses for this prompt.
    size = len(prompt.joined())
    assert torch.equal(sample.allowed[:size, :size], independent_mask(lengths, len(prompt.question)))
    assert torch.equal(sample.positions, reference_positions(positions, lengths, tail))
    assert sample.input_ids.tolist() == [*prompt.joined(), *answer, eos]


def test_a_full_attention_sample_is_plain_causal(get_engine: Any) -> None:
    prompt, answer, eos = _prompt(get_engine("qwen2"))
    sample = full_attention_sample(prompt, answer, eos)
    size = len(prompt.joined()) + len(answer) + 1
    assert torch.equal(sample.allowed, torch.ones(size, size, dtype=torch.bool).tril())
    assert torch.equal(sample.positions, torch.arange(size))
    assert not torch.equal(sample.allowed, block_sample(prompt, answer, eos).allowed)


def test_loss_falls_on_the_answer_and_eos_only(get_engine: Any) -> None:
    prompt, answer, eos = _prompt(get_engine("llama"))
    for sample in (block_sample(prompt, answer, eos), full_attention_sample(prompt, answer, eos)):
        learnt = (sample.labels != IGNORE).nonzero().flatten().tolist()
        start = len(prompt.joined())
        assert learnt == list(range(start, start + len(answer) + 1))
        assert sample.labels[start:].tolist() == [*answer, eos]


@pytest.mark.parametrize("positions", list(PositionMode))
def test_training_logits_equal_the_served_stitched_logits(get_engine: Any, arch: str, positions: PositionMode) -> None:
    engine: StitchEngine = get_engine(arch)
    prompt, answer, eos = _prompt(engine)
    sample = block_sample(prompt, answer, eos, positions)
    with torch.no_grad():
        trained = forward_logits(engine.model.hf, sample, engine.spec.device, engine.spec.dtype).float()
    chunk_kv = engine.precompute(prompt.blocks)
    _, served, _ = engine.prefill_stitched(chunk_kv, prompt.question, positions, all_logits=True)
    start, end = prompt.context_tokens, len(prompt.joined())
    assert (trained[start:end] - served).abs().max() < 1e-4
    full = full_attention_sample(prompt, answer, eos)
    with torch.no_grad():
        causal = forward_logits(engine.model.hf, full, engine.spec.device, engine.spec.dtype).float()
    _, naive = engine.prefill_naive(prompt, all_logits=True)
    assert (causal[:end] - naive).abs().max() < 1e-4


def test_answers_follow_the_template_spacing(get_engine: Any) -> None:
    chat = get_engine("qwen2")  # ChatML: the suffix ends with the assistant header's newline
    plain = get_engine("mistral")  # no chat template: the suffix ends with "Answer:"
    assert chat.tokenizer.decode(list(answer_ids(chat.template, chat.tokenizer, "1873"))) == "1873"
    assert plain.tokenizer.decode(list(answer_ids(plain.template, plain.tokenizer, "1873"))) == " 1873"


@pytest.fixture
def qa_file(tmp_path: Path) -> Path:
    return write_qa_file(tmp_path / "train.jsonl", questions=6, chunks=3, seed=5, two_fact_share=0.5)


def test_one_step_changes_the_weights_and_the_folder_passes_the_gate(
    tiny_model_dirs: dict[str, Path], qa_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base, out = tiny_model_dirs["llama"], tmp_path / "tuned"
    config = FinetuneConfig(str(base), str(qa_file), str(out), steps=1, batch_size=2, lr=1e-3, warmup_steps=0)
    report = finetune(config)
    assert len(report.losses) == 1 and math.isfinite(report.losses[0]) and report.losses[0] > 0
    assert report.block_samples + report.full_attention_samples == 2

    before = dict(load_model(base).hf.named_parameters())
    after = dict(load_model(out).hf.named_parameters())
    assert before.keys() == after.keys()
    changed = [name for name in before if not torch.equal(before[name], after[name])]
    assert "model.layers.0.self_attn.q_proj.weight" in changed
    assert json.loads((out / REPORT_NAME).read_text(encoding="utf-8"))["losses"] == report.losses

    assert run_gate(StitchEngine(load_model(out))).passed
    assert main(["verify", "--model", str(out), "--device", "cpu"]) == 0
    assert "gate pass" in capsys.readouterr().out


def test_the_share_decides_the_attention_and_the_seed_repeats_the_run(
    tiny_model_dirs: dict[str, Path], qa_file: Path, tmp_path: Path
) -> None:
    base = str(tiny_model_dirs["qwen2"])

    def run(name: str, share: float) -> Any:
        out = str(tmp_path / name)
        return finetune(FinetuneConfig(base, str(qa_file), out, steps=2, batch_size=3, full_attention_share=share))

    blocks_only, full_only = run("b", 0.0), run("f", 1.0)
    assert (blocks_only.block_samples, blocks_only.full_attention_samples) == (6, 0)
    assert (full_only.block_samples, full_only.full_attention_samples) == (0, 6)
    assert blocks_only.losses != full_only.losses  # same samples and order, another mask and so another loss
    assert run("again", 0.0).losses == blocks_only.losses


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--steps", "0"], "--steps and --batch-size must be at least 1"),
        (["--full-attention-share", "1.5"], "--full-attention-share must be within 0..1"),
        (["--lr", "0"], "--lr must be positive"),
    ],
)
def test_bad_options_exit_2(
    tiny_model_dirs: dict[str, Path],
    qa_file: Path,
    tmp_path: Path,
    extra: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["finetune", "--model", str(tiny_model_dirs["qwen2"]), "--data", str(qa_file), "--out", str(tmp_path / "o")]
    assert main([*args, "--device", "cpu", *extra]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("peft") is not None, reason="peft is installed here")
def test_lora_without_peft_is_a_clear_error(
    tiny_model_dirs: dict[str, Path], qa_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["finetune", "--model", str(tiny_model_dirs["qwen2"]), "--data", str(qa_file), "--out", str(tmp_path / "o")]
    assert main([*args, "--device", "cpu", "--lora"]) == 2
    assert "--lora needs the optional peft package" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_the_finetune_command_saves_a_loadable_folder(
    tiny_model_dirs: dict[str, Path], qa_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cli-tuned"
    args = ["finetune", "--model", str(tiny_model_dirs["mistral"]), "--data", str(qa_file), "--out", str(out)]
    assert main([*args, "--device", "cpu", "--steps", "1", "--batch-size", "1", "--positions", "composite"]) == 0
    assert "fine-tuned 1 steps" in capsys.readouterr().out
    record = json.loads((out / REPORT_NAME).read_text(encoding="utf-8"))
    assert record["config"]["positions"] == "composite" and record["config"]["full_attention_share"] == 0.5
    assert load_model(out).spec.model_type == "mistral"


def test_precision_keeps_fp32_master_weights_unless_lora() -> None:
    cuda = FinetuneConfig("m", "d", "o", device="cuda")
    assert choose_precision(cuda) == Precision(torch.float32, torch.bfloat16)
    assert choose_precision(FinetuneConfig("m", "d", "o", device="cuda", lora=True)) == Precision(
        torch.bfloat16, torch.bfloat16
    )
    assert choose_precision(FinetuneConfig("m", "d", "o")) == Precision(torch.float32, torch.float32)
    assert not choose_precision(FinetuneConfig("m", "d", "o")).autocast and choose_precision(cuda).autocast


def test_mixed_precision_trains_fp32_weights_and_saves_the_compute_dtype(
    tiny_model_dirs: dict[str, Path], qa_file: Path, tmp_path: Path
) -> None:
    out = tmp_path / "mixed"
    config = FinetuneConfig(
        str(tiny_model_dirs["qwen2"]),
        str(qa_file),
        str(out),
        steps=1,
        batch_size=2,
        lr=1e-3,
        compute_dtype=torch.bfloat16,
    )
    report = finetune(config)
    assert math.isfinite(report.losses[0])
    with safe_open(str(out / "model.safetensors"), "pt") as saved:
        weight = saved.get_tensor("model.layers.0.self_attn.q_proj.weight")
    base = load_model(tiny_model_dirs["qwen2"]).hf.get_parameter("model.layers.0.self_attn.q_proj.weight")
    assert weight.dtype == torch.bfloat16
    assert not torch.equal(weight, base.to(torch.bfloat16))
    assert run_gate(StitchEngine(load_model(out))).passed


@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft (optional) is not installed")
def test_lora_merges_into_a_plain_folder_that_passes_the_gate(
    tiny_model_dirs: dict[str, Path], qa_file: Path, tmp_path: Path
) -> None:
    base, out = tiny_model_dirs["qwen2"], tmp_path / "lora"
    config = FinetuneConfig(
        str(base), str(qa_file), str(out), steps=2, batch_size=2, lr=1e-2, warmup_steps=0, lora=True
    )
    assert math.isfinite(finetune(config).losses[-1])
    before = dict(load_model(base).hf.named_parameters())
    after = dict(load_model(out).hf.named_parameters())
    assert before.keys() == after.keys()  # merged: no adapter weights left in the folder
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert "model.layers.0.self_attn.q_proj.weight" in changed
    assert not any("mlp" in name for name in changed)  # adapters only on the attention projections
    assert run_gate(StitchEngine(load_model(out))).passed


def test_running_out_of_gpu_memory_names_the_micro_batch_flag(
    tiny_model_dirs: dict[str, Path],
    qa_file: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A batch of long prompts runs a GPU out of memory mid-step: the error says which flag fixes it, nothing is
    saved."""
    import workers.training.finetune as training

    def out_of_memory(*args: object, **kwargs: object) -> None:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 168.00 MiB.\nmore detail")

    monkeypatch.setattr(training, "sample_losses", out_of_memory)
    out = tmp_path / "o"
    args = ["finetune", "--model", str(tiny_model_dirs["qwen2"]), "--data", str(qa_file), "--out", str(out)]
    assert main([*args, "--device", "cpu", "--steps", "1", "--batch-size", "2"]) == 2
    err = capsys.readouterr().err
    assert "CUDA out of memory. Tried to allocate 168.00 MiB." in err and "smaller --micro-batch-size" in err
    assert "more detail" not in err
    assert not out.exists()
