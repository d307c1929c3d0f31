"""Selective recompute after the stitch: its identities (nothing recomputed = turbo, everything = naive), the
tokens each spec chooses, the KV it leaves, and its spec parser."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import pytest
import torch

from service.engine.attention import SlotGroup, attend_at_slots, attend_causal_end, slot_groups
from service.engine.batch_request import BatchRequest
from service.engine.engine import StitchEngine
from service.engine.gate import default_tolerance, synthetic_ids
from service.engine.kv_buffer import KVBuffer
from service.engine.kv_pool import KVPool
from service.engine.offline import generate
from service.engine.prompt import PromptIds
from service.engine.recompute import full_prefill_is_cheaper
from service.engine.recompute_select import top_share
from service.engine.recompute_spec import AUTO_THRESHOLD, RecomputeKind, RecomputeSpec, parse_recompute
from service.engine.sampling import SamplingParams
from service.engine.scheduler import Scheduler
from service.engine.stitch import PositionMode, StitchPlan

CHUNKS = (23, 9, 31, 14)
GetEngine = Callable[[str, str], StitchEngine]


def _prompt(engine: StitchEngine, seed: int = 5) -> PromptIds:
    chunks = synthetic_ids(engine, CHUNKS, seed=seed)
    return engine.template.prompt(chunks, synthetic_ids(engine, [10], seed=seed + 50)[0])


def _stitched(
    engine: StitchEngine, prompt: PromptIds, spec: str, positions: PositionMode = PositionMode.REORDERED
) -> tuple[KVBuffer, StitchPlan, int, torch.Tensor]:
    """Stitch, recompute `spec`, prefill the question: buffer, plan, recomputed count, question logits [T, vocab]."""
    chunk_kv = engine.precompute(prompt.blocks)
    buffer, plan = engine.stitch(chunk_kv, positions, len(prompt.question))
    count = engine.recompute(buffer, plan, chunk_kv, parse_recompute(spec), prompt.question)
    logits = engine.prefill_question(buffer, prompt.question, all_logits=True)
    return buffer, plan, count, logits


def _chunk_tokens(prompt: PromptIds) -> int:
    return sum(len(b) for b in prompt.blocks)


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


@pytest.mark.parametrize("positions", list(PositionMode))
@pytest.mark.parametrize("spec", ["none", "selective:0", "prefix:0"])
def test_recomputing_nothing_is_plain_turbo(engine: StitchEngine, positions: PositionMode, spec: str) -> None:
    prompt = _prompt(engine)
    _, plain, _ = engine.prefill_stitched(engine.precompute(prompt.blocks), prompt.question, positions, all_logits=True)
    _, _, count, logits = _stitched(engine, prompt, spec, positions)
    assert count == 0 and torch.equal(logits, plain)


@pytest.mark.parametrize("spec", ["selective:1", "prefix:LONGEST", "prefix:1000"])
def test_recomputing_every_chunk_token_is_the_naive_prefill(engine: StitchEngine, spec: str) -> None:
    """Reordered positions are naive's, so recomputing all chunk tokens leaves naive's KV and logits."""
    prompt = _prompt(engine)
    spec = spec.replace("LONGEST", str(max(len(b) for b in prompt.blocks)))  # a wrapped block: chunk + wrapper
    naive_buffer, naive = engine.prefill_naive(prompt, all_logits=True)
    buffer, plan, count, logits = _stitched(engine, prompt, spec)
    tolerance = default_tolerance(engine.spec.dtype)
    assert count == _chunk_tokens(prompt)
    assert _diff(logits, naive[-len(prompt.question) :]) <= tolerance
    context = plan.context_tokens
    assert _diff(buffer.data[..., :context, :], naive_buffer.data[..., :context, :]) <= tolerance
    _, turbo, _ = engine.prefill_stitched(engine.precompute(prompt.blocks), prompt.question, all_logits=True)
    to_naive = _diff(logits, naive[-len(prompt.question) :])
    assert _diff(turbo, naive[-len(prompt.question) :]) > 10 * max(to_naive, 1e-6)  # the identity has teeth


def _changed_slots(engine: StitchEngine, prompt: PromptIds, after: KVBuffer, positions: PositionMode) -> list[int]:
    """Context slots whose KV in `after` differ from the plain stitch in any layer."""
    plain, plan = engine.stitch(engine.precompute(prompt.blocks), positions, len(prompt.question))
    context = plan.context_tokens
    differs = (after.data[..., :context, :] != plain.data[..., :context, :]).flatten(0, 2).any(dim=0).any(dim=-1)
    return differs.nonzero().flatten().tolist()


def test_prefix_recomputes_the_first_n_tokens_of_every_chunk(engine: StitchEngine) -> None:
    positions = PositionMode.REORDERED
    prompt = _prompt(engine)
    n = 12
    buffer, plan, count, _ = _stitched(engine, prompt, f"prefix:{n}", positions)
    expected = [
        s + i for s, length in zip(plan.slots[1:], plan.lengths[1:], strict=True) for i in range(min(n, length))
    ]
    assert count == len(expected) == sum(min(n, len(b)) for b in prompt.blocks)
    assert _changed_slots(engine, prompt, buffer, positions) == expected
    # The first chunk follows the exact prefix: its first n tokens see exact KV only, so they are naive's.
    naive_buffer, _ = engine.prefill_naive(prompt)
    first = slice(plan.slots[1], plan.slots[1] + n)
    got, want = buffer.data[..., first, :], naive_buffer.data[..., first, :]
    assert _diff(got, want) <= default_tolerance(engine.spec.dtype)


@pytest.mark.parametrize("spec", ["prefix:4", "selective:0.5", "query:0.2", "auto"])
def test_composite_positions_refuse_a_recompute(get_engine: GetEngine, spec: str) -> None:
    engine = get_engine("llama", "cpu")
    with pytest.raises(ValueError, match="composite positions cannot be recomputed"):
        _stitched(engine, _prompt(engine), spec, PositionMode.COMPOSITE)


def _deviation_at_layer_one(cached: torch.Tensor, full: torch.Tensor, slots: slice) -> torch.Tensor:
    """Per-token squared L2 distance of layer-1 keys and values [tokens], computed from whole buffers."""
    a, b = cached[1, :, :, slots].float(), full[1, :, :, slots].float()
    return (a - b).square().sum(dim=(0, 1, 3))


@pytest.mark.parametrize("share", [0.1, 0.3, 0.75])
def test_selective_recomputes_the_share_whose_kv_deviates_most(engine: StitchEngine, share: float) -> None:
    """The chosen tokens are the top share by layer-1 KV deviation from naive's (full attention) KV; each of them
    then holds naive's layer-1 KV, and every other token keeps its cached KV."""
    if engine.spec.dtype != torch.float32:
        pytest.skip("bf16 rounding may swap near-tied deviations between the two computations of them")
    prompt = _prompt(engine, seed=8)
    plain, plan = engine.stitch(engine.precompute(prompt.blocks), PositionMode.REORDERED, len(prompt.question))
    naive_buffer, _ = engine.prefill_naive(prompt)
    chunk = slice(plan.lengths[0], plan.context_tokens)
    deviation = _deviation_at_layer_one(plain.data, naive_buffer.data, chunk)
    count = int(share * _chunk_tokens(prompt) + 0.5)
    expected = sorted((torch.topk(deviation, count).indices + plan.lengths[0]).tolist())

    buffer, _, recomputed, _ = _stitched(engine, prompt, f"selective:{share}")

    assert recomputed == count and 0 < count < _chunk_tokens(prompt)
    assert _changed_slots(engine, prompt, buffer, PositionMode.REORDERED) == expected
    chosen = torch.tensor(expected)
    got = buffer.data[:2].index_select(3, chosen)
    want = naive_buffer.data[:2].index_select(3, chosen)
    assert _diff(got, want) <= default_tolerance(engine.spec.dtype)


def test_a_floor_gives_every_chunk_its_own_best_share_before_the_best_overall() -> None:
    # Block 0 (4 scores) holds the lowest scores: without a floor it gets none of the 5 chosen.
    scores = torch.tensor([0.1, 0.4, 0.3, 0.2, 5.0, 6.0, 1.0, 7.0, 9.0, 8.0])
    blocks = (4, 6)
    assert top_share(scores, 5).tolist() == [4, 5, 7, 8, 9]
    # Floor 0.5: block 0 gives its best 2 (1, 2), block 1 its best 3 (8, 9, 7); 0 are left to choose overall.
    assert top_share(scores, 5, blocks, 0.5).tolist() == [1, 2, 7, 8, 9]
    # Floor 0.25: 1 + 1 (rounded down) from the blocks (1; 8), then the best 3 left (9, 7, 5).
    assert top_share(scores, 5, blocks, 0.25).tolist() == [1, 5, 7, 8, 9]
    assert top_share(scores, 10, blocks, 1.0).tolist() == list(range(10))
    with pytest.raises(ValueError, match="blocks of 9 scores for 10"):
        top_share(scores, 5, (4, 5), 0.5)


def test_selective_with_a_floor_recomputes_tokens_of_every_chunk(engine: StitchEngine) -> None:
    """The chunk blocks each get their floor share of recomputed tokens; the count is the share's, as without."""
    prompt = _prompt(engine, seed=8)
    floor = 0.2
    buffer, plan, recomputed, _ = _stitched(engine, prompt, f"selective:0.3:{floor}")
    assert recomputed == int(0.3 * _chunk_tokens(prompt) + 0.5)
    changed = set(_changed_slots(engine, prompt, buffer, PositionMode.REORDERED))
    for start, length in zip(plan.slots[1:], plan.lengths[1:], strict=True):
        assert len(changed & set(range(start, start + length))) >= int(floor * length)


def test_a_buffer_holding_more_than_the_context_is_refused(get_engine: GetEngine) -> None:
    engine = get_engine("qwen2", "cpu")
    prompt = _prompt(engine)
    chunk_kv = engine.precompute(prompt.blocks)
    buffer, _, plan = engine.prefill_stitched(chunk_kv, prompt.question)
    with pytest.raises(ValueError, match="stitched context alone"):
        engine.recompute(buffer, plan, chunk_kv, parse_recompute("selective:0.5"))


def _generate(engine: StitchEngine, prompt: PromptIds, mode: str, recompute: str) -> tuple[list[int], int, float]:
    """One request alone through the scheduler: its tokens, recomputed count and recompute time."""
    result = generate(engine, prompt, SamplingParams(max_new_tokens=8, ignore_eos=True), mode, recompute=recompute)
    return result.token_ids, result.recomputed_tokens, result.timings.recompute_ms


def test_an_answer_with_everything_recomputed_answers_as_naive(get_engine: GetEngine) -> None:
    engine = get_engine("llama", "cpu")
    prompt = _prompt(engine, seed=3)
    naive, naive_count, _ = _generate(engine, prompt, "naive", "selective:1")
    tokens, count, recompute_ms = _generate(engine, prompt, "turbo", "selective:1")
    assert tokens == naive and count == _chunk_tokens(prompt) and recompute_ms > 0
    assert naive_count == 0  # naive computes every token anyway: nothing to recompute
    _, none_count, none_ms = _generate(engine, prompt, "turbo", "none")
    assert (none_count, none_ms) == (0, 0.0)
    _, prefix_count, _ = _generate(engine, prompt, "turbo", "prefix:4")
    assert prefix_count == 4 * len(prompt.blocks)


@pytest.mark.parametrize("spec", ["selective:0.3", "prefix:5"])
def test_an_answer_serves_the_recomputed_context(engine: StitchEngine, spec: str) -> None:
    """Through the scheduler alone (on CUDA: stitched into a leased graph's buffer, question prefilled by its graph)
    the first token is the one the eager stitch + recompute + question prefill gives, and the count is reported."""
    prompt = _prompt(engine, seed=11)
    _, _, count, logits = _stitched(engine, prompt, spec)
    result = generate(
        engine, prompt, SamplingParams(max_new_tokens=3), chunk_kv=engine.precompute(prompt.blocks), recompute=spec
    )
    assert result.recomputed_tokens == count > 0
    assert result.token_ids[0] == int(logits[-1].argmax())


def test_batched_answers_recompute_as_one_alone_does(get_engine: GetEngine) -> None:
    """Batched answers recompute in their prefill: everything recomputed answers as naive, a partial spec as the
    same request alone, and each request reports its own count beside a plain turbo one."""
    engine = get_engine("qwen2", "cpu")
    pool = KVPool(engine.spec, 2000 * engine.spec.kv_bytes_per_token(), poison="nan")
    scheduler = Scheduler(engine, pool, max_batch=4)
    prompt = _prompt(engine, seed=13)
    sampling = SamplingParams(max_new_tokens=8, ignore_eos=True)
    specs = ("selective:1", "prefix:4", "none")
    requests = [BatchRequest(prompt, sampling, recompute=parse_recompute(spec)) for spec in specs]
    naive = BatchRequest(prompt, sampling, "naive", recompute=parse_recompute("selective:1"))
    for request in (*requests, naive):
        scheduler.add(request)
    scheduler.run_until_idle()
    full, partial, plain = (r.result for r in requests)
    assert full.token_ids == naive.result.token_ids and full.recomputed_tokens == _chunk_tokens(prompt)
    assert partial.token_ids == _generate(engine, prompt, "turbo", "prefix:4")[0]
    assert partial.recomputed_tokens == 4 * len(prompt.blocks) and partial.timings.recompute_ms > 0
    assert (plain.recomputed_tokens, naive.result.recomputed_tokens) == (0, 0)


def test_attention_at_scattered_slots_is_causal_per_slot() -> None:
    """On the context's tail it equals the end-aligned causal kernel; at scattered slots each query's output is
    that of attention over the keys up to its own slot alone."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn((1, 4, 6, 8), generator=generator)
    keys, values = torch.randn((2, 20, 8), generator=generator), torch.randn((2, 20, 8), generator=generator)
    tail = attend_at_slots(q, keys, values, torch.arange(14, 20), 0.3)
    assert _diff(tail, attend_causal_end(q, keys.unsqueeze(0), values.unsqueeze(0), 0.3)) < 1e-6
    slots = torch.tensor([2, 5, 6, 11, 17, 19])
    scattered = attend_at_slots(q, keys, values, slots, 0.3)
    for i, slot in enumerate(slots.tolist()):
        k, v = keys[:, : slot + 1].unsqueeze(0), values[:, : slot + 1].unsqueeze(0)
        alone = attend_causal_end(q[:, :, i : i + 1], k, v, 0.3)
        assert _diff(scattered[:, i : i + 1], alone) < 1e-6


def test_slot_groups_split_the_queries_into_runs_that_read_keys_up_to_their_last_slot() -> None:
    slots = [3, 4, 9, 12, 20, 21, 30, 41, 42, 50]
    assert slot_groups(slots, groups=4, min_queries=2) == (
        SlotGroup(0, 2, 5),
        SlotGroup(2, 5, 21),
        SlotGroup(5, 8, 42),
        SlotGroup(8, 10, 51),
    )
    assert slot_groups(slots, groups=4, min_queries=4) == (SlotGroup(0, 5, 21), SlotGroup(5, 10, 51))
    assert slot_groups(slots, groups=4, min_queries=256) == (SlotGroup(0, 10, 51),)  # few queries: one call
    assert slot_groups([], groups=4, min_queries=1) == ()


def test_grouped_attention_at_scattered_slots_equals_one_call_over_every_key() -> None:
    """Keys past a run's last slot are masked for every query of the run: leaving them unread changes nothing."""
    generator = torch.Generator().manual_seed(1)
    q = torch.randn((1, 4, 9, 8), generator=generator)
    keys, values = torch.randn((2, 40, 8), generator=generator), torch.randn((2, 40, 8), generator=generator)
    slots = torch.tensor([1, 2, 7, 15, 16, 22, 30, 33, 39])
    whole = attend_at_slots(q, keys, values, slots, 0.3)
    groups = slot_groups(slots.tolist(), groups=3, min_queries=1)
    assert len(groups) == 3 and groups[0].keys < 40
    assert _diff(attend_at_slots(q, keys, values, slots, 0.3, groups), whole) < 1e-6
    wrong = (SlotGroup(0, 9, 10),)  # a run cut short of its queries' slots reads too few keys: the test has teeth
    assert _diff(attend_at_slots(q, keys, values, slots, 0.3, wrong), whole) > 1e-3


def test_a_recompute_in_groups_of_queries_leaves_what_one_group_does(
    engine: StitchEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SDPA's recompute (where `slot_attention`'s kernel does not run) splits its chosen tokens into runs only
    past a few hundred of them: forced here on a tiny prompt, the buffer and the question's logits equal the
    one-call recompute's."""
    monkeypatch.setattr("service.engine.recompute.slot_kernel_usable", lambda *args: False)
    prompt = _prompt(engine, seed=8)
    one_buffer, _, one_count, one_logits = _stitched(engine, prompt, "selective:0.5")
    seen: list[int] = []

    def forced(slots: list[int]) -> tuple[SlotGroup, ...]:
        groups = partial(slot_groups, groups=3, min_queries=1)(slots)
        seen.append(len(groups))
        return groups

    monkeypatch.setattr("service.engine.recompute.slot_groups", forced)
    buffer, _, count, logits = _stitched(engine, prompt, "selective:0.5")
    tolerance = default_tolerance(engine.spec.dtype)
    assert seen == [3] and count == one_count > 0
    assert _diff(buffer.data, one_buffer.data) <= tolerance and _diff(logits, one_logits) <= tolerance


# ---- the spec -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "parsed"),
    [
        ("none", RecomputeSpec()),
        ("prefix:0", RecomputeSpec(RecomputeKind.PREFIX, 0)),
        ("prefix:16", RecomputeSpec(RecomputeKind.PREFIX, 16)),
        ("selective:0", RecomputeSpec(RecomputeKind.SELECTIVE, 0.0)),
        ("selective:0.25", RecomputeSpec(RecomputeKind.SELECTIVE, 0.25)),
        ("selective:1", RecomputeSpec(RecomputeKind.SELECTIVE, 1.0)),
        ("query:0.2", RecomputeSpec(RecomputeKind.QUERY, 0.2)),
        ("selective:0.2:0.1", RecomputeSpec(RecomputeKind.SELECTIVE, 0.2, 0.1)),
        ("query:0.5:0.5", RecomputeSpec(RecomputeKind.QUERY, 0.5, 0.5)),
        ("auto", RecomputeSpec(RecomputeKind.AUTO, AUTO_THRESHOLD)),
        ("auto:0.1", RecomputeSpec(RecomputeKind.AUTO, 0.1)),
    ],
)
def test_recompute_specs_parse_and_print_back(spec: str, parsed: RecomputeSpec) -> None:
    assert parse_recompute(spec) == parsed
    assert parse_recompute(str(parsed)) == parsed
    assert str(parsed) == spec
    assert parsed.active == (spec not in ("none", "prefix:0", "selective:0"))


@pytest.mark.parametrize(
    "spec", ["", "all", "none:1", "prefix", "prefix:", "prefix:-1", "prefix:1.5", "prefix:²", "selective:",
             "selective:1.01", "selective:-0.1", "selective:nan", "selective:x", "query", "query:2", "auto:0",
             "selective:0.2:0.3", "selective:0.2:", "selective:0.2:-0.1", "selective:0.2:x", "query:0.1:nan",
             "selective:0.2:0.1:0", "prefix:4:1", "auto:0.1:0.1",
             "auto:1.5", "auto:x", "auto:nan"],
)  # fmt: skip
def test_bad_recompute_specs_are_refused(spec: str) -> None:
    with pytest.raises(ValueError, match="recompute"):
        parse_recompute(spec)


# ---- served by a full prefill where that is cheaper --------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "lengths", "context", "short", "expected"),
    [
        ("selective:0.6", [50, 50], 120, 0, True),  # the share at which a recompute costs more than a prefill
        ("selective:0.5", [50, 50], 120, 0, False),
        ("query:0.7", [50, 50], 120, 0, True),
        ("prefix:40", [50, 50], 120, 0, True),  # 80 of 100
        ("prefix:20", [50, 50], 120, 0, False),
        ("auto", [50, 50], 120, 0, False),  # auto decides per request, at most 30 %
        ("auto", [50, 50], 120, 1024, True),  # a short context: any recompute is a full prefill
        ("none", [50, 50], 120, 1024, False),  # nothing asked, nothing recomputed
    ],
)
def test_when_a_full_prefill_serves_a_recompute(
    spec: str, lengths: list[int], context: int, short: int, expected: bool
) -> None:
    assert full_prefill_is_cheaper(parse_recompute(spec), lengths, context, short) is expected


def test_a_short_context_is_recomputed_by_a_full_prefill(get_engine: GetEngine) -> None:
    engine = get_engine("llama", "cpu")
    prompt = _prompt(engine, seed=21)
    sampling = SamplingParams(max_new_tokens=6, ignore_eos=True)
    naive = generate(engine, prompt, sampling, "naive")
    engine.recompute_full_below = prompt.context_tokens + 1
    try:
        full = generate(engine, prompt, sampling, chunk_kv=engine.precompute(prompt.blocks), recompute="selective:0.2")
    finally:
        engine.recompute_full_below = 0
    partial = generate(engine, prompt, sampling, chunk_kv=engine.precompute(prompt.blocks), recompute="selective:0.2")
    assert full.token_ids == naive.token_ids and full.recomputed_tokens == _chunk_tokens(prompt)
    assert full.timings.recompute_ms > 0 and full.timings.stitch_ms == 0
    assert partial.recomputed_tokens == int(0.2 * _chunk_tokens(prompt) + 0.5) and partial.timings.stitch_ms > 0
