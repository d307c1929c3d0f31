"""Shared chunks (chunk_arena.py, shared_decode.py): one arena copy of each chunk serves every running answer.

The shared path (prefix-only slabs, the question prefilled and the answer decoded through segment attention over
the arena) is held to the copy path the scheduler runs today (each request's context stitched into its slab, the
questions prefilled together by `BatchDecoder.extend`, then batched decode steps), on the tiny models in fp32 on
the CPU: three requests, two of them sharing chunks (one chunk at different offsets), reordered, composite and
mixed positions. Both pools and the arena are NaN-poisoned, so a read of any slot nobody wrote turns logits NaN.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest
import torch

from service.engine.batch_decode import LOOP, BatchDecoder, DecodeRows, ExtendRows, batch_attention
from service.engine.chunk_arena import ArenaFullError, ChunkArena
from service.engine.engine import StitchEngine
from service.engine.forward import LayerAttend
from service.engine.fused_stitch import triton_runs_on
from service.engine.gate import BF16_TOLERANCE, synthetic_ids
from service.engine.kv_layout import KVBlock
from service.engine.kv_pool import KVPool
from service.engine.prompt import PromptIds
from service.engine.segment_attention import ChunkRange, ContextScaling
from service.engine.shared_decode import (
    PrefixPlacer,
    Reads,
    SharedDecoder,
    decode_batch,
    extend_batch,
    place_prefix,
    placements,
)

STEPS = 8
EXTRA = STEPS  # answer slots: one per decode step's fed token
# Chunk ids read by each request: request 1 reads chunk 0 after chunk 3 (another offset than request 0's), request 2
# shares nothing; chunk 4 exists only to be evicted during the run (chunk 5 then takes part of its freed range, the
# rest stays NaN).
READS = ((0, 1, 2), (3, 0), (5,))
LENGTHS = (9, 14, 6, 11, 10, 8)
QUESTIONS = (5, 8, 3)
MODES = {
    "reordered": ("reordered",) * 3,
    "composite": ("composite",) * 3,
    "mixed": ("reordered", "composite", "reordered"),
}


def nan_pool(engine: StitchEngine, slots: int) -> KVPool:
    return KVPool(engine.spec, slots * engine.spec.kv_bytes_per_token(), poison="nan")


def nan_arena(engine: StitchEngine, slots: int) -> ChunkArena:
    budget = slots * engine.spec.kv_bytes_per_token()
    return ChunkArena(engine.spec, engine.forward.rotary, budget, base=engine.chunk_start, poison="nan")


@dataclass
class Setup:
    chunks: list[KVBlock]
    questions: list[list[int]]


def setup(engine: StitchEngine) -> Setup:
    ids = synthetic_ids(engine, LENGTHS, seed=21)
    chunks = engine.precompute([engine.template.chunk_block(c) for c in ids])
    questions = synthetic_ids(engine, QUESTIONS, seed=22)
    return Setup(chunks, [list(engine.template.question_suffix(q)) for q in questions])


Trace = tuple[list[list[int]], list[torch.Tensor]]  # per step the greedy tokens, per step the logits


def copy_path(engine: StitchEngine, s: Setup, modes: Sequence[str]) -> tuple[Trace, int]:
    """Today's path: each context stitched into its slab, the questions prefilled together, then batched decode."""
    pool = nan_pool(engine, 2000)
    requests = []
    for reads, mode, question in zip(READS, modes, s.questions, strict=True):
        blocks = [s.chunks[c] for c in reads]
        plan = engine.plan(mode, [engine.prefix_block, *blocks])
        slab = pool.allocate(plan.context_tokens + len(question) + EXTRA)
        buffer, plan = engine.stitch(blocks, mode, len(question) + EXTRA, into=pool.buffer(slab))
        requests.append((question, plan.question_start, slab.start, buffer.length))
    decoder = BatchDecoder(engine.forward, pool, LOOP)
    first = decoder.extend(ExtendRows.build(requests, engine.spec.device))
    spans = [(start, live + len(ids)) for ids, _, start, live in requests]
    positions = [p + len(ids) for ids, p, _, _ in requests]

    def step(ids: list[int], at: list[int], live: list[tuple[int, int]]) -> torch.Tensor:
        return decoder.step(DecodeRows.build(ids, at, live, engine.spec.device))

    return decode(first, spans, positions, step), pool.used_bytes


def decode(
    first: torch.Tensor,
    spans: list[tuple[int, int]],
    positions: list[int],
    step: Callable[[list[int], list[int], list[tuple[int, int]]], torch.Tensor],
) -> Trace:
    """STEPS greedy steps from the first logits, each row feeding its pick at its next position and slot."""
    tokens, logits = [first.argmax(-1).tolist()], [first]
    for _ in range(STEPS):
        spans = [(start, used + 1) for start, used in spans]
        out = step(tokens[-1], positions, spans)
        positions = [p + 1 for p in positions]
        tokens.append(out.argmax(-1).tolist())
        logits.append(out)
    return tokens, logits


@dataclass
class SharedRun:
    trace: Trace
    pool: KVPool
    tail_slots: list[int]


def shared_path(
    engine: StitchEngine,
    s: Setup,
    modes: Sequence[str],
    arena: ChunkArena,
    context: ContextScaling | None = None,
    meanwhile: Callable[[], None] | None = None,
) -> SharedRun:
    """Prefix-only slabs, chunks pinned in the arena, the questions prefilled and the answers decoded through
    segment attention (`meanwhile` called between the prefill and the first step); the pins released at the end."""
    pool = nan_pool(engine, 1500)
    prefix = engine.prefix_block
    requests, reads, tails, pinned = [], [], [], []
    for chunk_ids, mode, question in zip(READS, modes, s.questions, strict=True):
        blocks = [s.chunks[c] for c in chunk_ids]
        ranges = arena.acquire(blocks, engine.kv_version)
        pinned.append(ranges)
        plan = engine.plan(mode, [prefix, *blocks])
        tails.append(prefix.num_tokens + len(question) + EXTRA)
        slab = pool.allocate(tails[-1])
        place_prefix(pool, slab, prefix, engine.forward.rotary)
        requests.append((question, plan.question_start, slab.start, prefix.num_tokens))
        reads.append(placements(plan, ranges))
    shared = SharedDecoder(BatchDecoder(engine.forward, pool, LOOP), arena, context)
    first = shared.extend(ExtendRows.build(requests, engine.spec.device), extend_batch(requests, reads))
    spans = [(start, live + len(ids)) for ids, _, start, live in requests]
    positions = [p + len(ids) for ids, p, _, _ in requests]
    if meanwhile is not None:
        meanwhile()

    def step(ids: list[int], at: list[int], live: list[tuple[int, int]]) -> torch.Tensor:
        rows = DecodeRows.build(ids, at, live, engine.spec.device)
        return shared.step(rows, decode_batch(at, live, reads))

    trace = decode(first, spans, positions, step)
    for ranges in pinned:
        arena.release(ranges)
    return SharedRun(trace, pool, tails)


@pytest.mark.parametrize("arch", ("llama", "qwen2", "mistral"))
@pytest.mark.parametrize("modes", sorted(MODES))
def test_shared_chunks_decode_the_copy_paths_tokens(
    get_engine: Callable[[str, str], StitchEngine], arch: str, modes: str
) -> None:
    """Question prefill then STEPS decode steps: the same greedy tokens as the copy path, logits within 1e-4, all
    finite though every unwritten slot of both pools and of the arena (an evicted chunk's range too) is NaN; a
    chunk asked for mid-answer is refused rather than evicting one being read; the arena holds each chunk once,
    the pool only the tails, and no pin outlives the run."""
    engine = get_engine(arch, "cpu")
    s = setup(engine)
    (want_tokens, want_logits), copy_bytes = copy_path(engine, s, MODES[modes])
    read = {c for reads in READS for c in reads}
    held = sum(s.chunks[c].num_tokens for c in read)
    arena = nan_arena(engine, held + s.chunks[4].num_tokens - 1)  # room for all but chunk 4
    arena.release(arena.acquire([s.chunks[4]], engine.kv_version))

    def evict_a_pinned_chunk() -> None:  # chunk 4 again, mid-answer: only evicting a pinned chunk would make room
        with pytest.raises(ArenaFullError):
            arena.acquire([s.chunks[4]], engine.kv_version)

    run = shared_path(engine, s, MODES[modes], arena, meanwhile=evict_a_pinned_chunk)
    got_tokens, got_logits = run.trace
    assert got_tokens == want_tokens
    for got, want in zip(got_logits, want_logits, strict=True):
        assert torch.isfinite(got).all()
        assert float((got - want).abs().max()) <= 1e-4
    assert arena.evictions == 1 and arena.pins(engine.kv_version, s.chunks[4].token_ids) is None
    assert arena.chunks == len(read) and arena.used_slots == held
    assert all(arena.pins(engine.kv_version, s.chunks[c].token_ids) == 0 for c in read)
    per_token = engine.spec.kv_bytes_per_token()
    assert run.pool.used_bytes == sum(run.tail_slots) * per_token  # a running answer holds its tail only
    assert run.pool.used_bytes + arena.used_bytes < copy_bytes


def test_a_context_temperature_is_the_stitched_paths(get_engine: Callable[[str, str], StitchEngine]) -> None:
    """APE's temperature T: the copy path divides the chunks' keys by T at the stitch, the shared path the chunks'
    scores in the attention (`ContextScaling`); the same tokens and logits, and not those of T = 1."""
    engine = get_engine("qwen2", "cpu")
    s = setup(engine)
    plain = shared_path(engine, s, MODES["mixed"], nan_arena(engine, 400)).trace[1]
    engine.context_temperature = 0.6
    try:
        (want_tokens, want_logits), _ = copy_path(engine, s, MODES["mixed"])
    finally:
        engine.context_temperature = 1.0
    run = shared_path(engine, s, MODES["mixed"], nan_arena(engine, 400), ContextScaling(temperature=0.6))
    assert run.trace[0] == want_tokens
    assert max(float((g - w).abs().max()) for g, w in zip(run.trace[1], want_logits, strict=True)) <= 1e-4
    assert float((plain[0] - want_logits[0]).abs().max()) > 1e-2


def test_a_shared_chunk_is_one_range_read_by_both_requests(get_engine: Callable[[str, str], StitchEngine]) -> None:
    """Two readers of a chunk get one range (one arena copy, two pins), at their own offsets in the step's
    metadata, which lists the chunk once."""
    engine = get_engine("qwen2", "cpu")
    s = setup(engine)
    arena = nan_arena(engine, sum(b.num_tokens for b in s.chunks))
    version = engine.kv_version
    first = arena.acquire([s.chunks[c] for c in READS[0]], version)
    second = arena.acquire([s.chunks[c] for c in READS[1]], version)
    assert first[0] == second[1] and arena.pins(version, s.chunks[0].token_ids) == 2
    prefix = [engine.prefix_block]
    reads = [
        placements(engine.plan("reordered", [*prefix, *(s.chunks[c] for c in READS[0])]), first),
        placements(engine.plan("reordered", [*prefix, *(s.chunks[c] for c in READS[1])]), second),
    ]
    batch = decode_batch([100, 90], [(0, 10), (20, 10)], reads).batch()
    assert len(batch.chunks) == 4 and batch.chunks.count(first[0]) == 1
    offsets = [seg.offset for r in batch.requests for seg in r.segments if batch.chunks[seg.chunk] == first[0]]
    assert offsets == [reads[0][0].offset, reads[1][1].offset] and offsets[0] != offsets[1]
    arena.release(first)
    arena.release(second)
    assert arena.pinned_chunks == 0
    with pytest.raises(ValueError, match="not a pinned chunk"):
        arena.release(first[:1])


def test_the_arena_evicts_only_unpinned_chunks_lru_and_refuses_when_pins_fill_it(
    get_engine: Callable[[str, str], StitchEngine],
) -> None:
    """Full of pinned chunks the arena refuses a new one (pinning nothing) and leaves their keys untouched; an
    unpinned chunk is evicted least recently used first and its range poisoned; a chunk acquired again is the
    same range, not rewritten."""
    engine = get_engine("llama", "cpu")
    s = setup(engine)
    version = engine.kv_version
    arena = nan_arena(engine, sum(b.num_tokens for b in s.chunks[:3]))  # chunks 0, 1 and 2 exactly
    held = arena.acquire(s.chunks[:3], version)
    before = arena.data.clone()
    with pytest.raises(ArenaFullError, match="pinned chunks fill the arena"):
        arena.acquire([s.chunks[0], s.chunks[3]], version)
    assert arena.pins(version, s.chunks[0].token_ids) == 1  # the refused call's pin of chunk 0 was undone
    assert torch.equal(arena.data.isnan(), before.isnan()) and torch.equal(arena.data.nan_to_num(), before.nan_to_num())
    arena.release(held[1:])  # chunks 1 and 2 unpinned; chunk 1 the least recently used
    arena.acquire([s.chunks[2]], version)  # chunk 2 used again: chunk 1 is now the LRU
    again = arena.acquire([s.chunks[3]], version)  # shorter than chunk 1: evicts it, not pinned 0 or 2
    assert arena.pins(version, s.chunks[1].token_ids) is None and arena.evictions == 1
    assert arena.pins(version, s.chunks[0].token_ids) == 1 and arena.pins(version, s.chunks[2].token_ids) == 1
    assert (
        again[0].start == held[1].start
        and arena.data[:, :, :, again[0].start + again[0].length : held[2].start].isnan().all()
    )
    assert arena.acquire([s.chunks[0]], version) == held[:1]
    assert torch.equal(arena.data[:, :, :, : held[0].length], before[:, :, :, : held[0].length])


def test_arena_keys_are_rotated_at_local_positions(get_engine: Callable[[str, str], StitchEngine]) -> None:
    """An arena range holds the block's keys rotated at base .. (the model's rotary), values as stored."""
    engine = get_engine("mistral", "cpu")
    block = setup(engine).chunks[1]
    arena = ChunkArena(engine.spec, engine.forward.rotary, 2 * block.nbytes(), base=5)
    (chunk,) = arena.acquire([block], "v")
    n = block.num_tokens
    assert chunk == ChunkRange(0, n, 5)
    held = arena.data[:, :, :, :n]
    rotated = engine.forward.rotary.rotate(block.kv[:, 0], torch.arange(5, 5 + n))
    assert torch.equal(held[:, 0], rotated) and torch.equal(held[:, 1], block.kv[:, 1])
    assert arena.acquire([block], "other version")[0].start == n  # keyed by version too


def test_a_prompts_block_hashes_find_the_chunks_its_ids_find(get_engine: Callable[[str, str], StitchEngine]) -> None:
    """Lookups by a prompt's precomputed block hashes (`PromptIds.block_hashes`, how the engine thread admits)
    find and pin what lookups by the ids alone do, in order, for a list of ids too; hashes that do not match
    the blocks in number are refused."""
    engine = get_engine("llama", "cpu")
    s = setup(engine)
    version = engine.kv_version
    arena = nan_arena(engine, sum(b.num_tokens for b in s.chunks[:3]))
    placed = arena.acquire(s.chunks[:2], version)
    prompt = PromptIds(engine.template.prefix, tuple(b.token_ids for b in s.chunks[:3]), (7,))
    assert prompt.block_hashes == tuple(hash(b.token_ids) for b in s.chunks[:3])
    blocks = [list(prompt.blocks[0]), *prompt.blocks[1:]]  # a list hashes as its tuple
    by_hash = arena.pin_held(version, blocks, prompt.block_hashes)
    assert by_hash == arena.pin_held(version, prompt.blocks) == [*placed, None]
    assert arena.pins(version, s.chunks[0].token_ids) == 3
    assert arena.may_hold(version, prompt.blocks, prompt.block_hashes)
    four = PromptIds(engine.template.prefix, (*prompt.blocks, s.chunks[3].token_ids), (7,))
    assert not arena.may_hold(version, four.blocks, four.block_hashes)  # chunks 2 and 3 fit no unpinned room
    with pytest.raises(ValueError, match="2 hashes for 3 blocks"):
        arena.pin_held(version, prompt.blocks, prompt.block_hashes[:2])


class _RotateItself:
    """A `LayerAttend` that rotates q to the step's positions and runs the loop attention: the plumbing's check."""

    def __init__(self, engine: StitchEngine, rows: DecodeRows) -> None:
        self.engine, self.rows = engine, rows
        self.layers: list[int] = []

    def attend_layer(self, layer: int, q: torch.Tensor, kv: torch.Tensor, scale: float) -> torch.Tensor:
        self.layers.append(layer)
        q_rot = self.engine.forward.rotary.rotate(q.transpose(0, 1), self.rows.positions).transpose(0, 1)
        return batch_attention(LOOP, self.rows, kv.shape[2])(q_rot, kv[0], kv[1], scale)


def test_a_layer_attend_gets_every_layer_and_the_unrotated_queries(
    get_engine: Callable[[str, str], StitchEngine],
) -> None:
    """Through `layers_static`, an attention rotating the queries itself equals the plain step (fp32 rounding),
    writes the same K/V, and is called once per layer in order."""
    engine = get_engine("qwen2", "cpu")
    pools = [nan_pool(engine, 64), nan_pool(engine, 64)]
    filled = torch.randn(pools[0].data.shape, generator=torch.Generator().manual_seed(3))
    for pool in pools:
        pool.data.copy_(filled)
    rows = DecodeRows.build([5, 17], [30, 12], [(0, 20), (30, 9)], engine.spec.device)
    plain = BatchDecoder(engine.forward, pools[0], LOOP).step(rows)
    attend = _RotateItself(engine, rows)
    assert isinstance(attend, LayerAttend)
    fwd = engine.forward
    with torch.inference_mode():
        hidden = fwd.layers_static(
            pools[1].data,
            fwd.embed_static(rows.ids.view(1, -1)),
            rows.positions,
            rows.slots,
            attend,
            (0, len(fwd.layers)),
        )
        mine = fwd.head_rows(hidden)
    assert attend.layers == list(range(engine.spec.num_layers))
    assert float((mine - plain).abs().max()) <= 1e-5
    # Keys rotated alone by the same elementwise arithmetic: layer 0's K/V are bit-equal; later layers' inputs
    # carry the attention's rounding.
    assert torch.equal(pools[0].data[0], pools[1].data[0])
    assert float((pools[0].data - pools[1].data).abs().max()) <= 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_gpu_shared_kernels_decode_the_copy_paths_tokens(get_engine: Callable[[str, str], StitchEngine]) -> None:
    """On CUDA (bf16) the Triton segment kernels run the shared path; its tokens follow the copy path's where the
    copy path's top-2 gap is over twice the bf16 tolerance (the rule of test_engine_cuda_graph.py)."""
    engine = get_engine("llama", "cuda")
    assert triton_runs_on(engine.spec.device)
    s = setup(engine)
    (want_tokens, want_logits), _ = copy_path(engine, s, MODES["mixed"])
    run = shared_path(engine, s, MODES["mixed"], nan_arena(engine, sum(b.num_tokens for b in s.chunks)))
    got_tokens, got_logits = run.trace
    for got, want, step_tokens, want_step in zip(got_logits, want_logits, got_tokens, want_tokens, strict=True):
        assert torch.isfinite(got).all() and float((got - want).abs().max()) <= BF16_TOLERANCE
        top2 = want.topk(2, dim=-1).values
        clear = ((top2[:, 0] - top2[:, 1]) > 2 * BF16_TOLERANCE).tolist()
        assert all(g == w for g, w, c in zip(step_tokens, want_step, clear, strict=True) if c)
        if step_tokens != want_step:
            break  # a near tie went the other way: the histories differ from here


@pytest.mark.parametrize("arch", ("llama", "qwen2"))
def test_the_prefix_placer_copies_what_a_stitch_places_into_every_slab(
    get_engine: Callable[[str, str], StitchEngine], arch: str
) -> None:
    engine = get_engine(arch, "cpu")
    prefix, tokens = engine.prefix_block, engine.prefix_block.num_tokens
    pool = nan_pool(engine, 5 * (tokens + 8))
    reference_slab = pool.allocate(tokens + 8)
    reference = place_prefix(pool, reference_slab, prefix, engine.forward.rotary)
    placer = PrefixPlacer(pool, engine.forward.rotary)

    buffers = [placer.place(pool.allocate(tokens + 8), prefix) for _ in range(3)]

    expected = reference.data[:, :, :, :tokens]
    for buffer in buffers:  # the first stitched, the others copied: all equal, bit for bit
        assert (buffer.length, buffer.next_position) == (tokens, tokens)
        assert torch.equal(buffer.data[:, :, :, :tokens], expected)
        assert torch.isnan(buffer.data[:, :, :, tokens:]).all()  # nothing written past the prefix
    buffers[0].data.fill_(0.0)  # the kept copy is its own memory, not the first slab
    assert torch.equal(placer.place(pool.allocate(tokens + 8), prefix).data[:, :, :, :tokens], expected)


# The Triton kernels on the CPU: under Triton's interpreter only (TRITON_INTERPRET=1 with triton importable).
KERNELS_ON_CPU = triton_runs_on(torch.device("cpu"), interpreter=os.environ.get("TRITON_INTERPRET") == "1")


@pytest.mark.parametrize(
    "kernels", [False, pytest.param(True, marks=pytest.mark.skipif(not KERNELS_ON_CPU, reason="needs the kernels"))]
)
@pytest.mark.parametrize("arch", ("llama", "qwen2", "mistral"))
def test_a_question_riding_in_a_decode_step_gets_the_logits_of_its_own_prefill(
    get_engine: Callable[[str, str], StitchEngine], arch: str, kernels: bool
) -> None:
    """Two answers decode a step while a third request's question is prefilled in the same forward (`mixed`):
    each part's logits are those of the step and the prefill run apart, and the slabs hold the same K/V after;
    fp32 on the CPU, NaN in every pool and arena slot nobody wrote; the torch reference, or the kernels (the
    step by chunk, the question by request) under the interpreter."""
    engine = get_engine(arch, "cpu")
    s = setup(engine)
    logits, pools = [], []
    for together in (False, True):
        arena, pool = nan_arena(engine, 200), nan_pool(engine, 1500)
        shared = SharedDecoder(BatchDecoder(engine.forward, pool, LOOP), arena, kernels=kernels)
        requests, reads = _placed(engine, s, arena, pool, MODES["mixed"])
        first = shared.extend(ExtendRows.build(requests[:2], engine.spec.device), extend_batch(requests[:2], reads[:2]))
        ids = first.argmax(-1).tolist()
        at = [p + len(q) for q, p, _, _ in requests[:2]]
        live = [(start, used + len(q) + 1) for q, _, start, used in requests[:2]]
        step_rows, step_call = DecodeRows.build(ids, at, live, engine.spec.device), decode_batch(at, live, reads[:2])
        question_rows = ExtendRows.build(requests[2:], engine.spec.device)
        question_call = extend_batch(requests[2:], reads[2:])
        if together:
            logits.append(shared.mixed(step_rows, step_call, question_rows, question_call))
        else:
            apart = (shared.step(step_rows, step_call), shared.extend(question_rows, question_call))
            logits.append(torch.cat(apart))
        pools.append(pool.data.clone())
    assert logits[0].shape == (3, engine.spec.vocab_size) and torch.isfinite(logits[1]).all()
    assert (logits[0] - logits[1]).abs().max().item() < 1e-4
    assert logits[0].argmax(-1).tolist() == logits[1].argmax(-1).tolist()
    written = ~torch.isnan(pools[0])
    assert torch.equal(written, ~torch.isnan(pools[1]))
    assert (pools[0][written] - pools[1][written]).abs().max().item() < 1e-4


def test_a_mixed_forward_refuses_metadata_of_other_rows(get_engine: Callable[[str, str], StitchEngine]) -> None:
    """Each part's segment metadata must be of that part's rows: swapped, the forward is refused before it runs."""
    engine = get_engine("qwen2", "cpu")
    s = setup(engine)
    arena, pool = nan_arena(engine, 200), nan_pool(engine, 1500)
    shared = SharedDecoder(BatchDecoder(engine.forward, pool, LOOP), arena)
    requests, reads = _placed(engine, s, arena, pool, MODES["reordered"])
    at = [p for _, p, _, _ in requests[:2]]
    live = [(start, used + 1) for _, _, start, used in requests[:2]]
    step_rows, step_call = DecodeRows.build([1, 2], at, live, engine.spec.device), decode_batch(at, live, reads[:2])
    question_rows = ExtendRows.build(requests[2:], engine.spec.device)
    question_call = extend_batch(requests[2:], reads[2:])
    before = pool.data.clone()
    with pytest.raises(ValueError, match="its own rows"):
        shared.mixed(step_rows, question_call, question_rows, step_call)
    assert torch.equal(pool.data.isnan(), before.isnan())  # nothing written


def _placed(
    engine: StitchEngine, s: Setup, arena: ChunkArena, pool: KVPool, modes: Sequence[str]
) -> tuple[list[tuple[list[int], int, int, int]], list[Reads]]:
    """Every request of READS with its chunks in the arena and its prefix in a slab of its own: the (question,
    first position, slab start, live slots) an extend takes, and its placements."""
    requests, reads = [], []
    prefix = engine.prefix_block
    for chunk_ids, mode, question in zip(READS, modes, s.questions, strict=True):
        blocks = [s.chunks[c] for c in chunk_ids]
        ranges = arena.acquire(blocks, engine.kv_version)
        plan = engine.plan(mode, [prefix, *blocks])
        slab = pool.allocate(prefix.num_tokens + len(question) + EXTRA)
        place_prefix(pool, slab, prefix, engine.forward.rotary)
        requests.append((question, plan.question_start, slab.start, prefix.num_tokens))
        reads.append(placements(plan, ranges))
    return requests, reads
