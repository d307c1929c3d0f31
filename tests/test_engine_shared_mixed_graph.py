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

from service.engine import segment_plan, shared_decode, shared_extend_graph, shared_graph, shared_mixed_graph
from service.engine.engine import StitchEngine
from service.engine.fused_stitch import triton_available
from service.engine.scheduler import Scheduler
from service.engine.shared_mixed_graph import RIDER_BUCKETS, SharedMixedGraphs, held_reads, rider_bucket
from tests.test_engine_shared_scheduler import (
    ASKS,
    Run,
    assert_nothing_pinned,
    block_sizes,
    join_one_by_one,
    nan_arena,
    nan_pool,
)

NEEDS_GPU = pytest.mark.skipif(
    not (torch.cuda.is_available() and triton_available()), reason="needs CUDA and triton (the segment kernels)"
)


def test_riders_take_the_smallest_bucket_holding_their_count_and_tokens() -> None:
    tokens = [t for _, t in RIDER_BUCKETS]
    assert [q for q, _ in RIDER_BUCKETS] == [16] * 19
    assert tokens[:12] == [64 * k for k in range(1, 13)] and tokens[12:] == [896, 1024, 1152, 1280, 1536, 1792, 2048]
    # No wave pads more than 63 tokens up to 768, 127 up to 1,280, 255 above.
    gaps = [b - a for a, b in zip([0, *tokens], tokens, strict=False)]
    assert max(g for g, t in zip(gaps, tokens, strict=True) if t <= 768) == 64
    assert max(g for g, t in zip(gaps, tokens, strict=True) if t <= 1280) == 128 and max(gaps) == 256
    assert rider_bucket(1, 60) == (16, 64)
    assert rider_bucket(1, 90) == (16, 128)
    assert rider_bucket(2, 200) == (16, 256)
    assert rider_bucket(3, 500) == (16, 512)
    assert rider_bucket(11, 825) == (16, 896)
    assert rider_bucket(16, 1100) == (16, 1152)
    assert rider_bucket(16, 2048) == (16, 2048)
    assert rider_bucket(17, 100) is None and rider_bucket(2, 2049) is None
    # A pool spares a quarter of its slots for the padding (as the prefill's graphs): a small one, small buckets.
    assert SharedMixedGraphs.riders_for(4000) == RIDER_BUCKETS[:13]  # up to 896 tokens
    assert SharedMixedGraphs.riders_for(100) == ()
    assert rider_bucket(3, 900, SharedMixedGraphs.riders_for(4000)) is None


def test_a_step_replays_the_smallest_captured_graph_holding_its_reads() -> None:
    assert held_reads([16], 4) == 16 and held_reads([4, 16], 4) == 4 and held_reads([8, 16], 4) == 8
    assert held_reads([4, 8], 16) == 16  # none holds it: its own bucket, to be captured
    assert held_reads([], 8) == 8


def test_mixed_graphs_need_the_segment_kernels_on_cuda(get_engine: Callable[[str, str], StitchEngine]) -> None:
    engine = get_engine("qwen2", "cpu")
    scheduler = Scheduler(engine, nan_pool(engine, 2000), 8, arena=nan_arena(engine, 300), prefill_with_decode=True)
    shared = scheduler.shared
    assert shared is not None and shared.graphs is None and shared.mixed_graphs is None  # the CPU: eager riding
    with pytest.raises(ValueError, match="CUDA"):
        SharedMixedGraphs(shared.decoder, torch.zeros(4, dtype=torch.long), 0)


def sums_in_one_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks in one piece and chunk lists in one split (as the eager plans cut the tests' short ones), so every
    path sums attention in one order and graphed and eager runs compare exactly."""
    for module in (shared_graph, shared_mixed_graph):
        monkeypatch.setattr(module, "pieces_for", lambda batch: 1)
    for module in (shared_extend_graph, shared_mixed_graph):
        monkeypatch.setattr(module, "extend_splits", lambda *bucket: 1)
    monkeypatch.setattr(segment_plan, "auto_splits", lambda *programs: 1)


@pytest.mark.gpu
@NEEDS_GPU
@pytest.mark.parametrize("overlap", [False, True], ids=["read-each-step", "overlapped"])
@pytest.mark.parametrize("arch", ("llama", "qwen2"))
@pytest.mark.parametrize("concurrent", (False, True), ids=["one-stream", "riders-beside"])
def test_graphed_riders_decode_the_eager_riders_tokens(
    get_engine: Callable[[str, str], StitchEngine],
    arch: str,
    overlap: bool,
    concurrent: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Graphed mixed steps decode the eager ones' tokens, with the riders' attention after the running answers'
    or beside it on a second stream (`CONCURRENT_SPLIT`)."""
    monkeypatch.setattr(shared_decode, "CONCURRENT_SPLIT", concurrent)
    engine = get_engine(arch, "cuda")
    sums_in_one_order(monkeypatch)

    def run(graphs: bool) -> tuple[list[tuple[list[int], str, str]], int, int, dict[str, int]]:
        arena = nan_arena(engine, sum(block_sizes(engine)))
        pool = nan_pool(engine, 4000)
        scheduler = Scheduler(
            engine, pool, 8, overlap=overlap, cuda_graphs=graphs, arena=arena, prefill_with_decode=True
        )
        shared = scheduler.shared
        assert shared is not None and (shared.mixed_graphs is not None) == graphs
        requests = Run(engine, ASKS)
        join_one_by_one(scheduler, requests.requests)
        replays = shared.mixed_graphs.replays if shared.mixed_graphs is not None else 0
        rode = scheduler.prefilled_with_decode
        tokens = scheduler.rider_tokens()
        shared.close()  # the graphs' scratch slabs back to the pool
        assert_nothing_pinned(scheduler)
        return requests.outcomes(), rode, replays, tokens

    eager, eager_rode, _, eager_tokens = run(False)
    graphed, rode, replays, tokens = run(True)
    assert eager_rode == rode == 3  # the shared questions joining while answers ran (the naive one cannot ride)
    assert replays == 3
    assert graphed == eager
    # Each of the three rode alone, in the smallest bucket holding its question: the padding is the rest of it.
    lengths = [len(Run(engine, ASKS).requests[i].prompt.question) for i in (2, 4, 5)]
    assert tokens["question"] == eager_tokens["question"] == sum(lengths) and eager_tokens["padding"] == 0
    buckets = [rider_bucket(1, n) for n in lengths]
    assert None not in buckets
    assert tokens["padding"] == sum(bucket[1] - n for n, bucket in zip(lengths, buckets, strict=True) if bucket)


@pytest.mark.gpu
@NEEDS_GPU
def test_mixed_steps_are_warmed_at_the_most_reads_and_serve_steps_reading_fewer(
    get_engine: Callable[[str, str], StitchEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Start-up captures the mixed steps for the most reads only; questions riding over fewer chunks replay those
    graphs (no capture while serving) and decode the eager path's tokens (splits fixed at one, as above)."""
    engine = get_engine("qwen2", "cuda")
    sums_in_one_order(monkeypatch)

    def run(graphs: bool) -> tuple[list[tuple[list[int], str, str]], set[int], int, int]:
        scheduler = Scheduler(
            engine,
            nan_pool(engine, 4000),
            8,
            cuda_graphs=graphs,
            arena=nan_arena(engine, sum(block_sizes(engine))),
            prefill_with_decode=True,
        )
        shared = scheduler.shared
        assert shared is not None
        mixed = shared.mixed_graphs
        if mixed is not None:
            shared.warm(16, 8, 1)
        captured = len(mixed._graphs) if mixed is not None else 0
        requests = Run(engine, ASKS)
        join_one_by_one(scheduler, requests.requests)
        reads = {r for _, r, _ in mixed._graphs} if mixed is not None else set()
        replays = mixed.replays if mixed is not None else 0
        grew = (len(mixed._graphs) if mixed is not None else 0) - captured
        shared.close()
        assert_nothing_pinned(scheduler)
        return requests.outcomes(), reads, replays, grew

    eager, *_ = run(False)
    graphed, reads, replays, grew = run(True)
    assert reads == {16} and grew == 0  # the asks read at most 3 chunks: the 16-read graphs served them
    assert replays == 3 and graphed == eager
