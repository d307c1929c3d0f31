"""CUDA-graph decode computes what eager decode computes and never attends past the buffer's length.

The GPU tests run the tiny models in bf16 on CUDA (marked `gpu`, skipped without CUDA); the CPU tests check
the bucketing and that the engine option falls back to the eager step where there is no GPU.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from service.engine.cuda_graph import DecodeGraph, bucket_capacity
from service.engine.engine import StitchEngine
from service.engine.gate import BF16_TOLERANCE, synthetic_ids
from service.engine.kv_buffer import KVBuffer
from service.engine.sampling import SamplingParams

HAS_CUDA = torch.cuda.is_available()
NEEDS_CUDA = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device here")
STEPS = 24


def test_buckets_are_powers_of_two_capped_at_the_context() -> None:
    assert bucket_capacity(1, 32768) == 1024
    assert bucket_capacity(1024, 32768) == 1024
    assert bucket_capacity(1025, 32768) == 2048
    assert bucket_capacity(8300, 32768) == 16384
    assert bucket_capacity(5000, 6000) == 6000
    with pytest.raises(ValueError, match="context"):
        bucket_capacity(7000, 6000)


def test_cpu_engine_decodes_eagerly_even_when_asked_for_graphs(get_engine: Callable[..., StitchEngine]) -> None:
    eager = get_engine("qwen2", "cpu")
    asked = StitchEngine(eager.model, cuda_graphs=True)
    assert asked.decode_graphs is None
    with pytest.raises(ValueError, match="CUDA"):
        DecodeGraph(eager.forward, 1024)
    prompt = eager.template.prompt(synthetic_ids(eager, (12, 20), seed=3), [5, 6, 7])
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    runs = [engine.generate(prompt, params) for engine in (eager, asked)]
    for run in runs:
        list(run)
    assert runs[0].result.token_ids == runs[1].result.token_ids


def _stitched(engine: StitchEngine, positions: str) -> tuple[KVBuffer, torch.Tensor]:
    chunks = synthetic_ids(engine, (30, 17, 45), seed=7)
    prompt = engine.template.prompt(chunks, synthetic_ids(engine, (9,), seed=8)[0])
    kv = engine.precompute(prompt.blocks)
    buffer, logits, _ = engine.prefill_stitched(kv, prompt.question, positions, extra_tokens=STEPS + 1)
    return buffer, logits


def _copy(buffer: KVBuffer) -> KVBuffer:
    twin = KVBuffer(buffer.spec, buffer.capacity)
    twin.data.copy_(buffer.data)
    twin.commit(buffer.length, buffer.next_position)
    return twin


@pytest.mark.gpu
@NEEDS_CUDA
@pytest.mark.parametrize("attention", ["sdpa_mask", "auto"])
@pytest.mark.parametrize("positions", ["reordered", "composite"])
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_graph_steps_match_eager_steps(
    get_engine: Callable[..., StitchEngine], arch: str, positions: str, attention: str
) -> None:
    engine = get_engine(arch, "cuda")
    buffer, logits = _stitched(engine, positions)
    twin = _copy(buffer)
    graph = DecodeGraph(engine.forward, bucket_capacity(twin.capacity, engine.spec.max_context), attention)
    graph.load(twin)
    token = int(torch.argmax(logits))
    for step in range(STEPS):
        # Teacher-forced: both paths see the eager path's tokens, so one near-tie cannot derail the rest.
        eager = engine.forward.extend(buffer, [token], torch.tensor([buffer.next_position]))
        replayed = graph.step(token).clone()
        diff = float((eager - replayed).abs().max())
        assert diff <= BF16_TOLERANCE, f"step {step}: |eager - graph| = {diff:.4f} ({graph.attention})"
        top2 = torch.topk(eager, 2).values
        if float(top2[0] - top2[1]) > 2 * BF16_TOLERANCE:
            assert graph.greedy_token() == int(torch.argmax(eager)), f"step {step}"
        token = int(torch.argmax(eager))
    assert (graph.buffer.length, graph.buffer.next_position) == (buffer.length, buffer.next_position)


@pytest.mark.gpu
@NEEDS_CUDA
@pytest.mark.parametrize("attention", ["sdpa_mask", "auto"])
def test_slots_past_the_length_are_never_attended(get_engine: Callable[..., StitchEngine], attention: str) -> None:
    engine = get_engine("qwen2", "cuda")
    buffer, logits = _stitched(engine, "reordered")
    graph = DecodeGraph(engine.forward, bucket_capacity(buffer.capacity, engine.spec.max_context), attention)
    token = int(torch.argmax(logits))
    graph.load(buffer)
    clean = [graph.step(t).clone() for t in (token, 5, 9)]
    graph.load(buffer)
    # Huge finite keys and values everywhere past the live tokens: any leak dominates the softmax and the sum.
    graph.buffer.data[:, :, :, buffer.length :] = 1e4
    poisoned = [graph.step(t).clone() for t in (token, 5, 9)]
    for a, b in zip(clean, poisoned, strict=True):
        assert torch.isfinite(b).all()
        assert float((a - b).abs().max()) <= 1e-3, graph.attention


@pytest.mark.gpu
@NEEDS_CUDA
@pytest.mark.parametrize("positions", ["reordered", "composite"])
def test_generate_with_graphs_gives_the_eager_tokens(get_engine: Callable[..., StitchEngine], positions: str) -> None:
    base = get_engine("qwen2", "cuda")
    graphed = StitchEngine(base.model, cuda_graphs=True)
    eager = StitchEngine(base.model, cuda_graphs=False)
    chunks = synthetic_ids(base, (40, 25), seed=11)
    prompt = base.template.prompt(chunks, base.encode_question("What is it?"))
    params = SamplingParams(max_new_tokens=STEPS, ignore_eos=True)
    streams = [engine.generate(prompt, params, positions=positions) for engine in (eager, graphed)]
    texts = ["".join(stream) for stream in streams]
    assert graphed.decode_graphs is not None and graphed.decode_graphs.capture_ms
    assert streams[0].result.token_ids == streams[1].result.token_ids
    assert texts[0] == texts[1]
    # Seeded sampling runs eagerly on the graph's static logits; a second request reuses the captured graph.
    sampled = SamplingParams(max_new_tokens=8, temperature=1.0, seed=4, ignore_eos=True)
    runs = [engine.generate(prompt, sampled, positions=positions) for engine in (eager, graphed)]
    for run in runs:
        list(run)
    assert len(runs[1].result.token_ids) == 8
    assert len(graphed.decode_graphs.capture_ms) == 1
