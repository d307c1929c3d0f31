"""The scheduler as the server configures it, in one place: `kvstitch serve` (`Runtime.serve_answers`) and the
offline path (`offline.py`: `kvstitch eval`, the benchmark tables, the tests) build theirs here, so what is
measured offline is what is served.

Free of pydantic (the GPU benchmark image has torch only): `Settings` fills `BatchingOptions` in the runtime.
"""

from __future__ import annotations

from dataclasses import dataclass

from service.engine import batching_defaults
from service.engine.chunk_arena import ChunkArena
from service.engine.chunk_source import ChunkSource
from service.engine.engine import StitchEngine
from service.engine.extend_graph import SCRATCH_SHARE, TOKEN_BUCKETS
from service.engine.kv_pool import KVPool
from service.engine.mixed_graph import MIXED_TOKENS
from service.engine.scheduler import Scheduler
from service.engine.shared_extend_graph import SHARED_TOKEN_BUCKETS

# Pool slots the scheduler's graphs hold for their padding: one for the decode step's (`BatchGraphs`), a bucket of
# tokens for the batched prefill's (`ExtendGraphs`), the largest mixed step's and one (`MixedGraphs`).
GRAPH_SCRATCH_SLOTS = 1 + max(TOKEN_BUCKETS) + max(MIXED_TOKENS) + 1
# Pool slots to add on the shared path for its graphs: the decode step's slot (`SharedStepGraphs`), and room for
# the question prefill's padding slab at its largest bucket (`SharedExtendGraphs` takes `SCRATCH_SHARE` of a pool
# at most, so a pool holding only the requests' tails gets this much more).
SHARED_GRAPH_SCRATCH_SLOTS = 1 + int(max(SHARED_TOKEN_BUCKETS) / SCRATCH_SHARE)


@dataclass(frozen=True)
class BatchingOptions:
    """The server's batching settings (`KVSTITCH_MAX_BATCH` and the rest); None: the device decides (on where
    the engine runs CUDA graphs)."""

    max_batch: int = batching_defaults.MAX_BATCH
    prefill_chunk: int = batching_defaults.PREFILL_CHUNK
    batch_prefill_min: int = batching_defaults.BATCH_PREFILL_MIN
    prefill_with_decode: bool | None = None
    overlap: bool | None = None
    late_launch: bool = False
    early_prefill_below: int = 0


def graphs_on(engine: StitchEngine) -> bool:
    """Whether the batched steps run through CUDA graphs: wherever the engine's own graphs are on (CUDA)."""
    return engine.stitch_graphs is not None


def build_scheduler(
    engine: StitchEngine,
    pool: KVPool,
    options: BatchingOptions,
    max_waiting: int | None = None,
    kv_source: ChunkSource | None = None,
    arena: ChunkArena | None = None,
) -> Scheduler:
    """The scheduler over `pool` with `options`, its CUDA graphs, mixed steps and overlap chosen as served;
    `kv_source`: where admitted turbo requests get their chunk KV (None: the engine computes it); `arena`: the
    shared-chunk mode's chunk arena (on CUDA its decode steps, question prefills and questions riding in steps
    through `shared_graph.py`'s, `shared_extend_graph.py`'s and `shared_mixed_graph.py`'s graphs)."""
    on_cuda = graphs_on(engine)
    return Scheduler(
        engine,
        pool,
        options.max_batch,
        max_waiting=max_waiting,
        cuda_graphs=on_cuda,
        prefill_chunk=options.prefill_chunk,
        batch_prefill_min=options.batch_prefill_min,
        prefill_with_decode=_unset_is(options.prefill_with_decode, on_cuda),
        overlap=_unset_is(options.overlap, on_cuda),
        kv_source=kv_source,
        arena=arena,
        late_launch=options.late_launch,
        early_prefill_below=options.early_prefill_below,
    )


def scratch_slots(engine: StitchEngine) -> int:
    """Pool slots to add for the graphs' padding beside the requests' slabs (none without graphs)."""
    return GRAPH_SCRATCH_SLOTS if graphs_on(engine) else 0


def shared_scratch_slots(engine: StitchEngine) -> int:
    """Pool slots to add for the shared path's graphs beside the requests' tails (none without graphs)."""
    return SHARED_GRAPH_SCRATCH_SLOTS if graphs_on(engine) else 0


def release(scheduler: Scheduler) -> None:
    """Give the scheduler's graphs and its pool's memory back (an offline run or a benchmark's batch is over)."""
    for graphs in (scheduler.graphs, scheduler.slabs.extend_graphs, scheduler.slabs.mixed_graphs):
        if graphs is not None:
            graphs.close()
    if scheduler.shared is not None:
        scheduler.shared.close()  # its graphs' scratch slot goes back before the pool itself
        scheduler.shared.arena.close()
    scheduler.pool.release()


def _unset_is(setting: bool | None, default: bool) -> bool:
    """A tri-state setting's value: `default` where it is unset."""
    return default if setting is None else setting
