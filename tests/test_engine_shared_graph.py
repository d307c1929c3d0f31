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

from service.engine import shared_graph
from service.engine.engine import StitchEngine
from service.engine.fused_stitch import triton_available
from service.engine.scheduler import Scheduler
from service.engine.segment_attention import ChunkRange
from service.engine.segment_launch import SegmentPlan, host_layout
from service.engine.shared_decode import Placement, Reads, decode_batch
from service.engine.shared_graph import SHARED_BUCKETS, capacity_for, idle_step_call, pieces_for, reads_bucket
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
    assert (capacity.rows, capacity.entries, capacity.pairs, capacity.chunk_tiles) == (8, 136, 264, 256)


def test_a_full_bucket_of_rows_reading_its_reads_fits_its_capacity() -> None:
    """Every bucket, full, each row reading the bucket's reads (cut into its pieces): the plan fits the captured
    one's shapes (a plan over capacity would run eagerly, every step)."""
    chunks = [ChunkRange(i * 600, 520, 20) for i in range(400)]
    cpu = torch.device("cpu")
    for bucket in SHARED_BUCKETS:
        reads = [
            Reads.of([Placement(chunks[(r * 7 + j) % 400], 20 + j * 520) for j in range(16)]) for r in range(bucket)
        ]
        call = decode_batch([9000] * bucket, [(r * 200, 100) for r in range(bucket)], reads)
        pieces = pieces_for(bucket)
        capacity = capacity_for(bucket, reads_bucket(16), pieces)
        static = SegmentPlan.build(idle_step_call(bucket, 0), 7, 4, cpu, pieces, capacity)
        static.load(host_layout(call, 7, 4, pieces, capacity))
        assert static.pairs == capacity.pairs


@pytest.mark.gpu
@NEEDS_GPU
@pytest.mark.parametrize("overlap", [False, True], ids=["read-each-step", "overlapped"])
@pytest.mark.parametrize("arch", ("llama", "qwen2"))
def test_graphed_shared_steps_decode_the_eager_steps_tokens(
    get_engine: Callable[[str, str], StitchEngine], arch: str, overlap: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks cut into the same pieces as the eager plan cuts these short ones (one): the same sums in the same
    order, so fp32 tokens are equal (other cuts change the sums' order, as the eager plan's own choice does)."""
    engine = get_engine(arch, "cuda")
    monkeypatch.setattr(shared_graph, "pieces_for", lambda batch: 1)

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


@pytest.mark.gpu
@NEEDS_GPU
def test_warming_captures_every_bucket_up_to_the_reads_and_the_batch(
    get_engine: Callable[[str, str], StitchEngine],
) -> None:
    engine = get_engine("qwen2", "cuda")
    scheduler = Scheduler(engine, nan_pool(engine, 20000), max_batch=8, cuda_graphs=True, arena=nan_arena(engine, 600))
    shared = scheduler.shared
    assert shared is not None and shared.graphs is not None and shared.extend_graphs is not None

    shared.warm(most_reads=9, max_batch=8, min_question=16)

    decode = set(shared.graphs._graphs)
    assert decode == {(batch, reads) for batch in SHARED_BUCKETS if batch <= 8 for reads in (4, 8, 16)}
    prefill = set(shared.extend_graphs._graphs)
    assert {reads for _, _, reads in prefill} == {4, 8, 16}
    assert all(rows <= 8 and tokens >= 16 * rows for rows, tokens, _ in prefill)
    assert (8, 128, 16) in prefill and (1, 16, 4) in prefill and (2, 16, 4) not in prefill
    shared.close()
