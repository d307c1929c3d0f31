"""The KV cache's host tier copied layer group by layer group under a pipelined prefill (GPU only)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from service.engine.engine import StitchEngine
from service.engine.gate import synthetic_ids
from service.engine.offline import generate
from service.engine.sampling import SamplingParams
from service.kvcache import device
from service.kvcache.index import SQLITE_FILENAME, SqliteIndex
from service.kvcache.store import TierBudgets
from service.kvcache.tiers import Tier
from service.serving.kv_source import kv_store_for

HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device here")
EXTRA = 8


def stall(stream: torch.cuda.Stream | None, cycles: int = 1 << 27) -> None:
    with torch.cuda.stream(stream):
        torch.cuda._sleep(cycles)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("positions", ["reordered", "composite"])
def test_host_tier_by_layers_gives_the_logits_and_tokens_of_fresh_blocks(
    get_engine: Callable[..., StitchEngine], tmp_path: Path, positions: str
) -> None:
    engine = get_engine("qwen2", "cuda")
    groups = engine.pipeline_layers
    assert groups is not None
    prompt = engine.template.prompt(synthetic_ids(engine, (40, 17, 33, 25), seed=3), [5, 6, 7])
    n = len(prompt.blocks)
    fresh = engine.precompute(prompt.blocks)
    graph = engine.lease_graph(prompt.context_tokens, len(prompt.question), EXTRA)
    assert graph is not None
    try:
        _, expected, _ = engine.prefill_stitched(fresh, prompt.question, positions, EXTRA, graph=graph)
        expected = expected.clone()
    finally:
        engine.release_graph(graph)
    sampling = SamplingParams(max_new_tokens=10, ignore_eos=True)
    baseline = generate(engine, prompt, sampling, positions=positions, chunk_kv=fresh)
    index = SqliteIndex(tmp_path / SQLITE_FILENAME)
    try:
        with kv_store_for(engine, tmp_path / "cache", index, TierBudgets(0, 1 << 24, 1 << 26)) as store:
            store.fetch(prompt.blocks)  # misses, demoted into the pinned host pool
            store.flush()
            # The segmented prefill graph is captured on first use, and a capture synchronises the device (as a
            # server's start-up warm-up does): capture it before the stall, so the stall shows the waits are real.
            warm = store.fetch(prompt.blocks, overlap=True)
            graph = engine.lease_graph(prompt.context_tokens, len(prompt.question), EXTRA)
            assert graph is not None
            try:
                engine.prefill_stitched(
                    warm.blocks, prompt.question, positions, EXTRA, chunk_ready=warm.ready, graph=graph
                )
            finally:
                engine.release_graph(graph)
            stall(store.host.stream)
            result = store.fetch(prompt.blocks, overlap=True)
            assert result.counts[Tier.HOST] == n
            ready = result.ready
            assert all(isinstance(r, device.LayeredArrival) for r in ready)
            layered = [r for r in ready if isinstance(r, device.LayeredArrival)]
            assert all(r.arrivals is layered[0].arrivals for r in layered)  # one wait per group for all blocks
            assert len(layered[0].arrivals) == len(groups)
            graph = engine.lease_graph(prompt.context_tokens, len(prompt.question), EXTRA)
            assert graph is not None
            try:
                graph.buffer.data.fill_(1e4)
                _, got, _ = engine.prefill_stitched(
                    result.blocks, prompt.question, positions, EXTRA, chunk_ready=ready, graph=graph
                )
                returned_early = not device.is_done(layered[0].event)
                got = got.clone()
            finally:
                engine.release_graph(graph)
            stall(store.host.stream)
            again = store.fetch(prompt.blocks, overlap=True)
            answer = generate(
                engine, prompt, sampling, positions=positions, chunk_kv=again.blocks, chunk_ready=again.ready
            )
            assert 0 < result.timings.h2d_ms < 60
            # Without overlap the fetch orders the caller's stream after every copy: blocks arrive whole.
            plain = store.fetch(prompt.blocks)
            assert not any(isinstance(r, device.LayeredArrival) for r in plain.ready)
    finally:
        index.close()
    assert torch.isfinite(got).all()
    assert torch.equal(got, expected)
    assert answer.token_ids == baseline.token_ids
    assert returned_early  # the host went on while the copies were still queued: the waits were on the device
