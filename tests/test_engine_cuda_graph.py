"""CUDA-graph decode computes what eager decode computes and never attends past the buffer's length.

The GPU tests run the tiny models in bf16 on CUDA (marked `gpu`, skipped without CUDA); the CPU tests check
the bucketing and that the engine option falls back to the eager step where there is no GPU.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from service.engine.attention import PREFILL_KV_SPLITS, LengthInputs, prefill_kv_splits, resolve_attention
from service.engine.cuda_graph import StitchGraph, bucket_capacity, graph_tokens, question_bucket
from service.engine.engine import StitchEngine
from service.engine.gate import BF16_TOLERANCE, synthetic_ids
from service.engine.kv_layout import KVBlock
from service.engine.offline import generate
from service.engine.prompt import PromptIds
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
    assert asked.stitch_graphs is None
    with pytest.raises(ValueError, match="CUDA"):
        StitchGraph(eager.forward, 1024)
    prompt = eager.template.prompt(synthetic_ids(eager, (12, 20), seed=3), [5, 6, 7])
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    runs = [generate(engine, prompt, params) for engine in (eager, asked)]
    assert runs[0].token_ids == runs[1].token_ids


def _assert_greedy_under_eager(engine: StitchEngine, prompt: PromptIds, positions: str, tokens: list[int]) -> None:
    """`tokens` are greedy picks of the eager path fed them, up to bf16 ties: each is within the tolerance of
    eager's best logit, and equal to eager's argmax wherever that leads by more than twice the tolerance."""
    kv = engine.precompute(prompt.blocks)
    buffer, logits, _ = engine.prefill_stitched(kv, prompt.question, positions, extra_tokens=len(tokens))
    for step, token in enumerate(tokens):
        gap = float(logits.max() - logits[token])
        assert gap <= BF16_TOLERANCE, f"step {step}: token {token} is {gap:.4f} below eager's best"
        top2 = torch.topk(logits, 2).values
        if float(top2[0] - top2[1]) > 2 * BF16_TOLERANCE:
            assert token == int(torch.argmax(logits)), f"step {step}"
        logits = engine.forward.extend(buffer, [token], torch.tensor([buffer.next_position]))


@pytest.mark.gpu
@NEEDS_CUDA
@pytest.mark.parametrize("positions", ["reordered", "composite"])
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_answers_with_graphs_give_the_eager_tokens(
    get_engine: Callable[..., StitchEngine], arch: str, positions: str
) -> None:
    """Through the scheduler (graphs: the question through a prefill graph, the decode steps through the batched step's
    graphs; eager: neither). Graph and eager differ only by bf16 rounding (the question's K/V comes from another
    attention kernel), so on random tiny models a near-tie may flip a token and the sequences part there; every token
    the graph path picks must still be eager's greedy pick given the same history."""
    base = get_engine(arch, "cuda")
    graphed = StitchEngine(base.model, cuda_graphs=True)
    eager = StitchEngine(base.model, cuda_graphs=False)
    chunks = synthetic_ids(base, (40, 25), seed=11)
    params = SamplingParams(max_new_tokens=STEPS, ignore_eos=True)
    # A short question goes through a prefill graph; one longer than every bucket prefills eagerly inside the
    # graph's buffer and then decodes in the graph.
    for question in (base.encode_question("What is it?"), synthetic_ids(base, (600,), seed=12)[0]):
        prompt = base.template.prompt(chunks, question)
        results = [generate(engine, prompt, params, positions=positions) for engine in (eager, graphed)]
        texts = [result.text for result in results]
        tokens = [result.token_ids for result in results]
        _assert_greedy_under_eager(eager, prompt, positions, tokens[1])
        assert tokens[0][0] == tokens[1][0]
        if tokens[0] == tokens[1]:
            assert texts[0] == texts[1]
    assert graphed.stitch_graphs is not None
    captured = dict(graphed.stitch_graphs.prefill_capture_ms)
    assert captured, "the question did not go through a prefill graph"
    # Seeded sampling runs eagerly on the graph's static logits; a second request reuses the captured graph.
    sampled = SamplingParams(max_new_tokens=8, temperature=1.0, seed=4, ignore_eos=True)
    runs = [generate(engine, prompt, sampled, positions=positions) for engine in (eager, graphed)]
    assert len(runs[1].token_ids) == 8
    assert graphed.stitch_graphs.prefill_capture_ms == captured


# ---- question prefill graphs ---------------------------------------------------------------------------------


def test_question_buckets() -> None:
    assert [question_bucket(n) for n in (1, 32, 33, 100, 128, 129, 512)] == [32, 32, 64, 128, 128, 256, 512]
    assert question_bucket(513) is None
    assert question_bucket(5, (8, 4)) == 8
    with pytest.raises(ValueError, match="token"):
        question_bucket(0)


def test_graph_tokens_leave_room_for_the_padded_question() -> None:
    # The answer budget covers the padding: nothing more is needed.
    assert graph_tokens(1000, 100, 256, 32768) == 1356
    # A short budget: the question's padding to 128 needs the room.
    assert graph_tokens(1000, 100, 4, 32768) == 1128
    # Padding would pass the model's context: the live sequence only (that question prefills eagerly).
    assert graph_tokens(4000, 90, 2, 4096) == 4092
    # Longer than any bucket: the live sequence only.
    assert graph_tokens(1000, 600, 8, 32768) == 1608


def _padded_static_prefill(
    engine: StitchEngine, kv: list[KVBlock], question: tuple[int, ...], positions: str, backend: str
) -> torch.Tensor:
    """What a prefill graph runs, without the graph: the question padded to its bucket, poisoned slots after."""
    tokens = question_bucket(len(question))
    assert tokens is not None
    buffer, plan = engine.stitch(kv, positions, 1024 - sum(b.num_tokens for b in [engine.prefix_block, *kv]))
    buffer.data[:, :, :, plan.context_tokens :] = 1e4
    ids = torch.zeros((1, tokens), dtype=torch.long, device=engine.spec.device)
    ids[0, : len(question)] = torch.tensor(question)
    offsets = torch.arange(tokens, device=engine.spec.device)
    slots = plan.context_tokens + offsets
    # Private on purpose: the test drives the attention a graph builds, on any device.
    attend = LengthInputs(engine.spec, buffer.capacity, tokens).attend_for(backend, slots)
    last = torch.tensor([len(question) - 1], device=engine.spec.device)
    return engine.forward.forward_static(buffer.data, ids, plan.question_start + offsets, slots, attend, last)


@pytest.mark.parametrize("positions", ["reordered", "composite"])
def test_static_prefill_of_a_padded_question_equals_eager_prefill(
    get_engine: Callable[..., StitchEngine], arch: str, positions: str
) -> None:
    """fp32 on the CPU: end padding and poisoned slots past it change nothing for the real tokens."""
    engine = get_engine(arch, "cpu")
    chunks = synthetic_ids(engine, (30, 17, 45), seed=7)
    for length in (3, 40):
        prompt = engine.template.prompt(chunks, synthetic_ids(engine, (length,), seed=8)[0])
        kv = engine.precompute(prompt.blocks)
        _, eager, _ = engine.prefill_stitched(kv, prompt.question, positions)
        static = _padded_static_prefill(engine, kv, prompt.question, positions, "sdpa_mask")
        assert float((static - eager).abs().max()) <= 1e-4


@pytest.mark.gpu
@NEEDS_CUDA
@pytest.mark.parametrize("attention", ["sdpa_mask", "auto"])
@pytest.mark.parametrize("positions", ["reordered", "composite"])
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_graph_prefill_matches_eager_prefill(
    get_engine: Callable[..., StitchEngine], arch: str, positions: str, attention: str
) -> None:
    engine = get_engine(arch, "cuda")
    chunks = synthetic_ids(engine, (30, 17, 45), seed=7)
    kv = engine.precompute(engine.template.prompt(chunks, [5]).blocks)
    graph = StitchGraph(engine.forward, 1024, attention)
    for length in (5, 50, 100, 200):  # buckets 32, 64, 128, 256; none a multiple of its bucket
        question = tuple(synthetic_ids(engine, (length,), seed=length)[0])
        eager_buffer, eager, _ = engine.prefill_stitched(kv, question, positions, extra_tokens=STEPS)
        graph.buffer.data.fill_(1e4)  # poison: every slot the stitch and the prefill do not write
        buffer, logits, _ = engine.prefill_stitched(kv, question, positions, graph=graph)
        assert buffer is graph.buffer
        assert (buffer.length, buffer.next_position) == (eager_buffer.length, eager_buffer.next_position)
        diff = float((logits - eager).abs().max())
        assert diff <= BF16_TOLERANCE, f"{length} tokens: |eager - graph| = {diff:.4f} ({graph.attention})"
    assert set(graph.prefill_capture_ms) == {32, 64, 128, 256}


@pytest.mark.gpu
@NEEDS_CUDA
def test_prefill_graph_ignores_its_inputs_past_the_question(get_engine: Callable[..., StitchEngine]) -> None:
    """The padding ids and whatever the padded slots held before do not reach the real tokens' logits."""
    engine = get_engine("qwen2", "cuda")
    kv = engine.precompute(engine.template.prompt(synthetic_ids(engine, (40, 25), seed=3), [5]).blocks)
    graph = StitchGraph(engine.forward, 1024, "auto")
    question = tuple(synthetic_ids(engine, (21,), seed=4)[0])
    _, clean, _ = engine.prefill_stitched(kv, question, graph=graph)
    prefill = graph.prefill_graph(32)
    # A longer question first leaves its own ids in the padding positions and K/V in the padded slots.
    engine.prefill_stitched(kv, tuple(synthetic_ids(engine, (31,), seed=5)[0]), graph=graph)
    _, again, _ = engine.prefill_stitched(kv, question, graph=graph)
    assert graph.prefill_graph(32) is prefill
    assert float((clean - again).abs().max()) <= 1e-3


@pytest.mark.gpu
@NEEDS_CUDA
def test_flash_prefill_runs_split_over_the_context(get_engine: Callable[..., StitchEngine]) -> None:
    """On a GPU with flash the prefill graphs use the split-KV attention (it passed its probe, empty ranges
    included); a fallback to one causal call would be correct but slower at long contexts."""
    spec = get_engine("qwen2", "cuda").spec
    attention = resolve_attention(spec, "auto")
    assert attention == "flash_varlen"
    assert prefill_kv_splits(spec, attention) == PREFILL_KV_SPLITS
