"""Recompute chosen by the question (`query:R`) and the adaptive trigger (`auto`): the question's attention equals
the HF model's own attention probabilities, the chosen tokens are the top share by it, and `auto` recomputes only
where its estimate exceeds the threshold, as much as brings the estimate down to it."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from service.engine.engine import StitchEngine
from service.engine.gate import default_tolerance, synthetic_ids
from service.engine.prompt import PromptIds
from service.engine.recompute_select import AUTO_MAX_SHARE, auto_choice, question_attention
from service.engine.recompute_spec import parse_recompute
from service.engine.stitch import PositionMode

GetEngine = Callable[[str, str], StitchEngine]
CHUNKS = (21, 12, 30)


def _prompt(engine: StitchEngine, seed: int = 3) -> PromptIds:
    chunks = synthetic_ids(engine, CHUNKS, seed=seed)
    return engine.template.prompt(chunks, synthetic_ids(engine, [9], seed=seed + 40)[0])


def _hf_question_attention(engine: StitchEngine, prompt: PromptIds) -> torch.Tensor:
    """The same sum from the HF model's eager attention over the naive prompt: [context] (heads and question
    rows summed, layers averaged)."""
    hf = engine.model.hf
    previous = hf.config._attn_implementation
    hf.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            out = hf(input_ids=torch.tensor([prompt.joined()]), output_attentions=True, use_cache=False)
    finally:
        hf.set_attn_implementation(previous)
    context, rows = prompt.context_tokens, len(prompt.question)
    per_layer = [a[0, :, -rows:, :context].float().sum(dim=(0, 1)) for a in out.attentions]
    return torch.stack(per_layer).mean(dim=0)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_question_attention_is_the_models_own_over_a_naive_context(get_engine: GetEngine, arch: str) -> None:
    engine = get_engine(arch, "cpu")
    prompt = _prompt(engine)
    context_only = PromptIds(prompt.prefix, prompt.blocks, ())
    buffer, _ = engine.prefill_naive(context_only)
    plan = engine.plan(PositionMode.REORDERED, [engine.prefix_block, *engine.precompute(prompt.blocks)])
    ours = question_attention(engine.forward, buffer, plan, prompt.question)
    theirs = _hf_question_attention(engine, prompt)
    assert ours.shape == (prompt.context_tokens,)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-3)
    # Each head's row sums to 1 over context and question: the question's own tokens take the rest.
    assert 0 < float(ours.sum()) < engine.spec.num_heads * len(prompt.question)


def test_query_recomputes_the_share_the_question_reads_most(get_engine: GetEngine) -> None:
    engine = get_engine("mistral", "cpu")
    prompt = _prompt(engine, seed=7)
    chunk_kv = engine.precompute(prompt.blocks)
    buffer, plan = engine.stitch(chunk_kv, PositionMode.REORDERED, len(prompt.question))
    scores = question_attention(engine.forward, buffer, plan, prompt.question)[plan.lengths[0] :]
    count = int(0.25 * sum(CHUNKS_TOKENS(prompt)) + 0.5)
    expected = sorted((torch.topk(scores, count).indices + plan.lengths[0]).tolist())

    recomputed = engine.recompute(buffer, plan, chunk_kv, parse_recompute("query:0.25"), prompt.question)

    plain, _ = engine.stitch(chunk_kv, PositionMode.REORDERED, len(prompt.question))
    context = plan.context_tokens
    changed = (buffer.data[..., :context, :] != plain.data[..., :context, :]).flatten(0, 2).any(dim=0).any(dim=-1)
    assert recomputed == count > 0
    assert changed.nonzero().flatten().tolist() == expected


def CHUNKS_TOKENS(prompt: PromptIds) -> list[int]:  # noqa: N802 - reads as the constant it stands for
    return [len(b) for b in prompt.blocks]


def test_query_one_is_the_naive_prefill(get_engine: GetEngine) -> None:
    engine = get_engine("llama", "cpu")
    prompt = _prompt(engine, seed=9)
    chunk_kv = engine.precompute(prompt.blocks)
    buffer, plan = engine.stitch(chunk_kv, PositionMode.REORDERED, len(prompt.question))
    engine.recompute(buffer, plan, chunk_kv, parse_recompute("query:1"), prompt.question)
    logits = engine.prefill_question(buffer, prompt.question, all_logits=True)
    _, naive = engine.prefill_naive(prompt, all_logits=True)
    diff = float((logits - naive[-len(prompt.question) :]).abs().max())
    assert diff <= default_tolerance(engine.spec.dtype)


def test_the_question_kinds_need_the_question(get_engine: GetEngine) -> None:
    engine = get_engine("llama", "cpu")
    prompt = _prompt(engine)
    chunk_kv = engine.precompute(prompt.blocks)
    buffer, plan = engine.stitch(chunk_kv, PositionMode.REORDERED, len(prompt.question))
    with pytest.raises(ValueError, match="question"):
        engine.recompute(buffer, plan, chunk_kv, parse_recompute("query:0.5"))


# ---- auto ------------------------------------------------------------------------------------------------------


def test_auto_leaves_a_request_under_the_threshold_alone() -> None:
    attention = torch.tensor([1.0, 1.0, 2.0])
    deviation = torch.tensor([0.01, 0.02, 0.01])  # estimate = (0.01 + 0.02 + 0.02) / 4 = 0.0125
    choice = auto_choice(attention, deviation, threshold=0.02)
    assert not choice.triggered and choice.estimate == pytest.approx(0.0125)


def test_auto_recomputes_the_riskiest_tokens_until_the_estimate_is_under_the_threshold() -> None:
    attention = torch.tensor([4.0, 1.0, 3.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    deviation = torch.tensor([0.5, 0.9, 0.1, 0.4, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    # shares .4 .1 .3 .2 -> risks .2 .09 .03 .08 (estimate .4); highest first: .2 (left .2), .09 (left .11),
    # .08 (left .03): three tokens bring it to .03 <= .05.
    choice = auto_choice(attention, deviation, threshold=0.05, max_share=0.5)
    assert choice.estimate == pytest.approx(0.4)
    assert choice.chosen.tolist() == [0, 1, 3]


def test_auto_recomputes_at_most_its_share() -> None:
    attention = torch.ones(20)
    deviation = torch.ones(20)
    choice = auto_choice(attention, deviation, threshold=0.01)
    assert choice.chosen.numel() == int(AUTO_MAX_SHARE * 20)


def test_auto_on_the_engine_follows_its_threshold(get_engine: GetEngine) -> None:
    engine = get_engine("qwen2", "cpu")
    prompt = _prompt(engine, seed=12)
    chunk_kv = engine.precompute(prompt.blocks)
    counts = {}
    for spec in ("auto:1", "auto:0.000001"):
        buffer, plan = engine.stitch(chunk_kv, PositionMode.REORDERED, len(prompt.question))
        counts[spec] = engine.recompute(buffer, plan, chunk_kv, parse_recompute(spec), prompt.question)
    assert counts["auto:1"] == 0
    assert counts["auto:0.000001"] == int(AUTO_MAX_SHARE * sum(len(b) for b in prompt.blocks))
