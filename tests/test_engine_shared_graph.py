"""Shared decode steps through CUDA graphs (`shared_graph.py`) against the same steps run eagerly (CUDA only).

The two schedulers differ only in `cuda_graphs`: with it, every shared decode step of up to 256 rows replays a
graph captured for its (batch, reads) bucket, its segment plan padded to the bucket's capacity and copied into the
captured one. Same requests as the CPU scheduler tests (sharing chunks, a naive one, one without chunks, half
joining after two steps), pools and arenas NaN-poisoned: the tokens and texts must be the eager steps'.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from service.engine.engine import StitchEngine
from service.engine.fused_stitch import triton_available
from service.engine.scheduler import Scheduler
from service.engine.shared_graph import SHARED_BUCKETS, capacity_for, pieces_for, reads_bucket
from tests.test_engine_shared_scheduler import ASKS, Run, assert_nothing_pinned, block_sizes, drain, nan_arena, nan_pool

NEEDS_GPU = pytest.mark.skipif(
    not (torch.cuda.is_available() and triton_available()), reason="needs CUDA and triton (the segment kernels)"
)


def test_buckets_cover_every_batch_and_size_plans_for_their_worst_case() -> None:
    """Host-side sizing (no GPU needed): reads round up to powers of two from 4; a bucket's capacity holds every
    row reading its reads, each chunk cut into the bucket's pieces, one tile per (entry, piece) and width."""
    assert [reads_bucket(n) for n in (0, 1, 4, 5, 16, 17)] == [4, 4, 4, 8, 16, 32]
    assert SHARED_BUCKETS[0] == 1 and SHARED_BUCKETS[-1] == 256 and list(SHARED_BUCKETS) == sorted(SHARED_BUCKETS)
    assert [pieces_for(b) for b in (1, 2, 4, 8, 16)] == [4, 4, 2, 2, 1]
    capacity = capacity_for(8, 16, 2)
    assert (capacity.rows, capacity.entries, capacity.pairs, capacity.chunk_tiles) == (8, 128, 264, 256)


@pytest.mark.gpu
@NEEDS_GPU
@pytest.mark.parametrize("overlap", [False, True], ids=["read-each-step", "overlapped"])
@pytest.mark.parametrize("arch", ("llama", "qwen2"))
def test_graphed_shared_steps_decode_the_eager_steps_tokens(
    get_engine: Callable[[str, str], StitchEngine], arch: str, overlap: bool
) -> None:
    engine = get_engine(arch, "cuda")

    def run(graphs: bool) -> tuple[list[tuple[list[int], str, str]], int]:
        arena = nan_arena(engine, sum(block_sizes(engine)))
        pool = nan_pool(engine, 2000)
        scheduler = Scheduler(engine, pool, max_batch=8, overlap=overlap, cuda_graphs=graphs, arena=arena)
        shared = scheduler.shared
        assert shared is not None and (shared.graphs is not None) == graphs
        requests = Run(engine, ASKS)
        for request in requests.requests[:3]:
            scheduler.add(request)
        scheduler.step()
        scheduler.step()
        for request in requests.requests[3:]:
            scheduler.add(request)
        drain(scheduler)
        captured = len(shared.graphs._graphs) if shared.graphs is not None else 0
        shared.close()  # the graphs' scratch slot back to the pool
        assert_nothing_pinned(scheduler)
        return requests.outcomes(), captured

    eager, _ = run(False)
    graphed, captured = run(True)
    assert captured >= 2  # batches of several sizes ran through their own graphs
    assert graphed == eager
