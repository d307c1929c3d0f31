"""The shared question prefill through CUDA graphs (`shared_extend_graph.py`): its buckets, its padding and, on CUDA,
its tokens against the eager prefill's.

On the CPU: every full bucket's group fits its plan capacity (a plan over it would run eagerly each time); a group
padded to its bucket (`padded_extend`: the padding tokens one more request in a scratch slab) attends as the
unpadded one, through the torch reference and through the capacity-padded kernel plan executed by `run_plan` (the
kernels' semantics in torch: dead tiles, pairs and rows included); and the scheduler, its question prefills padded
exactly as a graph pads them but run eagerly, decodes the eager path's tokens.

On CUDA (`pytest -m gpu tests/test_engine_shared_extend_graph.py`): schedulers with and without `cuda_graphs`, groups
of one and of three questions of different lengths (and a group longer than the largest bucket, split into
replays), pools and arenas NaN-poisoned: the graphed prefill and decode steps give the eager fp32 tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from service.engine import segment_plan, shared_extend_graph, shared_graph
from service.engine.batch_decode import ExtendRows
from service.engine.batch_graph import BATCH_BUCKETS
from service.engine.batch_request import BatchRequest
from service.engine.engine import StitchEngine
from service.engine.extend_graph import ExtendRequest, buckets_for, split_by_tokens, token_bucket
from service.engine.fused_stitch import triton_available
from service.engine.rotary import Rotary
from service.engine.scheduler import Scheduler
from service.engine.segment_attention import ChunkRange, SegmentArrays, merge, partial, reference_attention
from service.engine.segment_launch import SegmentPlan, host_layout
from service.engine.segment_plan import PlanCapacity
from service.engine.shared_decode import Placement, Reads, SharedDecoder, extend_batch
from service.engine.shared_extend_graph import (
    MAX_ENTRIES,
    MAX_READS,
    SHARED_TOKEN_BUCKETS,
    SharedExtendGraphs,
    extend_capacity,
    extend_pieces,
    extend_splits,
    graph_bucket,
    idle_extend,
    padded_extend,
    request_capacity,
    split_for,
)
from service.engine.shared_graph import reads_bucket
from tests.test_engine_segment_attention import HEAD_DIM, SCALE, rotary_for
from tests.test_engine_shared_scheduler import Ask, Run, assert_nothing_pinned, block_sizes, drain, nan_arena, nan_pool

NEEDS_GPU = pytest.mark.skipif(
    not (torch.cuda.is_available() and triton_available()), reason="needs CUDA and triton (the segment kernels)"
)
CPU = torch.device("cpu")
READS_BUCKETS = tuple(b for b in (4, 8, 16, 32) if b <= MAX_READS)


# ---- groups of questions over an arena ------------------------------------------------------------------


def random_group(
    rng: np.random.Generator,
    requests: int,
    tokens: int,
    reads: int,
    chunks: Sequence[ChunkRange],
    shared: bool,
    full: bool = False,
) -> tuple[list[ExtendRequest], list[Reads], int]:
    """`requests` questions of `tokens` tokens in all (each one at least), each after a prefix in its own slab and
    reading 1 .. `reads` chunks (request 0, or with `full` every one, exactly `reads`): distinct chunks, or
    (`shared`) the same few. Returns the requests, their reads and the first slot after their slabs."""
    cuts = np.sort(rng.choice(np.arange(1, tokens), size=requests - 1, replace=False)) if requests > 1 else []
    lengths = np.diff(np.concatenate(([0], cuts, [tokens]))).astype(int).tolist()
    group, tables, slot, next_chunk = [], [], 0, 0
    for index, new in enumerate(lengths):
        count = reads if index == 0 or full else int(rng.integers(1, reads + 1))
        if shared:
            picked = [chunks[j] for j in range(count)]
        else:
            picked = [chunks[(next_chunk + j) % len(chunks)] for j in range(count)]
            next_chunk += count
        prefix = int(rng.integers(1, 6))
        offsets = prefix + np.concatenate(([0], np.cumsum([c.length for c in picked])[:-1]))
        tables.append(Reads.of([Placement(c, int(o)) for c, o in zip(picked, offsets, strict=True)]))
        question_start = prefix + sum(c.length for c in picked)
        group.append(([0] * new, question_start, slot, prefix))
        slot += prefix + new
    return group, tables, slot


def arena_chunks(count: int, length: int) -> list[ChunkRange]:
    return [ChunkRange(i * (length + 3), length, 2) for i in range(count)]


# ---- buckets and capacity -----------------------------------------------------------------------------


def test_a_group_takes_the_smallest_bucket_holding_it_and_runs_eagerly_past_them() -> None:
    assert graph_bucket(1, 51, 16, SHARED_TOKEN_BUCKETS) == (1, 64, 16)
    assert graph_bucket(3, 100, 5, SHARED_TOKEN_BUCKETS) == (4, 128, 8)
    assert graph_bucket(8, 12, 0, SHARED_TOKEN_BUCKETS) == (8, 16, 4)
    assert graph_bucket(1, 512, 32, SHARED_TOKEN_BUCKETS) == (1, 512, 32)  # MAX_ENTRIES exactly
    assert graph_bucket(1, 513, 16, SHARED_TOKEN_BUCKETS) == (1, 640, 16)  # steps of 128 past 128
    assert graph_bucket(2, 900, 16, SHARED_TOKEN_BUCKETS) == (2, 1024, 16)  # MAX_ENTRIES exactly
    assert graph_bucket(1, 513, 17, SHARED_TOKEN_BUCKETS) is None  # 640 x 32 entries: past MAX_ENTRIES
    assert graph_bucket(1, 1025, 4, SHARED_TOKEN_BUCKETS) is None  # more tokens than the largest bucket
    assert graph_bucket(1, 16, 33, SHARED_TOKEN_BUCKETS) is None  # more reads than MAX_READS
    assert graph_bucket(33, 64, 4, SHARED_TOKEN_BUCKETS) is None  # more rows than the largest bucket
    assert graph_bucket(1, 200, 16, (16, 32, 64, 128)) is None  # a small pool's buckets
    assert MAX_ENTRIES == 512 * 32 and [extend_pieces(t) for t in SHARED_TOKEN_BUCKETS] == [2] + [1] * 10
    # The padding slab takes a quarter of the pool at most; a GQA group wider than a tile has no capacity.
    assert SharedExtendGraphs.fit(64, 7) and not SharedExtendGraphs.fit(63, 7) and not SharedExtendGraphs.fit(4000, 65)
    capacity = extend_capacity(rows=1, tokens=64, reads=16, pieces=1, group=7)
    # 1,024 entries on chunks, 64 tail entries; each width: 16 chunk pieces + ceil(1,024 x 7 / 64) tiles.
    assert (capacity.rows, capacity.entries, capacity.pairs) == (64, 1088, 1088)
    assert (capacity.chunk_tiles, capacity.tail_tiles) == (16 + 112, 2 + 7)


def bucket_capacity(rows: int, tokens: int, reads: int, group: int, by_request: bool) -> tuple[int, PlanCapacity]:
    """The pieces (or splits) and plan sizes a graph of this bucket captures."""
    if by_request:
        splits = extend_splits(tokens, reads, group, 2)
        return splits, request_capacity(rows, tokens, reads, splits, group)
    pieces = extend_pieces(tokens)
    return pieces, extend_capacity(rows, tokens, reads, pieces, group)


@pytest.mark.parametrize("by_request", [False, True], ids=["by-chunk", "by-request"])
@pytest.mark.parametrize("group", [1, 2, 7, 32])
def test_every_full_bucket_fits_its_capacity(group: int, by_request: bool) -> None:
    """Every bucket, full (all its rows and tokens, every row reading the bucket's reads, chunks cut into its
    pieces or chunk lists into its splits): the group's plan fits the captured plan's shapes, its chunks all
    distinct (most chunk pieces) or all the same (the most readers of one chunk, the widest tiles)."""
    chunks = arena_chunks(MAX_READS * max(BATCH_BUCKETS), 40)
    rng = np.random.default_rng(group)
    for rows in BATCH_BUCKETS:
        for tokens in SHARED_TOKEN_BUCKETS:
            for reads in READS_BUCKETS:
                if tokens < rows or graph_bucket(rows, tokens, reads, SHARED_TOKEN_BUCKETS) != (rows, tokens, reads):
                    continue
                pieces, capacity = bucket_capacity(rows, tokens, reads, group, by_request)
                scratch = 100_000
                idle = idle_extend(rows, tokens, scratch)
                static = SegmentPlan.build(idle, group, 2, CPU, pieces, capacity, by_request)
                for shared in (False, True):
                    requests, tables, _ = random_group(rng, rows, tokens, reads, chunks, shared, full=True)
                    _, call = padded_extend(requests, tables, rows, tokens, scratch)
                    layout = host_layout(call, group, 2, pieces, capacity, by_request)
                    static.load(layout)  # ValueError on any shape that differs
                    assert layout.pairs == capacity.pairs


@pytest.mark.parametrize("by_request", [False, True], ids=["by-chunk", "by-request"])
def test_random_groups_within_a_bucket_fit_its_capacity(by_request: bool) -> None:
    """Groups of any shape inside a bucket (fewer rows, fewer tokens, fewer reads, some chunks shared): the
    bucket's capacity holds them, at a GQA group that makes some readers' items just pass a tile's width."""
    chunks = arena_chunks(300, 33)
    rng = np.random.default_rng(11)
    for _ in range(200):
        rows = int(rng.integers(1, 9))
        tokens = int(rng.integers(rows, 400))
        reads = int(rng.integers(1, 17))
        group = int(rng.choice([1, 2, 7, 9]))
        bucket = graph_bucket(rows, tokens, reads, SHARED_TOKEN_BUCKETS)
        assert bucket is not None
        requests, tables, _ = random_group(rng, rows, tokens, reads, chunks, bool(rng.integers(0, 2)))
        pieces, capacity = bucket_capacity(*bucket, group, by_request)
        _, call = padded_extend(requests, tables, bucket[0], bucket[1], 50_000)
        assert SegmentPlan.build(call, group, 2, CPU, pieces, capacity, by_request).pairs == capacity.pairs


def test_a_group_is_cut_at_the_largest_bucket_its_reads_allow() -> None:
    """Seven questions of 100 tokens: reading 16 chunks they fit one 1,024-token graph; reading 32 they are cut
    at 512 tokens (5 + 2 questions); with a small pool's buckets, at its largest."""
    rng = np.random.default_rng(3)
    group, _, _ = random_group(rng, 7, 700, 4, arena_chunks(40, 20), False)
    group = [([0] * 100, start, slot, live) for _, start, slot, live in group]  # 100 tokens each
    for reads, buckets, sizes in (
        (16, SHARED_TOKEN_BUCKETS, [7]),
        (32, SHARED_TOKEN_BUCKETS, [5, 2]),
        (3, (16, 32, 64, 128, 256), [2, 2, 2, 1]),
    ):
        tables = [Reads.of([Placement(c, 1 + 20 * j) for j, c in enumerate(arena_chunks(reads, 20))])] * 7
        parts = split_for(group, tables, buckets)
        assert [len(requests) for requests, _ in parts] == sizes
        assert [t for _, tables_of in parts for t in tables_of] == tables  # each request keeps its reads
        assert all(graph_bucket(len(r), 100 * len(r), reads, buckets) is not None for r, _ in parts)


def test_padding_refuses_a_group_that_does_not_fit() -> None:
    group, tables, slot = random_group(np.random.default_rng(0), 3, 40, 4, arena_chunks(20, 30), False)
    with pytest.raises(ValueError):
        padded_extend(group, tables, 2, 64, slot)  # three requests, two rows
    with pytest.raises(ValueError):
        padded_extend(group, tables, 4, 32, slot)  # 40 tokens, 32
    with pytest.raises(ValueError):
        padded_extend(group, tables[:2], 4, 64, slot)  # a request without its reads


# ---- the padded group attends as the unpadded one -----------------------------------------------------


@dataclass(frozen=True)
class AttentionCase:
    """A group's call unpadded and padded to `bucket` tokens (4 rows), NaN outside the slots either names, and
    queries for the padded rows (the group's `tokens` first)."""

    real: SegmentArrays
    padded: SegmentArrays
    arena: torch.Tensor
    pool: torch.Tensor
    q: torch.Tensor
    tokens: int
    scratch: int


def attention_case(seed: int, requests: int, tokens: int, bucket: int, shared: bool) -> AttentionCase:
    rng = np.random.default_rng(seed)
    chunks = arena_chunks(12, 37)
    group, tables, scratch = random_group(rng, requests, tokens, 4, chunks, shared)
    real = extend_batch(group, tables)
    _, padded = padded_extend(group, tables, 4, bucket, scratch)
    gen = torch.Generator().manual_seed(seed)
    arena = torch.full((2, 2, 12 * 40, HEAD_DIM), float("nan"))
    for c in chunks:
        arena[:, :, c.start : c.start + c.length] = torch.randn((2, 2, c.length, HEAD_DIM), generator=gen)
    pool = torch.full((2, 2, scratch + bucket + 8, HEAD_DIM), float("nan"))
    for start, used in zip(padded.tail_start.tolist(), padded.tail_used.tolist(), strict=True):
        pool[:, :, start : start + used] = torch.randn((2, 2, used, HEAD_DIM), generator=gen)
    q = torch.randn((bucket, 4, HEAD_DIM), generator=gen)
    return AttentionCase(real, padded, arena, pool, q, tokens, scratch)


@pytest.mark.parametrize("shared", [False, True], ids=["own-chunks", "shared-chunks"])
@pytest.mark.parametrize(("requests", "tokens", "bucket"), [(1, 11, 16), (3, 29, 32), (4, 64, 64)])
def test_the_padded_call_attends_the_real_rows_as_the_unpadded_one(
    requests: int, tokens: int, bucket: int, shared: bool
) -> None:
    """Through the torch reference (the CPU's eager path): the real rows of the padded call equal the unpadded
    call's exactly; the padding is one request more, reading no chunk, its keys in the scratch slab only."""
    case = attention_case(requests * 7 + bucket, requests, tokens, bucket, shared)
    rotary = rotary_for("yarn")
    n = case.tokens
    want = reference_attention(case.q[:n], case.real.batch(), case.arena, case.pool, rotary, SCALE)
    got = reference_attention(case.q, case.padded.batch(), case.arena, case.pool, rotary, SCALE)
    assert torch.equal(got[:n], want) and torch.isfinite(got).all()
    padding = case.padded.seg_counts.size - case.real.seg_counts.size
    assert padding == (1 if n < bucket else 0) and case.padded.rows.size == bucket
    if padding:
        assert case.padded.seg_counts[-1] == 0 and case.padded.tail_start[-1] == case.scratch
        assert case.padded.tail_used[-1] == bucket - n and (case.padded.rows[n:] == requests).all()


def run_plan(
    plan: SegmentPlan, q: torch.Tensor, arena: torch.Tensor, tails: torch.Tensor, rotary: Rotary, scale: float
) -> torch.Tensor:
    """What `SegmentAttention` computes, in torch and fp32, read off the plan as the kernels read it: each tile's
    items (pair, query head) score their entry's query, rotated by its cos/sin, against the tile's first `visible`
    keys; each row merges its chunk pairs, then its tail pair (-1: a dead row, output zero). Pairs no tile writes
    stay NaN, so a merge that reads one shows."""
    heads, dim = q.shape[1], q.shape[2]
    kv_heads = arena.shape[1]
    group = heads // kv_heads
    cos, sin = rotary.cos_sin(plan.q_positions)
    q_rows, pair_q, visible = plan.q_rows.tolist(), plan.pair_q.tolist(), plan.pair_visible.tolist()
    part_out = torch.full((plan.pairs, heads, dim), float("nan"))
    part_lse = torch.full((plan.pairs, heads), float("nan"))
    launches = [(launch, arena) for launch in plan.chunks] + [(launch, tails) for launch in plan.tails]
    for launch, kv in launches:
        for start, length, first, pairs, block in launch.tiles.tolist():
            for item in range(block * launch.block_m, min((block + 1) * launch.block_m, pairs * group)):
                pair = first + item // group
                entry = pair_q[pair]
                for kv_head in range(kv_heads):
                    head = kv_head * group + item % group
                    x = q[q_rows[entry], head].float()
                    rotated = x * cos[entry] + torch.cat((-x[dim // 2 :], x[: dim // 2])) * sin[entry]
                    keys = kv[0, kv_head : kv_head + 1, start : start + min(length, visible[pair])]
                    values = kv[1, kv_head : kv_head + 1, start : start + min(length, visible[pair])]
                    out, lse = partial(rotated.unsqueeze(0), keys, values, scale)
                    part_out[pair, head], part_lse[pair, head] = out[0], lse[0]
    rows = []
    row_ptr, row_parts, row_tail = plan.row_ptr.tolist(), plan.row_parts.tolist(), plan.row_tail.tolist()
    for row, tail in enumerate(row_tail):
        parts = row_parts[row_ptr[row] : row_ptr[row + 1]]
        if tail < 0:
            assert not parts
            rows.append(torch.zeros((heads, dim)))
            continue
        rows.append(merge(part_out[parts], part_lse[parts], (part_out[tail], part_lse[tail])))
    return torch.stack(rows)


@pytest.mark.parametrize("shared", [False, True], ids=["own-chunks", "shared-chunks"])
@pytest.mark.parametrize(("requests", "tokens", "bucket"), [(1, 11, 16), (3, 29, 32), (2, 40, 64)])
def test_the_capacity_padded_plan_computes_the_unpadded_plans_rows(
    requests: int, tokens: int, bucket: int, shared: bool
) -> None:
    """The plan a graph replays (the padded call's, padded to the bucket's capacity, copied into the plan captured
    over `idle_extend`), executed as the kernels would: the real rows equal the unpadded call's plan, which
    equals the torch reference; the padding rows are finite (no NaN slot read)."""
    case = attention_case(requests * 5 + bucket, requests, tokens, bucket, shared)
    rotary = rotary_for("default")
    pieces, n = extend_pieces(bucket), case.tokens
    capacity = extend_capacity(4, bucket, 4, pieces, group=2)
    static = SegmentPlan.build(idle_extend(4, bucket, case.scratch), 2, 2, CPU, pieces, capacity)
    static.load(host_layout(case.padded, 2, 2, pieces, capacity))
    unpadded_plan = SegmentPlan.build(case.real, 2, 2, CPU, pieces)
    unpadded = run_plan(unpadded_plan, case.q[:n], case.arena, case.pool, rotary, SCALE)
    reference = reference_attention(case.q[:n], case.real.batch(), case.arena, case.pool, rotary, SCALE)
    assert (unpadded - reference).abs().max() < 1e-5
    graphed = run_plan(static, case.q, case.arena, case.pool, rotary, SCALE)
    assert graphed.shape[0] == capacity.rows == bucket
    assert torch.equal(graphed[:n], unpadded) and torch.isfinite(graphed).all()


# ---- through the scheduler ------------------------------------------------------------------------------

# A question alone, then three of different lengths admitted together (one composite); every one turbo, so every
# question is a shared prefill. The template adds its instructions to each question (~120 tiny-tokenizer tokens).
ALONE = (Ask((0, 1, 2), max_new=8, seed=1, question=7),)
TOGETHER = (
    Ask((2, 0), positions="composite", max_new=9, seed=2, question=19),
    Ask((0, 3), max_new=6, seed=3, question=4),
    Ask((1, 2, 4), max_new=7, seed=4, question=40),
)
# Three questions whose tokens pass the largest bucket: replayed in two parts, the first two together.
LONG = (
    Ask((0, 1), max_new=5, seed=5, question=300),
    Ask((2,), max_new=6, seed=6, question=250),
    Ask((3, 4), max_new=4, seed=7, question=9),
)
POOL_SLOTS = 4000  # a quarter of it spares a padding slab of 896 tokens (the graphs' largest bucket here)


class EagerPadded:
    """What the graphs replay, run eagerly: each group cut into parts as `SharedExtendGraphs.extend` cuts it, each
    part padded to its bucket as `SharedExtendGraph.replay` pads it (`padded_extend`, the padding in a scratch slab
    of the pool), through the CPU's segment attention."""

    def __init__(self, shared: SharedDecoder) -> None:
        self.shared = shared
        self.token_buckets = buckets_for(shared.decoder.pool.slots, SHARED_TOKEN_BUCKETS)
        self.scratch = shared.decoder.pool.allocate(max(self.token_buckets))
        self.buckets: list[tuple[int, int, int]] = []

    def extend(self, requests: Sequence[ExtendRequest], reads: Sequence[Reads]) -> torch.Tensor:
        parts = split_for(requests, reads, self.token_buckets)
        return torch.cat([self._part(*part) for part in parts])

    def _part(self, requests: Sequence[ExtendRequest], reads: Sequence[Reads]) -> torch.Tensor:
        tokens = sum(len(ids) for ids, *_ in requests)
        bucket = graph_bucket(len(requests), tokens, max(map(len, reads)), self.token_buckets)
        assert bucket is not None
        rows, padded_tokens, _ = bucket
        flat, call = padded_extend(requests, reads, rows, padded_tokens, self.scratch.start)
        static = ExtendRows.from_flat(torch.tensor(flat), rows + 1, padded_tokens)
        self.buckets.append(bucket)
        return self.shared.extend(static, call)[: len(requests)]

    def close(self) -> None:
        self.shared.decoder.pool.free(self.scratch)


def run_groups(
    engine: StitchEngine, groups: Sequence[Sequence[Ask]], graphs: bool, setup: Callable[[Scheduler], None]
) -> tuple[list[tuple[list[int], str, str]], Scheduler, list[Run]]:
    """Each group of asks added at once (the next after two steps), drained; the outcomes, the scheduler, the runs."""
    arena = nan_arena(engine, sum(block_sizes(engine)))
    scheduler = Scheduler(engine, nan_pool(engine, POOL_SLOTS), max_batch=8, cuda_graphs=graphs, arena=arena)
    setup(scheduler)
    runs = []
    for asks in groups:
        run = Run(engine, asks)
        runs.append(run)
        for request in run.requests:
            scheduler.add(request)
        scheduler.step()
        scheduler.step()
    drain(scheduler)
    return [o for run in runs for o in run.outcomes()], scheduler, runs


def expected_buckets(runs: Sequence[Run]) -> list[tuple[int, int, int]]:
    """The (rows, tokens, reads) bucket of each part of each group (every run is one group, admitted at once)."""
    buckets = []
    token_buckets = buckets_for(POOL_SLOTS, SHARED_TOKEN_BUCKETS)
    for run in runs:
        questions = [(r.prompt.question, 0, 0, 0) for r in run.requests]
        reads = max(len(r.prompt.blocks) for r in run.requests)
        for part in split_by_tokens(questions, max(token_buckets)):
            bucket = graph_bucket(len(part), sum(len(ids) for ids, *_ in part), reads, token_buckets)
            assert bucket is not None
            buckets.append(bucket)
    return buckets


@pytest.mark.parametrize("groups", [(ALONE, TOGETHER), (LONG,)], ids=["one-then-three", "past-the-largest-bucket"])
@pytest.mark.parametrize("arch", ("llama", "qwen2"))
def test_prefills_padded_as_graphs_pad_them_decode_the_eager_tokens(
    get_engine: Callable[[str, str], StitchEngine], arch: str, groups: tuple[Sequence[Ask], ...]
) -> None:
    """CPU, fp32: every shared question prefill cut and padded as the graphs would replay it gives the eager
    path's tokens and texts (NaN-poisoned pool and arena: nothing reads a slot nobody wrote)."""
    engine = get_engine(arch, "cpu")
    eager, _, _ = run_groups(engine, groups, False, lambda scheduler: None)
    stand_ins: list[EagerPadded] = []

    def pad_prefills(scheduler: Scheduler) -> None:
        assert scheduler.shared is not None and scheduler.shared.extend_graphs is None  # no graphs on the CPU
        stand_ins.append(EagerPadded(scheduler.shared.decoder))
        scheduler.shared.extend_graphs = stand_ins[0]  # type: ignore[assignment]

    padded, scheduler, runs = run_groups(engine, groups, False, pad_prefills)
    assert padded == eager
    buckets = stand_ins[0].buckets
    assert buckets == expected_buckets(runs) and len(buckets) == 2
    if groups == (LONG,):  # the two long questions (~600 tokens with the template's) together, then the third
        assert [rows for rows, _, _ in buckets] == [2, 1]
    stand_ins[0].close()
    assert_nothing_pinned(scheduler)


@pytest.mark.gpu
@NEEDS_GPU
@pytest.mark.parametrize("groups", [(ALONE, TOGETHER), (LONG,)], ids=["one-then-three", "past-the-largest-bucket"])
@pytest.mark.parametrize("arch", ("llama", "qwen2"))
def test_graphed_shared_prefills_and_steps_decode_the_eager_tokens(
    get_engine: Callable[[str, str], StitchEngine],
    arch: str,
    groups: tuple[Sequence[Ask], ...],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Chunks cut into one piece, as the eager plan cuts these short ones, and each request's chunk list in one
    split: the same sums in the same order, so the graphed prefills and steps give the eager fp32 tokens; every
    part of every group replayed a graph."""
    engine = get_engine(arch, "cuda")
    monkeypatch.setattr(shared_graph, "pieces_for", lambda batch: 1)
    monkeypatch.setattr(shared_extend_graph, "extend_pieces", lambda tokens: 1)
    monkeypatch.setattr(shared_extend_graph, "extend_splits", lambda *bucket: 1)
    monkeypatch.setattr(segment_plan, "auto_splits", lambda *programs: 1)
    eager_logits: list[torch.Tensor] = []
    graphed_logits: list[torch.Tensor] = []
    eager, _, _ = run_groups(engine, groups, False, lambda scheduler: record_prefills(scheduler, eager_logits))
    graphed, scheduler, runs = run_groups(
        engine, groups, True, lambda scheduler: record_prefills(scheduler, graphed_logits)
    )
    shared = scheduler.shared
    assert shared is not None and shared.extend_graphs is not None and shared.graphs is not None
    captured, replays = set(shared.extend_graphs._graphs), shared.extend_graphs.replays
    shared.close()  # the graphs' scratch slabs back to the pool
    assert_nothing_pinned(scheduler)
    # Each group's first-token logits first (a diagnosis when tokens differ), then every token and text.
    assert len(graphed_logits) == len(eager_logits) == len(groups)
    for got, want_logits in zip(graphed_logits, eager_logits, strict=True):
        assert got.shape == want_logits.shape and float((got - want_logits).abs().max()) < 1e-4
    assert graphed == eager
    want = expected_buckets(runs)
    assert captured == set(want) and replays == len(want) == 2


def record_prefills(scheduler: Scheduler, logits: list[torch.Tensor]) -> None:
    """Keep a host copy of every shared question prefill's logits (read before the next replay reuses them)."""
    shared = scheduler.shared
    assert shared is not None
    prefill = shared.extend

    def extend(group: Sequence[BatchRequest]) -> torch.Tensor:
        out = prefill(group)
        logits.append(out.detach().float().cpu())
        return out

    shared.extend = extend  # type: ignore[method-assign]


@pytest.mark.gpu
@NEEDS_GPU
def test_warm_captures_the_buckets_before_any_question(get_engine: Callable[[str, str], StitchEngine]) -> None:
    """`warm` captures every bucket up to its rows and tokens; a group inside them then captures nothing."""
    engine = get_engine("qwen2", "cuda")
    arena = nan_arena(engine, sum(block_sizes(engine)))
    scheduler = Scheduler(engine, nan_pool(engine, POOL_SLOTS), max_batch=8, cuda_graphs=True, arena=arena)
    shared = scheduler.shared
    assert shared is not None and shared.extend_graphs is not None
    shared.extend_graphs.warm(reads=3, max_rows=2, max_tokens=300)
    buckets = buckets_for(POOL_SLOTS, SHARED_TOKEN_BUCKETS)
    top = token_bucket(300, buckets)
    assert top == 384
    warmed = {(r, t, 4) for r in (1, 2) for t in buckets if t <= top}
    assert set(shared.extend_graphs._graphs) == warmed
    run = Run(engine, (ALONE[0], TOGETHER[1]))  # two questions of ~130 tokens, admitted together
    for request in run.requests:
        scheduler.add(request)
    drain(scheduler)
    assert set(shared.extend_graphs._graphs) == warmed and shared.extend_graphs.replays == 1
    assert [len(tokens) for tokens, _, _ in run.outcomes()] == [ALONE[0].max_new, TOGETHER[1].max_new]
    shared.close()
    assert_nothing_pinned(scheduler)


def test_reads_buckets_are_the_decode_steps() -> None:
    """One reads bucketing for the decode step and the prefill (a request's chunks are the same in both)."""
    assert [reads_bucket(n) for n in (0, 1, 3, 4, 5, 16, 17, 32)] == [4, 4, 4, 4, 8, 16, 32, 32]
    assert READS_BUCKETS == (4, 8, 16, 32)
