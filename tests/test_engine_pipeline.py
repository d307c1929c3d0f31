"""Layer-pipelined stitch + prefill: blocks arriving layer group by layer group, stitched and prefilled segment by
segment, give the logits of the stitch followed by the one-graph prefill, bit for bit.

GPU tests (marked `gpu`, skipped without CUDA) copy blocks on a side stream group-major into NaN-filled landing
tensors, optionally behind a stalled stream: a segment that ran before its layers arrived would read NaN.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch

from service.engine.cuda_graph import LayerGroups, StitchGraph, layer_groups
from service.engine.engine import StitchEngine
from service.engine.gate import BF16_TOLERANCE, synthetic_ids
from service.engine.kv_buffer import KVBuffer
from service.engine.kv_layout import KVBlock
from service.engine.offline import generate
from service.engine.prompt import PromptIds
from service.engine.sampling import SamplingParams
from service.engine.stitch import BlockReady, LayeredReady, PositionMode, plan_positions, stitch_into, stitch_layers
from service.kvcache import device

HAS_CUDA = torch.cuda.is_available()
NEEDS_CUDA = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device here")
EXTRA = 8


def test_layer_groups_split_evenly_longer_first() -> None:
    assert layer_groups(28, 4) == ((0, 7), (7, 14), (14, 21), (21, 28))
    assert layer_groups(10, 4) == ((0, 3), (3, 6), (6, 8), (8, 10))
    assert layer_groups(2, 4) == ((0, 1), (1, 2))
    with pytest.raises(ValueError):
        layer_groups(0, 2)


def test_cpu_engine_does_not_pipeline(get_engine: Callable[..., StitchEngine]) -> None:
    engine = get_engine("qwen2", "cpu")
    assert engine.pipeline_layers is None
    assert not engine.pipelines(10, 3, [None], None)


class _Layered:
    """A `LayeredReady` on the CPU that records which waits ran."""

    def __init__(self, log: list[tuple[int, int]], index: int) -> None:
        self.log = log
        self.index = index

    def __call__(self) -> None:
        self.log.append((self.index, -1))

    def layers(self, start: int, end: int) -> BlockReady:
        return lambda: self.log.append((self.index, end))


@pytest.mark.parametrize("positions", list(PositionMode))
def test_stitch_by_layer_groups_equals_the_whole_stitch_on_cpu(
    get_engine: Callable[..., StitchEngine], positions: PositionMode
) -> None:
    engine = get_engine("llama", "cpu")
    chunks = synthetic_ids(engine, (13, 5, 21), seed=31)
    blocks = [engine.prefix_block, *engine.precompute([engine.template.chunk_block(c) for c in chunks])]
    plan = plan_positions(positions, [b.num_tokens for b in blocks])
    whole = KVBuffer(engine.spec, plan.context_tokens)
    stitch_into(whole, engine.forward.rotary, blocks, plan)
    pieces = KVBuffer(engine.spec, plan.context_tokens)
    pieces.data.fill_(float("nan"))
    log: list[tuple[int, int]] = []
    ready: list[BlockReady | None] = [None, *(_Layered(log, i) for i in range(1, len(blocks)))]
    assert isinstance(ready[1], LayeredReady)
    for layers in layer_groups(engine.spec.num_layers, 2):
        stitch_layers(pieces, engine.forward.rotary, blocks, plan, ready, None, layers)
    assert torch.equal(pieces.data, whole.data)
    assert log == [(i, end) for end in (1, 2) for i in range(1, len(blocks))]


# ---- GPU ----------------------------------------------------------------------------------------------------


def _prompt(engine: StitchEngine, seed: int = 7) -> PromptIds:
    chunks = synthetic_ids(engine, (30, 17, 45, 22), seed=seed)
    return engine.template.prompt(chunks, synthetic_ids(engine, (9,), seed=seed + 1)[0])


def arriving_by_layers(
    blocks: Sequence[KVBlock], groups: LayerGroups, stall_cycles: int = 0
) -> tuple[list[KVBlock], list[device.Arrival | None], torch.cuda.Event]:
    """The blocks copied from pinned host memory on a side stream, group-major, into landing tensors filled with
    NaN first (behind a stall of `stall_cycles`); their `LayeredArrival`s and the last copy's event."""
    host = [b.kv.cpu().pin_memory() for b in blocks]
    landing = [torch.full_like(b.kv, float("nan")) for b in blocks]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    events: list[torch.cuda.Event] = []
    with torch.cuda.stream(side):
        if stall_cycles:
            torch.cuda._sleep(stall_cycles)
        for first, end in groups:
            for h, t in zip(host, landing, strict=True):
                t[first:end].copy_(h[first:end], non_blocking=True)
            event = torch.cuda.Event()
            event.record(side)
            events.append(event)
    arrived = [KVBlock(b.token_ids, t) for b, t in zip(blocks, landing, strict=True)]
    ready: list[device.Arrival | None] = list(
        device.layered_arrivals(events, groups, torch.device("cuda"), len(blocks))
    )
    return arrived, ready, events[-1]


def _graph_logits(
    engine: StitchEngine,
    prompt: PromptIds,
    blocks: Sequence[KVBlock],
    positions: str,
    ready: Sequence[BlockReady | None] | None,
) -> tuple[torch.Tensor, StitchGraph]:
    graph = engine.lease_graph(prompt.context_tokens, len(prompt.question), EXTRA)
    assert graph is not None
    try:
        graph.buffer.data.fill_(1e4)  # nothing the stitch and prefill do not write may matter
        _, logits, _ = engine.prefill_stitched(
            blocks, prompt.question, positions, EXTRA, chunk_ready=ready, graph=graph
        )
        return logits, graph
    finally:
        engine.release_graph(graph)


@pytest.mark.gpu
@NEEDS_CUDA
@pytest.mark.parametrize("positions", ["reordered", "composite"])
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("stall", [0, 1 << 27])
def test_pipelined_prefill_equals_the_one_graph_prefill(
    get_engine: Callable[..., StitchEngine], arch: str, positions: str, stall: int
) -> None:
    engine = get_engine(arch, "cuda")
    groups = engine.pipeline_layers
    assert groups is not None and len(groups) == 2  # the tiny models have 2 layers
    prompt = _prompt(engine)
    fresh = engine.precompute(prompt.blocks)
    plain, _ = _graph_logits(engine, prompt, fresh, positions, None)
    plain = plain.clone()
    _, eager, _ = engine.prefill_stitched(fresh, prompt.question, positions)
    # A first pipelined run captures the segmented graph (a capture synchronises the device); then the timed one.
    warm_blocks, warm_ready, _ = arriving_by_layers(fresh, groups)
    _graph_logits(engine, prompt, warm_blocks, positions, warm_ready)
    torch.cuda.synchronize()
    arrived, ready, last = arriving_by_layers(fresh, groups, stall)
    pipelined, graph = _graph_logits(engine, prompt, arrived, positions, ready)
    # The host returned while the copies were still queued (with the stall): the waits were on the device.
    still_copying = not last.query()
    torch.cuda.synchronize()
    assert any(key[1] == groups for key in graph._prefills)  # the segmented graph ran
    assert torch.isfinite(pipelined).all()
    assert torch.equal(pipelined, plain)
    assert float((pipelined - eager).abs().max()) <= BF16_TOLERANCE
    if stall:
        assert still_copying


@pytest.mark.gpu
@NEEDS_CUDA
@pytest.mark.parametrize("positions", ["reordered", "composite"])
def test_a_pipelined_answer_gives_the_tokens_of_the_unpipelined_engine(
    get_engine: Callable[..., StitchEngine], positions: str
) -> None:
    engine = get_engine("qwen2", "cuda")
    unpipelined = StitchEngine(engine.model, pipeline=False)
    assert engine.pipeline_layers is not None and unpipelined.pipeline_layers is None
    prompt = _prompt(engine, seed=11)
    fresh = engine.precompute(prompt.blocks)
    sampling = SamplingParams(max_new_tokens=12, ignore_eos=True)
    arrived, ready, _ = arriving_by_layers(fresh, engine.pipeline_layers, 1 << 26)
    answer = generate(engine, prompt, sampling, positions=positions, chunk_kv=arrived, chunk_ready=ready)
    arrived, ready, _ = arriving_by_layers(fresh, engine.pipeline_layers, 1 << 26)
    baseline = generate(unpipelined, prompt, sampling, positions=positions, chunk_kv=arrived, chunk_ready=ready)
    assert answer.token_ids == baseline.token_ids
    assert answer.timings.stitch_ms == 0.0  # one time for the interleaved stitch and prefill


@pytest.mark.gpu
@NEEDS_CUDA
def test_segmented_graph_is_warmed_and_falls_back_for_long_questions(
    get_engine: Callable[..., StitchEngine],
) -> None:
    engine = get_engine("llama", "cuda")
    assert engine.stitch_graphs is not None and engine.pipeline_layers is not None
    graph = engine.stitch_graphs.warm(1024, questions=(32,))
    assert 32 in graph.segmented_capture_ms
    # A question no bucket holds is not pipelined: stitched whole, prefilled eagerly in the graph's buffer.
    chunks = synthetic_ids(engine, (30, 17), seed=5)
    prompt = engine.template.prompt(chunks, synthetic_ids(engine, (600,), seed=6)[0])
    fresh = engine.precompute(prompt.blocks)
    arrived, ready, _ = arriving_by_layers(fresh, engine.pipeline_layers)
    leased = engine.lease_graph(prompt.context_tokens, len(prompt.question), EXTRA)
    assert leased is not None
    try:
        assert not engine.pipelines(prompt.context_tokens, len(prompt.question), ready, leased)
        _, got, _ = engine.prefill_stitched(
            arrived, prompt.question, extra_tokens=EXTRA, chunk_ready=ready, graph=leased
        )
    finally:
        engine.release_graph(leased)
    _, want, _ = engine.prefill_stitched(fresh, prompt.question)
    assert float((got - want).abs().max()) <= BF16_TOLERANCE
