"""Stitching blocks that are still arriving: each block's wait runs just before that block is read."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from kv_support import bits

from service.engine.engine import StitchEngine
from service.engine.gate import synthetic_ids
from service.engine.kv_buffer import KVBuffer
from service.engine.kv_layout import KVBlock
from service.engine.offline import generate
from service.engine.sampling import SamplingParams
from service.engine.stitch import PositionMode, plan_positions, stitch_into

EngineFactory = Callable[..., StitchEngine]


@pytest.fixture
def engine(get_engine: EngineFactory) -> StitchEngine:
    return get_engine("llama", "cpu")


def chunk_blocks(engine: StitchEngine) -> list[KVBlock]:
    chunks = synthetic_ids(engine, (13, 5, 21), seed=31)
    return engine.precompute([engine.template.chunk_block(c) for c in chunks])


@pytest.mark.parametrize("positions", list(PositionMode))
def test_each_block_arrives_only_when_its_wait_runs_and_the_stitch_still_matches(
    engine: StitchEngine, positions: PositionMode
) -> None:
    real = [engine.prefix_block, *chunk_blocks(engine)]
    plan = plan_positions(positions, [b.num_tokens for b in real])
    expected = KVBuffer(engine.spec, plan.context_tokens)
    stitch_into(expected, engine.forward.rotary, real, plan)
    # Landing zones of the chunks: zero until a block's wait "lands" its copy, as a copy stream would. The
    # prefix is resident (no wait).
    landing = [real[0], *(KVBlock(b.token_ids, torch.zeros_like(b.kv)) for b in real[1:])]
    buffer = KVBuffer(engine.spec, plan.context_tokens)
    buffer.data.fill_(float("nan"))
    placed_at_wait: list[list[bool]] = []

    def arrive(i: int) -> Callable[[], None]:
        def wait() -> None:
            placed_at_wait.append([not bool(buffer.data[:, :, :, s].isnan().all()) for s in plan.slots])
            landing[i].kv.copy_(real[i].kv)

        return wait

    stitch_into(buffer, engine.forward.rotary, landing, plan, [None, *(arrive(i) for i in range(1, len(real)))])

    # The wait of block i ran after blocks 0..i-1 were placed and before block i (or any later one) was.
    assert placed_at_wait == [[j < i for j in range(len(real))] for i in range(1, len(real))]
    assert torch.equal(bits(buffer.data), bits(expected.data))
    assert (buffer.length, buffer.next_position) == (expected.length, expected.next_position)


def test_engine_paths_pass_chunk_ready_through(engine: StitchEngine) -> None:
    chunks = synthetic_ids(engine, (13, 5, 21), seed=31)
    prompt = engine.template.prompt(chunks, synthetic_ids(engine, [6], seed=32)[0])
    blocks = engine.precompute(prompt.blocks)
    calls: list[int] = []
    ready = [lambda i=i: calls.append(i) for i in range(len(blocks))]
    sampling = SamplingParams(max_new_tokens=4, ignore_eos=True)

    _, plain, _ = engine.prefill_stitched(blocks, prompt.question, all_logits=True)
    _, waited, _ = engine.prefill_stitched(blocks, prompt.question, all_logits=True, chunk_ready=ready)
    answer = generate(engine, prompt, sampling, chunk_kv=blocks, chunk_ready=[None, ready[1], None])
    baseline = generate(engine, prompt, sampling, chunk_kv=blocks)

    assert calls == [0, 1, 2, 1]
    assert torch.equal(waited, plain)
    assert answer.token_ids == baseline.token_ids


def test_chunk_ready_must_match_the_blocks(engine: StitchEngine) -> None:
    blocks = chunk_blocks(engine)
    prompt = engine.template.prompt(synthetic_ids(engine, (13, 5, 21), seed=31), [1, 2, 3])
    with pytest.raises(ValueError, match="2 ready entries for 3 chunk blocks"):
        engine.stitch(blocks, PositionMode.REORDERED, 4, chunk_ready=[None, None])
    with pytest.raises(ValueError, match="needs the `chunk_kv`"):
        generate(engine, prompt, SamplingParams(max_new_tokens=1), chunk_ready=[None] * 3)
    plan = plan_positions(PositionMode.REORDERED, [b.num_tokens for b in blocks])
    with pytest.raises(ValueError, match="1 ready entries for 3 blocks"):
        stitch_into(KVBuffer(engine.spec, plan.context_tokens), engine.forward.rotary, blocks, plan, [None])
