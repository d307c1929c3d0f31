"""APE's attention temperature on chunk keys (`context_temperature`): the stitch divides exactly the chunks'
rotated keys by T, which is what every later query's scores against them being divided by T means; the prefix, the
values and the gate are untouched."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from service.engine.engine import GenerationMode, StitchEngine
from service.engine.gate import run_gate, synthetic_ids
from service.engine.kv_layout import KEYS, VALUES, KVBlock
from service.engine.prompt import PromptIds
from service.engine.recompute_spec import parse_recompute
from service.engine.stitch import PositionMode, plan_positions
from service.quality.eval import Variant, table_variants
from service.settings import Settings

EngineFactory = Callable[..., StitchEngine]


def _tempered(engine: StitchEngine, temperature: float) -> StitchEngine:
    return StitchEngine(engine.model, engine.template, context_temperature=temperature)


def _prompt(engine: StitchEngine, seed: int) -> tuple[PromptIds, list[KVBlock]]:
    chunks = synthetic_ids(engine, [13, 7, 18], seed=seed)
    prompt = engine.template.prompt(chunks, synthetic_ids(engine, [6], seed=seed + 1)[0])
    return prompt, engine.precompute(prompt.blocks)


def test_the_plan_scales_chunk_keys_only() -> None:
    plan = plan_positions(PositionMode.REORDERED, [4, 3, 5], context_temperature=0.5)
    assert plan.key_scales == (1.0, 2.0, 2.0)
    assert [plan.key_scale(i) for i in range(3)] == [1.0, 2.0, 2.0]
    assert plan_positions(PositionMode.REORDERED, [4, 3]).key_scale(1) == 1.0
    with pytest.raises(ValueError, match="positive"):
        plan_positions(PositionMode.REORDERED, [4, 3], context_temperature=0.0)


@pytest.mark.parametrize("positions", list(PositionMode))
def test_stitched_chunk_keys_are_divided_by_the_temperature(get_engine: EngineFactory, positions: PositionMode) -> None:
    base = get_engine("llama", "cpu")
    _, chunk_kv = _prompt(base, seed=2)
    plain, plan = base.stitch(chunk_kv, positions, 4)
    tempered, _ = _tempered(base, 0.8).stitch(chunk_kv, positions, 4)
    prefix, used = plan.lengths[0], plan.context_tokens
    assert torch.equal(tempered.data[:, :, :, :prefix], plain.data[:, :, :, :prefix])
    assert torch.equal(tempered.data[:, VALUES, :, :used], plain.data[:, VALUES, :, :used])
    expected = plain.data[:, KEYS, :, prefix:used] / 0.8
    torch.testing.assert_close(tempered.data[:, KEYS, :, prefix:used], expected, atol=1e-5, rtol=1e-5)


def test_the_served_logits_are_those_of_chunk_keys_divided_by_t(get_engine: EngineFactory) -> None:
    """Keys are stored before RoPE and RoPE is linear, so dividing the stored keys by T before a plain stitch is
    the same attention: the tempered engine's logits must equal it, and differ from the untempered ones."""
    base = get_engine("qwen2", "cpu")
    prompt, chunk_kv = _prompt(base, seed=5)
    divided = [KVBlock(b.token_ids, torch.stack([b.kv[:, KEYS] / 0.6, b.kv[:, VALUES]], dim=1)) for b in chunk_kv]
    _, expected, _ = base.prefill_stitched(divided, prompt.question, PositionMode.REORDERED, all_logits=True)
    _, plain, _ = base.prefill_stitched(chunk_kv, prompt.question, PositionMode.REORDERED, all_logits=True)
    tempered_engine = _tempered(base, 0.6)
    _, tempered, _ = tempered_engine.prefill_stitched(
        chunk_kv, prompt.question, PositionMode.REORDERED, all_logits=True
    )
    torch.testing.assert_close(tempered, expected, atol=1e-4, rtol=1e-4)
    assert float((tempered - plain).abs().max()) > 1e-3


def test_the_gate_proves_the_block_attention_whatever_the_temperature(get_engine: EngineFactory) -> None:
    engine = _tempered(get_engine("llama", "cpu"), 0.7)
    result = run_gate(engine)
    assert result.passed, [c.max_abs_logit_diff for c in result.cases]
    assert engine.context_temperature == 0.7  # restored after the gate


def test_a_recompute_under_a_temperature_writes_tempered_chunk_keys(get_engine: EngineFactory) -> None:
    """`selective:1` recomputes every chunk token: the keys it writes (layers past 0) carry the stitch's 1/T, so
    they keep the tempered keys' size rather than falling back to untempered ones."""
    base = get_engine("llama", "cpu")
    prompt, chunk_kv = _prompt(base, seed=8)
    sizes = []
    for engine in (base, _tempered(base, 0.5)):
        buffer, plan = engine.stitch(chunk_kv, PositionMode.REORDERED, len(prompt.question))
        engine.recompute(buffer, plan, chunk_kv, parse_recompute("selective:1"), prompt.question)
        sizes.append(float(buffer.data[1:, KEYS, :, plan.lengths[0] : plan.context_tokens].float().norm()))
    assert 1.8 < sizes[1] / sizes[0] < 2.2


def test_the_setting_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTITCH_CONTEXT_TEMPERATURE", "0.8")
    assert Settings().context_temperature == 0.8
    monkeypatch.setenv("KVSTITCH_CONTEXT_TEMPERATURE", "0.1")
    with pytest.raises(ValueError, match="context_temperature"):
        Settings()


def test_eval_rows_per_temperature() -> None:
    variants = table_variants(temperatures=[1.0, 0.8])
    labels = [v.label for v in variants]
    assert labels == [
        "naive/-/none",
        "turbo/reordered/none",
        "turbo/composite/none",
        "turbo:T0.8/reordered/none",
        "turbo:T0.8/composite/none",
    ]
    assert Variant(GenerationMode.NAIVE, temperature=0.5).label == "naive/-/none"
