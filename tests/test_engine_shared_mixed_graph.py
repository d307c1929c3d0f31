"""Shared questions riding in decode steps through CUDA graphs (`shared_mixed_graph.py`).

On the CPU: the rider buckets and what a mixed graph takes. On CUDA (`pytest -m gpu
tests/test_engine_shared_mixed_graph.py`): schedulers with questions joining while answers run, riding eagerly and
through the mixed graphs (chunks in one piece and chunk lists in one split, as the eager plans cut these short
ones, so the sums run in one order): every token and text is the eager run's, and the riders went through graphs.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from service.engine import segment_plan, shared_extend_graph, shared_graph, shared_mixed_graph
from service.engine.engine import StitchEngine
from service.engine.fused_stitch import triton_available
from service.engine.scheduler import Scheduler
from service.engine.shared_mixed_graph import RIDER_BUCKETS, SharedMixedGraphs, rider_bucket
from tests.test_engine_shared_scheduler import ASKS, Run, assert_nothing_pinned, block_sizes, drain, nan_arena, nan_pool

NEEDS_GPU = pytest.mark.skipif(
    not (torch.cuda.is_available() and triton_available()), reason="needs CUDA and triton (the segment kernels)"
)


def test_riders_take_the_smallest_bucket_holding_their_count_and_tokens() -> None:
    assert [q for q, _ in RIDER_BUCKETS] == [16] * 11
    assert [t for _, t in RIDER_BUCKETS] == [64, 128, 192, 256, 320, 384, 512, 768, 1024, 1536, 2048]
    assert rider_bucket(1, 60) == (16, 64)
    assert rider_bucket(1, 90) == (16, 128)
    assert rider_bucket(2, 200) == (16, 256)
    assert rider_bucket(3, 500) == (16, 512)
    assert rider_bucket(16, 1100) == (16, 1536)
    assert rider_bucket(16, 2048) == (16, 2048)
    assert rider_bucket(17, 100) is None and rider_bucket(2, 2049) is None
    # A pool spares a quarter of its slots for the padding (as the prefill's graphs): a small one, small buckets.
    assert SharedMixedGraphs.riders_for(4000) == RIDER_BUCKETS[:8]
    assert SharedMixedGraphs.riders_for(100) == ()
    assert rider_bucket(3, 800, SharedMixedGraphs.riders_for(4000)) is None


def test_mixed_graphs_need_the_segment_kernels_on_cuda(get_engine: Callable[[str, str], StitchEngine]) -> None:
    engine = get_engine("qwen2", "cpu")
    scheduler = Scheduler(engine, nan_pool(engine, 2000), 8, arena=nan_arena(engine, 300), prefill_with_decode=True)
    shared = scheduler.shared
    assert shared is not None and shared.graphs is None and shared.mixed_graphs is None  # the CPU: eager riding
    with pytest.raises(ValueError, match="CUDA"):
        SharedMixedGraphs(shared.decoder, torch.zeros(4, dtype=torch.long), 0)


@pytest.mark.gpu
@NEEDS_GPU
@pytest.mark.parametrize("overlap", [False, True], ids=["read-each-step", "overlapped"])
@pytest.mark.parametrize("arch", ("llama", "qwen2"))
def test_graphed_riders_decode_the_eager_riders_tokens(
    get_engine: Callable[[str, str], StitchEngine], arch: str, overlap: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = get_engine(arch, "cuda")
    for module in (shared_graph, shared_mixed_graph):
        monkeypatch.setattr(module, "pieces_for", lambda batch: 1)
    for module in (shared_extend_graph, shared_mixed_graph):
        monkeypatch.setattr(module, "extend_splits", lambda *bucket: 1)
    monkeypatch.setattr(segment_plan, "auto_splits", lambda *programs: 1)

    def run(graphs: bool) -> tuple[list[tuple[list[int], str, str]], int, int]:
        arena = nan_arena(engine, sum(block_sizes(engine)))
        pool = nan_pool(engine, 4000)
        scheduler = Scheduler(
            engine, pool, 8, overlap=overlap, cuda_graphs=graphs, arena=arena, prefill_with_decode=True
        )
        shared = scheduler.shared
        assert shared is not None and (shared.mixed_graphs is not None) == graphs
        requests = Run(engine, ASKS)
        for request in requests.requests[:2]:
            scheduler.add(request)
        scheduler.step()
        for request in requests.requests[2:]:  # one joins at each step, while the first ones run
            scheduler.add(request)
            scheduler.step()
        drain(scheduler)
        replays = shared.mixed_graphs.replays if shared.mixed_graphs is not None else 0
        rode = scheduler.prefilled_with_decode
        shared.close()  # the graphs' scratch slabs back to the pool
        assert_nothing_pinned(scheduler)
        return requests.outcomes(), rode, replays

    eager, eager_rode, _ = run(False)
    graphed, rode, replays = run(True)
    assert eager_rode == rode == 3  # the shared questions joining while answers ran (the naive one cannot ride)
    assert replays == 3
    assert graphed == eager
