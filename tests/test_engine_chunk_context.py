"""Chunks precomputed after the template prefix (`chunk_context="prefix"`, APE's shared prefix): the gate's
reference mask and positions follow, the KV cache keys them apart, and a chunk's KV is what a full prefill of
prefix + chunk computes."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from service.engine.engine import StitchEngine
from service.engine.gate import run_gate, synthetic_ids
from service.engine.kv_layout import VALUES, ChunkContext
from service.engine.prompt import PromptIds
from service.engine.reference import prompt_reference_logits
from service.engine.stitch import PositionMode

EngineFactory = Callable[[str, str], StitchEngine]


def _after_prefix(engine: StitchEngine) -> StitchEngine:
    return StitchEngine(engine.model, engine.template, chunk_context=ChunkContext.PREFIX)


def test_the_gate_passes_with_chunks_precomputed_after_the_prefix(engine: StitchEngine) -> None:
    result = run_gate(_after_prefix(engine))
    assert result.passed, [(c.positions.value, c.max_abs_logit_diff) for c in result.cases]
    assert {c.positions for c in result.cases} == set(PositionMode)


def test_the_reference_tells_the_two_contexts_apart(get_engine: EngineFactory) -> None:
    """The gate would catch a precompute that ignores the prefix: stitched prefix-context logits are far from the
    alone-context reference (and match their own)."""
    engine = _after_prefix(get_engine("llama", "cpu"))
    chunks = synthetic_ids(engine, [9, 14], seed=3)
    question = synthetic_ids(engine, [5], seed=4)[0]
    prompt = engine.template.prompt(chunks, question)
    chunk_kv = engine.precompute(prompt.blocks)
    _, stitched, _ = engine.prefill_stitched(chunk_kv, prompt.question, PositionMode.REORDERED, all_logits=True)
    own = prompt_reference_logits(engine.model, prompt, PositionMode.REORDERED, context=ChunkContext.PREFIX)
    other = prompt_reference_logits(engine.model, prompt, PositionMode.REORDERED, context=ChunkContext.ALONE)
    tail = len(prompt.question)
    assert float((stitched - own[-tail:]).abs().max()) < 1e-3
    assert float((stitched - other[-tail:]).abs().max()) > 1e-2


def test_a_chunk_block_holds_the_values_of_a_full_prefill_of_prefix_and_chunk(get_engine: EngineFactory) -> None:
    engine = _after_prefix(get_engine("qwen2", "cpu"))
    block = tuple(synthetic_ids(engine, [11], seed=5)[0])
    [kv] = engine.precompute([block])
    buffer, _ = engine.prefill_naive(PromptIds(engine.template.prefix, (block,), (block[0],)))
    start = len(engine.template.prefix)
    full_values = buffer.data[:, VALUES, :, start : start + len(block)]
    torch.testing.assert_close(kv.kv[:, VALUES], full_values, atol=1e-4, rtol=1e-4)
    alone = StitchEngine(engine.model, engine.template).precompute([block])[0]
    assert float((alone.kv[1:, VALUES] - full_values[1:]).abs().max()) > 1e-3  # layer 0's values see no context


def test_composite_places_chunks_where_they_were_precomputed(get_engine: EngineFactory) -> None:
    alone = get_engine("llama", "cpu")
    after = _after_prefix(alone)
    blocks = after.precompute([(5, 6, 7), (8, 9)])
    prefix = len(after.template.prefix)
    assert after.plan(PositionMode.COMPOSITE, [after.prefix_block, *blocks]).starts == (0, prefix, prefix)
    assert alone.plan(PositionMode.COMPOSITE, [alone.prefix_block, *blocks]).starts == (0, 0, 0)
    assert after.plan(PositionMode.REORDERED, [after.prefix_block, *blocks]).starts == (0, prefix, prefix + 3)


def test_the_cache_keys_blocks_of_each_context_apart(get_engine: EngineFactory) -> None:
    alone = get_engine("mistral", "cpu")
    after = _after_prefix(alone)
    assert alone.kv_version == alone.template.version  # keys of existing caches unchanged
    assert after.kv_version != alone.kv_version and after.kv_version.startswith(alone.template.version)


def test_an_unknown_context_is_refused(get_engine: EngineFactory) -> None:
    with pytest.raises(ValueError, match="sideways"):
        StitchEngine(get_engine("llama", "cpu").model, chunk_context="sideways")


def test_the_service_default_is_the_one_the_commands_use() -> None:
    """KVSTITCH_CHUNK_CONTEXT's default and the constant verify, eval and finetune default to are one value."""
    from service.cli import DEFAULT_CHUNK_CONTEXT
    from service.engine.kv_layout import SERVED_CHUNK_CONTEXT
    from service.settings import Settings

    assert Settings.model_fields["chunk_context"].default == SERVED_CHUNK_CONTEXT.value == DEFAULT_CHUNK_CONTEXT
