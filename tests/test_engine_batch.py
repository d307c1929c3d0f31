"""Continuous batching: every request's tokens in a batch are its tokens alone, whatever runs beside it.

CPU tests run the tiny models in fp32 and compare against the same request run alone (through a scheduler of its
own, its greedy tokens checked against the reference forward of `reference.py`), token for token and text for
text. The batched step's logits differ from the single-sequence step's by float rounding only (~1e-6:
fused q/k/v and RMSNorm kernels, measured in `test_batched_step_logits_match_extend`), far below the top-2 gaps
these sequences show, so exact equality holds and is asserted. The pool is NaN-poisoned throughout: a request
reading one slot it did not write itself would turn NaN and break the equality.

GPU variants (bf16, marked `gpu`) check the batched tokens against eager decoding teacher-forced on each
request's own history, with the bf16 near-tie rule of `test_engine_cuda_graph.py`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from service.engine.batch_decode import (
    LOOP,
    SDPA_GATHER,
    BatchDecoder,
    DecodeRows,
    ExtendRows,
    probe_attention,
    probe_extend,
    resolve_batch_attention,
)
from service.engine.batch_graph import STEP_BUCKETS, BatchGraphs, batch_bucket
from service.engine.batch_request import BatchRequest, RequestStatus
from service.engine.engine import StitchEngine
from service.engine.extend_graph import ExtendGraphs, extend_layout, split_by_tokens, token_bucket
from service.engine.gate import BF16_TOLERANCE, synthetic_ids
from service.engine.kv_buffer import KVBuffer
from service.engine.kv_pool import KVPool
from service.engine.prompt import PromptIds
from service.engine.reference import reference_greedy, reference_logits
from service.engine.sampling import SamplingParams
from service.engine.scheduler import QueueFullError, Scheduler

HAS_CUDA = torch.cuda.is_available()
NEEDS_CUDA = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device here")


@dataclass(frozen=True)
class Case:
    """One request of a test batch."""

    chunks: tuple[int, ...]
    mode: str = "turbo"
    positions: str = "reordered"
    max_new: int = 10
    seed: int = 0
    question: int = 9
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    sampling_seed: int | None = None  # default: `seed`

    def prompt(self, engine: StitchEngine) -> PromptIds:
        chunks = synthetic_ids(engine, self.chunks, seed=self.seed)
        return engine.template.prompt(chunks, synthetic_ids(engine, (self.question,), seed=1000 + self.seed)[0])

    def params(self, ignore_eos: bool = True) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=self.max_new,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=(self.seed if self.sampling_seed is None else self.sampling_seed) if self.temperature > 0 else None,
            stop=self.stop,
            ignore_eos=ignore_eos,
        )


@dataclass
class Alone:
    tokens: list[int]
    text: str
    reason: str


class Tracked:
    """A request in the scheduler with the text it streamed."""

    def __init__(self, engine: StitchEngine, case: Case, ignore_eos: bool = True) -> None:
        self.case = case
        self.deltas: list[str] = []
        self.request = BatchRequest(
            case.prompt(engine), case.params(ignore_eos), case.mode, case.positions, on_text=self.deltas.append
        )

    def assert_matches(self, alone: Alone) -> None:
        result = self.request.result
        assert result.token_ids == alone.tokens, self.case
        assert (result.text, result.finish_reason) == (alone.text, alone.reason), self.case
        assert "".join(self.deltas) == result.text


def run_alone(engine: StitchEngine, case: Case, ignore_eos: bool = True) -> Alone:
    """The request by itself, through a scheduler of its own over a pool just its size. A greedy request's tokens
    are checked against the reference forward (the gate's: the HF model itself, no cache), so "alone" is not the
    batched path checked against itself."""
    alone = Tracked(engine, case, ignore_eos)
    scheduler = Scheduler(engine, nan_pool(engine, alone.request.tokens_needed), max_batch=1)
    scheduler.add(alone.request)
    drain(scheduler)
    result = alone.request.result
    assert "".join(alone.deltas) == result.text
    if case.temperature == 0:
        assert result.token_ids == list(reference_tokens(engine, case)[: len(result.token_ids)]), case
    return Alone(result.token_ids, result.text, result.finish_reason)


@functools.cache
def reference_tokens(engine: StitchEngine, case: Case) -> tuple[int, ...]:
    """The case's `max_new` greedy tokens of the reference forward re-run for every token (EOS not stopping it):
    under the block mask at the case's positions (turbo), or causal over the joined prompt (naive). Kept: many
    tests run the same cases alone."""
    prompt = case.prompt(engine)
    if case.mode != "naive":
        return tuple(reference_greedy(engine.model, prompt, case.positions, case.max_new))
    tokens: list[int] = []
    for _ in range(case.max_new):
        ids = [*prompt.joined(), *tokens]
        causal = torch.ones(len(ids), len(ids), dtype=torch.bool).tril()
        tokens.append(int(reference_logits(engine.model, ids, torch.arange(len(ids)), causal)[-1].argmax()))
    return tuple(tokens)


def nan_pool(engine: StitchEngine, slots: int) -> KVPool:
    return KVPool(engine.spec, slots * engine.spec.kv_bytes_per_token(), poison="nan")


def tokens_at_each_extend(scheduler: Scheduler, tracked: Tracked) -> list[int]:
    """A list that gets `tracked`'s token count on the host each time the scheduler runs a batched extend (a
    step's naive chunks, or questions prefilled together)."""
    seen: list[int] = []
    extend = scheduler.slabs.extend

    def logged_extend(*args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(len(tracked.request.result.token_ids))
        return extend(*args, **kwargs)

    scheduler.slabs.extend = logged_extend  # type: ignore[method-assign]
    return seen


def steps(scheduler: Scheduler, count: int) -> None:
    for _ in range(count):
        scheduler.step()


def drain(scheduler: Scheduler, limit: int = 400) -> None:
    """`run_until_idle` with a bound, so a request that is never admitted fails instead of hanging."""
    for _ in range(limit):
        if not scheduler.has_work():
            return
        scheduler.step()
    raise AssertionError(f"still {len(scheduler.waiting)} waiting, {len(scheduler.running)} running")


MIXED = (
    Case((30, 17), max_new=12, seed=1),
    Case((5,), positions="composite", max_new=20, seed=2),
    Case((60, 40, 20), mode="naive", max_new=8, seed=3),
    Case((), max_new=6, seed=4, question=3),
    Case((44, 9, 71), positions="composite", max_new=16, seed=5),
    Case((12,), mode="naive", max_new=14, seed=6, question=20),
)


OVERLAP = pytest.mark.parametrize("overlap", [False, True], ids=["read-each-step", "overlapped"])


@OVERLAP
@pytest.mark.parametrize("attention", [LOOP, SDPA_GATHER])
def test_batched_greedy_equals_alone(
    get_engine: Callable[..., StitchEngine], arch: str, attention: str, overlap: bool
) -> None:
    """Different context lengths, turbo and naive, both position modes; three requests join after three steps,
    requests leave as their budgets run out, one is cancelled mid-stream. Overlapped, each step is launched
    before the previous one is read: the same tokens, one step later on the host."""
    engine = get_engine(arch, "cpu")
    scheduler = Scheduler(engine, nan_pool(engine, 2000), max_batch=8, attention=attention, overlap=overlap)
    tracked = [Tracked(engine, case) for case in MIXED]
    cancelled = Tracked(engine, Case((25, 25), max_new=30, seed=7))
    for t in (*tracked[:3], cancelled):
        scheduler.add(t.request)
    steps(scheduler, 3)
    assert len(scheduler.running) == 4
    for t in tracked[3:]:
        scheduler.add(t.request)
    steps(scheduler, 2)
    used = scheduler.pool.used_slots
    scheduler.cancel(cancelled.request)
    scheduler.step()
    assert cancelled.request.finished and cancelled.request.slab is None
    assert scheduler.pool.used_slots < used  # freed in the step that saw the cancel
    drain(scheduler)
    for t in tracked:
        t.assert_matches(run_alone(engine, t.case))
    alone = run_alone(engine, cancelled.case)
    got = cancelled.request.result.token_ids
    assert cancelled.request.result.finish_reason == "cancelled"
    assert 0 < len(got) < len(alone.tokens) and got == alone.tokens[: len(got)]
    assert scheduler.pool.used_slots == 0 and not scheduler.has_work()


def test_overlapped_steps_with_first_tokens_read_at_admission_equal_alone(
    get_engine: Callable[..., StitchEngine],
) -> None:
    """`overlap_admissions=False`: decode steps overlap, but each admitted request's first token is read at its
    admission (the benchmarks' middle setting); tokens are each request's alone all the same."""
    engine = get_engine("qwen2", "cpu")
    scheduler = Scheduler(engine, nan_pool(engine, 2000), max_batch=8, overlap=True, overlap_admissions=False)
    tracked = [Tracked(engine, case) for case in MIXED]
    for t in tracked[:3]:
        scheduler.add(t.request)
    scheduler.step()
    assert all(len(t.request.result.token_ids) == 1 for t in tracked[:3])  # first tokens read, one step launched
    for t in tracked[3:]:
        scheduler.add(t.request)
    drain(scheduler)
    for t in tracked:
        t.assert_matches(run_alone(engine, t.case))
    assert scheduler.pool.used_slots == 0


@OVERLAP
def test_stop_strings_and_eos_end_only_their_request(get_engine: Callable[..., StitchEngine], overlap: bool) -> None:
    engine = get_engine("qwen2", "cpu")
    free = run_alone(engine, Case((20, 31), max_new=24, seed=11))
    stop_case = Case((20, 31), max_new=24, seed=11, stop=(free.text[8:11],))
    eos_case = Case((15,), max_new=24, seed=12)
    eos_token = run_alone(engine, eos_case).tokens[5]
    config = engine.model.hf.generation_config
    saved = config.eos_token_id
    config.eos_token_id = [engine.tokenizer.eos_token_id, eos_token]  # a token the run picks becomes EOS
    try:
        alone_eos = run_alone(engine, eos_case, ignore_eos=False)
        scheduler = Scheduler(engine, nan_pool(engine, 1000), overlap=overlap)
        with_eos = Tracked(engine, eos_case, ignore_eos=False)
        # The same prompt with EOS ignored runs beside it and must go on to its budget.
        others = [Tracked(engine, stop_case), Tracked(engine, eos_case), Tracked(engine, MIXED[0])]
        for t in (with_eos, *others):
            scheduler.add(t.request)
        drain(scheduler)
    finally:
        config.eos_token_id = saved
    assert alone_eos.reason == "stop" and alone_eos.tokens[-1] == eos_token
    with_eos.assert_matches(alone_eos)
    stopped = run_alone(engine, stop_case)
    assert stopped.reason == "stop" and len(stopped.tokens) < 24
    others[0].assert_matches(stopped)
    others[1].assert_matches(run_alone(engine, eos_case))
    others[2].assert_matches(run_alone(engine, MIXED[0]))


SAMPLED = (
    Case((30, 17), max_new=14, seed=21, temperature=0.8, top_p=0.9),
    Case((22,), max_new=14, seed=22, temperature=1.2, top_k=20),
    Case((9, 40), positions="composite", max_new=14, seed=23, temperature=1.0, top_p=0.8, top_k=50),
    Case((18,), mode="naive", max_new=14, seed=24, temperature=0.7),
    Case((26,), max_new=14, seed=25),  # greedy beside the sampled ones
)


@OVERLAP
def test_seeded_sampling_is_the_same_alone_and_batched(get_engine: Callable[..., StitchEngine], overlap: bool) -> None:
    engine = get_engine("llama", "cpu")
    scheduler = Scheduler(engine, nan_pool(engine, 1500), overlap=overlap)
    tracked = [Tracked(engine, case) for case in SAMPLED]
    scheduler.add(tracked[0].request)
    scheduler.step()  # the first request samples alone for a step, then beside the others
    for t in tracked[1:]:
        scheduler.add(t.request)
    drain(scheduler)
    for t in tracked:
        t.assert_matches(run_alone(engine, t.case))
    # The seed matters: the same request with another seed gives another answer.
    reseeded = run_alone(engine, Case((30, 17), max_new=14, seed=21, temperature=0.8, top_p=0.9, sampling_seed=99))
    assert reseeded.tokens != tracked[0].request.result.token_ids


@OVERLAP
def test_a_reused_slab_changes_nothing(get_engine: Callable[..., StitchEngine], overlap: bool) -> None:
    """The next request gets the finished one's slots: poisoned with NaN, then with huge finite garbage."""
    engine = get_engine("mistral", "cpu")
    first, second = Case((50, 30), max_new=12, seed=31), Case((40,), max_new=12, seed=32)
    alone = run_alone(engine, second)
    scheduler = Scheduler(engine, nan_pool(engine, 400), max_batch=1, overlap=overlap)
    for garbage in (None, 1e4):
        earlier = Tracked(engine, first)
        scheduler.add(earlier.request)
        steps(scheduler, 2)
        start = scheduler.running[0].slab.start if scheduler.running[0].slab else -1
        drain(scheduler)
        region = scheduler.pool.data[:, :, :, start : start + earlier.request.tokens_needed]
        assert bool(region.isnan().all())  # the finished request's memory is poisoned at once
        if garbage is not None:
            region.fill_(garbage)  # stale KV as a pool without poisoning would leave it
        later = Tracked(engine, second)
        scheduler.add(later.request)
        scheduler.step()
        assert later.request.slab is not None and later.request.slab.start == start
        drain(scheduler)
        later.assert_matches(alone)


@OVERLAP
def test_exhausted_pool_makes_requests_wait_then_complete(
    get_engine: Callable[..., StitchEngine], overlap: bool
) -> None:
    engine = get_engine("qwen2", "cpu")
    cases = [Case((30 + 7 * i,), max_new=6 + i, seed=40 + i) for i in range(5)]
    tracked = [Tracked(engine, case) for case in cases]
    needs = sorted(t.request.tokens_needed for t in tracked)
    scheduler = Scheduler(engine, nan_pool(engine, needs[-1] + needs[-2]), max_batch=8, overlap=overlap)
    for t in tracked:
        scheduler.add(t.request)
    admitted: list[BatchRequest] = []
    for _ in range(200):
        if not scheduler.has_work():
            break
        scheduler.step()
        assert len(scheduler.running) <= 2 and scheduler.pool.used_slots <= scheduler.pool.slots
        admitted += [r for r in scheduler.running if r not in admitted]
        if len(admitted) < 5:
            assert scheduler.waiting, "a request that fits no free slab must wait"
    assert not scheduler.has_work()
    assert [t.request for t in tracked if t.request in admitted] == [t.request for t in tracked][: len(admitted)]
    for t in tracked:
        t.assert_matches(run_alone(engine, t.case))


@pytest.mark.parametrize("overlap", [False, True])
def test_an_overlapped_step_is_read_while_the_next_runs_and_launches_no_row_past_the_budget(
    get_engine: Callable[..., StitchEngine], overlap: bool
) -> None:
    """Read at once, a step's token is on the host when `step` returns; overlapped, a step is launched and read
    during the next `step`. A request whose unread token is its last by its budget gets no row in the next step,
    so the step that reads that token ends it and returns its slab (NaN-poisoned) at once."""
    engine = get_engine("qwen2", "cpu")
    scheduler = Scheduler(engine, nan_pool(engine, 600), overlap=overlap)
    t = Tracked(engine, Case((20, 11), max_new=4, seed=70))
    scheduler.add(t.request)
    counts = []
    for _ in range(6):
        scheduler.step()
        state = (len(t.request.result.token_ids), scheduler.pool.used_slots > 0, scheduler.has_work())
        counts.append((*state, scheduler.last_batch))
    if overlap:  # admitted + first step launched; one token a step; the 4th step launches nothing and reads the last
        assert (
            counts
            == [(1, True, True, 1), (2, True, True, 1), (3, True, True, 1), (4, False, False, 0)]
            + [(4, False, False, 0)] * 2
        )
    else:
        assert counts == [(2, True, True, 1), (3, True, True, 1), (4, False, False, 1)] + [(4, False, False, 0)] * 3
    assert t.request.result.finish_reason == "length"
    t.assert_matches(run_alone(engine, t.case))
    assert bool(scheduler.pool.data.isnan().all())  # every slot the request wrote was poisoned


def test_overlapped_a_request_ended_by_eos_had_one_more_row_and_its_slab_waits_for_it(
    get_engine: Callable[..., StitchEngine],
) -> None:
    """An end by EOS (or a stop string) is known only when its token is read, after the next step was launched
    with a row for it: the row is dropped, and the slab returns to the pool only in the step after, once that row
    has run. Tokens are those of the run alone."""
    engine = get_engine("qwen2", "cpu")
    case = Case((20, 11), max_new=8, seed=70)
    free = run_alone(engine, case)
    at = next(i for i in range(2, len(free.tokens)) if free.tokens[i] not in free.tokens[:i])
    config = engine.model.hf.generation_config
    saved = config.eos_token_id
    config.eos_token_id = [engine.tokenizer.eos_token_id, free.tokens[at]]  # a token the run picks becomes EOS
    try:
        alone = run_alone(engine, case, ignore_eos=False)
        scheduler = Scheduler(engine, nan_pool(engine, 600), overlap=True)
        t = Tracked(engine, case, ignore_eos=False)
        scheduler.add(t.request)
        held_after_end = []
        while scheduler.has_work():
            ended = t.request.finished
            scheduler.step()
            if t.request.finished and not ended:  # the step that read the EOS
                held_after_end.append((scheduler.pool.used_slots > 0, scheduler.last_batch))
        assert scheduler.pool.used_slots == 0
    finally:
        config.eos_token_id = saved
    assert alone.reason == "stop" and len(alone.tokens) == at + 1
    t.assert_matches(alone)
    assert held_after_end == [(True, 1)]  # a row was launched past the EOS; the slab waited for it


def test_overlapped_a_first_token_that_ends_its_request_gets_no_row_and_changes_nothing(
    get_engine: Callable[..., StitchEngine],
) -> None:
    """Overlapped, a request runs from its admission, its first token fed to the next step from the device
    before the host has read it. A one-token answer's first token is its last: the next step has no row for it,
    its slab returns once the step launched beside it has run, and the requests beside it are unchanged."""
    engine = get_engine("llama", "cpu")
    scheduler = Scheduler(engine, nan_pool(engine, 800), overlap=True)
    one, longer = Tracked(engine, Case((16, 9), max_new=1, seed=80)), Tracked(engine, Case((30,), max_new=6, seed=81))
    for t in (one, longer):
        scheduler.add(t.request)
    scheduler.step()
    assert one.request.finished and one.request.slab is None
    assert scheduler.last_batch == 1  # the step launched with a row for the longer answer only
    assert scheduler.pool.used_slots == one.request.tokens_needed + longer.request.tokens_needed  # not yet back
    drain(scheduler)
    assert scheduler.pool.used_slots == 0
    for t in (one, longer):
        t.assert_matches(run_alone(engine, t.case))
    assert len(one.request.result.token_ids) == 1 and one.request.result.finish_reason == "length"


def test_max_batch_bounds_the_running_requests(get_engine: Callable[..., StitchEngine]) -> None:
    engine = get_engine("llama", "cpu")
    scheduler = Scheduler(engine, nan_pool(engine, 3000), max_batch=2)
    tracked = [Tracked(engine, Case((20,), max_new=4, seed=50 + i)) for i in range(4)]
    for t in tracked:
        scheduler.add(t.request)
    scheduler.step()
    assert len(scheduler.running) == 2 and len(scheduler.waiting) == 2
    assert [r.status for r in scheduler.waiting] == [RequestStatus.WAITING] * 2
    drain(scheduler)
    for t in tracked:
        t.assert_matches(run_alone(engine, t.case))


def test_add_refuses_what_can_never_run(get_engine: Callable[..., StitchEngine]) -> None:
    engine = get_engine("qwen2", "cpu")
    case = Case((30,), max_new=8)
    need = Tracked(engine, case).request.tokens_needed
    with pytest.raises(ValueError, match="never fit"):
        Scheduler(engine, nan_pool(engine, need - 1)).add(Tracked(engine, case).request)
    scheduler = Scheduler(engine, nan_pool(engine, 5000), max_waiting=1)
    too_long = Case((30,), max_new=engine.spec.max_context)
    with pytest.raises(ValueError, match="context"):
        scheduler.add(BatchRequest(too_long.prompt(engine), SamplingParams(max_new_tokens=8192)))
    foreign = PromptIds((1, 2), (), (3,))
    with pytest.raises(ValueError, match="template"):
        scheduler.add(BatchRequest(foreign, SamplingParams()))
    scheduler.add(Tracked(engine, case).request)
    with pytest.raises(QueueFullError):
        scheduler.add(Tracked(engine, case).request)


@OVERLAP
def test_a_failing_admission_ends_only_that_request(get_engine: Callable[..., StitchEngine], overlap: bool) -> None:
    engine = get_engine("mistral", "cpu")
    scheduler = Scheduler(engine, nan_pool(engine, 1000), overlap=overlap)
    good = Tracked(engine, MIXED[0])
    prompt = Case((14,), seed=60).prompt(engine)

    def broken_copy() -> None:
        raise RuntimeError("the host tier lost the block")

    finished: list[BatchRequest] = []
    bad = BatchRequest(
        prompt,
        SamplingParams(max_new_tokens=5),
        chunk_kv=engine.precompute(prompt.blocks),
        chunk_ready=[broken_copy],
        on_finish=finished.append,
    )
    scheduler.add(good.request)
    scheduler.add(bad)
    drain(scheduler)
    assert finished == [bad] and bad.result.finish_reason == "error" and isinstance(bad.error, RuntimeError)
    assert bad.slab is None and scheduler.pool.used_slots == 0
    good.assert_matches(run_alone(engine, MIXED[0]))


def test_timings_are_reported_per_request(get_engine: Callable[..., StitchEngine]) -> None:
    engine = get_engine("qwen2", "cpu")
    scheduler = Scheduler(engine, nan_pool(engine, 1000))
    turbo, naive = Tracked(engine, Case((20,), max_new=4)), Tracked(engine, Case((20,), mode="naive", max_new=4))
    for t in (turbo, naive):
        scheduler.add(t.request)
    drain(scheduler)
    for t in (turbo, naive):
        timings = t.request.result.timings
        assert timings.prefill_ms > 0 and timings.decode_ms > 0
        assert timings.ttft_ms >= timings.stitch_ms + timings.prefill_ms + t.request.queue_ms
        assert (timings.stitch_ms > 0) == (t.case.mode == "turbo")
    # Admitted in the same step: both slabs are taken (and chunk KV fetched) before either prefill runs.
    assert naive.request.queue_ms < turbo.request.result.timings.prefill_ms


# ---- the batched step itself ----------------------------------------------------------------------------


Row = tuple[KVBuffer, KVBuffer, int, int]  # the reference buffer, the slab's buffer, the slab's start, next token


def _tolerance(engine: StitchEngine) -> float:
    return 1e-4 if engine.spec.dtype == torch.float32 else BF16_TOLERANCE


def _stitched_rows(engine: StitchEngine, pool: KVPool, cases: Sequence[Case], extra: int) -> list[Row]:
    """Each case stitched and prefilled twice: into its own buffer (the reference) and into a pool slab."""
    out = []
    for case in cases:
        prompt = case.prompt(engine)
        kv = engine.precompute(prompt.blocks)
        ref, logits, _ = engine.prefill_stitched(kv, prompt.question, case.positions, extra_tokens=extra)
        slab = pool.allocate(ref.capacity)
        buffer = pool.buffer(slab)
        engine.stitch(kv, case.positions, len(prompt.question) + extra, into=buffer)
        in_slab = engine.prefill_question(buffer, prompt.question)
        assert float((in_slab - logits).abs().max()) <= (0.0 if engine.spec.device.type == "cpu" else 1e-2)
        out.append((ref, buffer, slab.start, int(torch.argmax(logits))))
    return out


@pytest.mark.parametrize("attention", ["auto", SDPA_GATHER])
def test_batched_step_logits_match_extend(get_engine: Callable[..., StitchEngine], device: str, attention: str) -> None:
    """Teacher-forced: every row of a batched step is the single-sequence step, to fp32 rounding on the CPU
    (to bf16 rounding on CUDA), whatever its neighbours' lengths."""
    engine = get_engine("llama", device)
    pool = nan_pool(engine, 1200)
    decoder = BatchDecoder(engine.forward, pool, attention)
    rows = _stitched_rows(engine, pool, MIXED[:2] + MIXED[4:5], extra=10)
    worst = 0.0
    for _ in range(8):
        spans = [(start, buffer.length + 1) for _, buffer, start, _ in rows]
        step = DecodeRows.build([r[3] for r in rows], [r[1].next_position for r in rows], spans, engine.spec.device)
        batched = decoder.step(step)
        for row, (ref, buffer, start, token) in enumerate(rows):
            buffer.commit(1, buffer.next_position + 1)
            single = engine.forward.extend(ref, [token], torch.tensor([ref.next_position]))
            worst = max(worst, float((batched[row] - single).abs().max()))
            rows[row] = (ref, buffer, start, int(torch.argmax(single)))
    assert worst <= _tolerance(engine), decoder.attention


def test_backends_read_only_live_slots(get_engine: Callable[..., StitchEngine], device: str) -> None:
    """On a probe whose dead slots hold NaN, every backend the device runs equals the per-request loop."""
    spec = get_engine("qwen2", device).spec
    backends = [SDPA_GATHER] if device == "cpu" else [SDPA_GATHER, resolve_batch_attention(spec)]
    for backend in backends:
        assert probe_attention(spec, backend) <= (1e-5 if device == "cpu" else 2e-2), backend


def test_auto_attention_is_the_loop_on_the_cpu(get_engine: Callable[..., StitchEngine]) -> None:
    assert resolve_batch_attention(get_engine("qwen2", "cpu").spec) == LOOP
    with pytest.raises(ValueError, match="batch attention"):
        resolve_batch_attention(get_engine("qwen2", "cpu").spec, "paged")


# ---- GPU (bf16) -------------------------------------------------------------------------------------------


def _assert_greedy_under_eager(engine: StitchEngine, case: Case, tokens: list[int]) -> None:
    """`tokens` are eager greedy picks given the same history, up to bf16 near-ties (test_engine_cuda_graph)."""
    prompt = case.prompt(engine)
    buffer: KVBuffer
    if case.mode == "naive":
        buffer, logits = engine.prefill_naive(prompt, extra_tokens=len(tokens))
    else:
        kv = engine.precompute(prompt.blocks) if prompt.blocks else []
        buffer, logits, _ = engine.prefill_stitched(kv, prompt.question, case.positions, extra_tokens=len(tokens))
    for step, token in enumerate(tokens):
        gap = float(logits.max() - logits[token])
        assert gap <= BF16_TOLERANCE, f"step {step}: token {token} is {gap:.4f} below eager's best"
        top2 = torch.topk(logits, 2).values
        if float(top2[0] - top2[1]) > 2 * BF16_TOLERANCE:
            assert token == int(torch.argmax(logits)), f"step {step}"
        logits = engine.forward.extend(buffer, [token], torch.tensor([buffer.next_position]))


@pytest.mark.gpu
@NEEDS_CUDA
@OVERLAP
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("attention", ["auto", SDPA_GATHER])
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_gpu_batched_greedy_follows_eager(
    get_engine: Callable[..., StitchEngine], arch: str, attention: str, graphs: bool, overlap: bool
) -> None:
    """Overlapped, each step's ids come from the previous step's picks on the device (fed inside the graphs)."""
    engine = get_engine(arch, "cuda")
    scheduler = Scheduler(
        engine, nan_pool(engine, 2000), max_batch=8, attention=attention, cuda_graphs=graphs, overlap=overlap
    )
    assert attention != "auto" or scheduler.decoder.attention in ("flash_varlen", SDPA_GATHER)
    tracked = [Tracked(engine, case) for case in MIXED]
    for t in tracked[:3]:
        scheduler.add(t.request)
    steps(scheduler, 3)
    for t in tracked[3:]:
        scheduler.add(t.request)
    drain(scheduler)
    for t in tracked:
        assert t.request.result.finish_reason == "length"
        _assert_greedy_under_eager(engine, t.case, t.request.result.token_ids)
    # The graphs' padding slot (and the batched-prefill graphs' scratch slab) stay theirs.
    extend_graphs = scheduler.slabs.extend_graphs
    scratch = (1 if graphs else 0) + (extend_graphs.scratch_slots if extend_graphs else 0)
    assert scheduler.pool.used_slots == scratch
    assert (extend_graphs is not None) == (graphs and scheduler.decoder.extend_backend == "flash_varlen")


@pytest.mark.gpu
@NEEDS_CUDA
def test_gpu_overlapped_admissions_time_their_stages_on_the_gpu(get_engine: Callable[..., StitchEngine]) -> None:
    """Overlapped, an admission's stitch and prefill are timed by CUDA events (no host wait) and settled at the
    first token: each is the GPU's own time, and the TTFT is the queue (the wait for the running step included)
    plus those stages."""
    engine = get_engine("qwen2", "cuda")
    scheduler = Scheduler(engine, nan_pool(engine, 3000), max_batch=8, cuda_graphs=True, overlap=True)
    tracked = [Tracked(engine, case) for case in MIXED[:3]]
    scheduler.add(tracked[0].request)
    steps(scheduler, 2)  # a step runs while the others are admitted
    for t in tracked[1:]:
        scheduler.add(t.request)
    drain(scheduler)
    for t in tracked:
        timings = t.request.result.timings
        stages = timings.stitch_ms + timings.prefill_ms
        assert timings.prefill_ms > 0 and (timings.stitch_ms > 0) == (t.case.mode == "turbo"), timings
        assert timings.ttft_ms >= t.request.queue_ms + stages - 1e-3 and t.request.queue_ms >= 0
        _assert_greedy_under_eager(engine, t.case, t.request.result.token_ids)


@pytest.mark.gpu
@NEEDS_CUDA
def test_gpu_naive_chunks_through_the_prefill_graphs_follow_eager(get_engine: Callable[..., StitchEngine]) -> None:
    """Long naive prompts prefilled 64 tokens per step through the batched-prefill graphs, beside turbo answers."""
    engine = get_engine("qwen2", "cuda")
    scheduler = Scheduler(engine, nan_pool(engine, 3000), max_batch=8, cuda_graphs=True, prefill_chunk=64)
    assert scheduler.slabs.extend_graphs is not None
    cases = (*MIXED[2:3], Case((50, 30, 70), mode="naive", max_new=9, seed=21), *MIXED[:2])
    tracked = [Tracked(engine, case) for case in cases]
    for t in tracked:
        scheduler.add(t.request)
    drain(scheduler)
    for t in tracked:
        assert t.request.result.finish_reason == "length"
        _assert_greedy_under_eager(engine, t.case, t.request.result.token_ids)


def test_batch_buckets_and_graphs_need_cuda(get_engine: Callable[..., StitchEngine]) -> None:
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 17, 32)] == [1, 2, 4, 8, 32, 32]
    assert batch_bucket(33) is None
    # Decode steps: finer from 8 on, so fewer padding rows reach flash's split heuristic.
    assert [batch_bucket(n, STEP_BUCKETS) for n in (3, 9, 17, 21, 25, 29, 32)] == [4, 12, 20, 24, 28, 32, 32]
    engine = get_engine("qwen2", "cpu")
    with pytest.raises(ValueError, match="CUDA"):
        BatchGraphs(BatchDecoder(engine.forward, nan_pool(engine, 100)))


@pytest.mark.gpu
@NEEDS_CUDA
@pytest.mark.parametrize("attention", ["auto", SDPA_GATHER])
def test_gpu_graph_step_matches_the_eager_step(get_engine: Callable[..., StitchEngine], attention: str) -> None:
    """Two pools with the same contents: one decoded through the graphs (3 rows padded to 4, then 1 row), the
    other eagerly, both fed the eager step's tokens."""
    engine = get_engine("qwen2", "cuda")
    graphed_pool = nan_pool(engine, 1200)
    rows = _stitched_rows(engine, graphed_pool, MIXED[:2] + MIXED[4:5], extra=12)
    eager_pool = nan_pool(engine, 1200)
    eager_pool.data.copy_(graphed_pool.data)
    graphs = BatchGraphs(BatchDecoder(engine.forward, graphed_pool, attention))
    eager = BatchDecoder(engine.forward, eager_pool, attention)
    tokens = [r[3] for r in rows]
    lengths = [r[1].length for r in rows]
    positions = [r[1].next_position for r in rows]
    for step in range(10):
        live = 3 if step < 5 else 1
        spans = [(rows[i][2], lengths[i] + 1) for i in range(live)]
        replayed = graphs.step(tokens[:live], positions[:live], spans).clone()
        expected = eager.step(DecodeRows.build(tokens[:live], positions[:live], spans, engine.spec.device))
        diff = float((replayed - expected).abs().max())
        assert diff <= BF16_TOLERANCE, f"step {step}: |graph - eager| = {diff:.4f}"
        for i in range(live):
            tokens[i], lengths[i], positions[i] = int(torch.argmax(expected[i])), lengths[i] + 1, positions[i] + 1
    graphs.close()
    assert graphed_pool.used_slots == sum(r[1].capacity for r in rows)


def test_a_failing_text_consumer_is_treated_as_a_disconnect(get_engine: Callable[..., StitchEngine]) -> None:
    engine = get_engine("qwen2", "cpu")
    scheduler = Scheduler(engine, nan_pool(engine, 1000))
    good = Tracked(engine, MIXED[0])

    def closed(_: str) -> None:
        raise BrokenPipeError("the client went away")

    gone = BatchRequest(Case((20,), max_new=30).prompt(engine), SamplingParams(max_new_tokens=30, ignore_eos=True))
    gone.on_text = closed
    for request in (good.request, gone):
        scheduler.add(request)
    drain(scheduler)
    assert gone.result.finish_reason == "cancelled" and len(gone.result.token_ids) < 30
    good.assert_matches(run_alone(engine, MIXED[0]))
    assert scheduler.pool.used_slots == 0


def test_a_failing_step_ends_its_batch_and_the_loop_goes_on(
    get_engine: Callable[..., StitchEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = get_engine("llama", "cpu")
    scheduler = Scheduler(engine, nan_pool(engine, 1000))
    doomed = [Tracked(engine, case) for case in MIXED[:2]]
    for t in doomed:
        scheduler.add(t.request)
    scheduler.step()
    real_step = scheduler.decoder.step

    def broken(rows: DecodeRows, width: int | None = None) -> torch.Tensor:
        raise RuntimeError("device error")

    monkeypatch.setattr(scheduler.decoder, "step", broken)
    finished = scheduler.step()
    assert {id(r) for r in finished} == {id(t.request) for t in doomed}
    assert all(t.request.result.finish_reason == "error" for t in doomed) and scheduler.pool.used_slots == 0
    monkeypatch.setattr(scheduler.decoder, "step", real_step)
    later = Tracked(engine, MIXED[2])
    scheduler.add(later.request)
    drain(scheduler)
    later.assert_matches(run_alone(engine, MIXED[2]))


def test_a_chunked_naive_prefill_interleaves_with_decoding_and_equals_alone(
    get_engine: Callable[..., StitchEngine], arch: str
) -> None:
    """A long naive prompt is prefilled 16 tokens per step while a running answer keeps decoding; both give
    their tokens alone (chunked causal prefill = one-shot prefill, to float rounding)."""
    engine = get_engine(arch, "cpu")
    scheduler = Scheduler(engine, nan_pool(engine, 2000), max_batch=8, prefill_chunk=16)
    running = Tracked(engine, Case((20,), max_new=30, seed=11))
    naive = Tracked(engine, Case((60, 40, 20), mode="naive", max_new=8, seed=12))
    scheduler.add(running.request)
    scheduler.step()
    scheduler.add(naive.request)
    scheduler.step()
    chunks = -(-len(naive.request.prompt.joined()) // 16)
    assert naive.request in scheduler.prefilling and chunks > 4
    before = len(running.request.result.token_ids)
    steps(scheduler, chunks - 2)
    assert naive.request in scheduler.prefilling  # still prefilling...
    assert len(running.request.result.token_ids) == before + chunks - 2  # ...while the other decodes every step
    drain(scheduler)
    running.assert_matches(run_alone(engine, running.case))
    naive.assert_matches(run_alone(engine, naive.case))
    assert scheduler.pool.used_slots == 0 and not scheduler.has_work()


def test_overlapped_a_question_admitted_beside_a_chunked_prefill_has_its_first_token_before_the_chunk(
    get_engine: Callable[..., StitchEngine],
) -> None:
    """A naive chunk is timed synchronously; overlapped, what is queued before it (the admitted question's
    first token) is read first, so that token goes out before the chunk runs rather than after it."""
    engine = get_engine("qwen2", "cpu")
    scheduler = Scheduler(engine, nan_pool(engine, 2000), max_batch=8, prefill_chunk=16, overlap=True)
    naive = Tracked(engine, Case((60, 40, 20), mode="naive", max_new=4, seed=13))
    question = Tracked(engine, Case((20,), max_new=6, seed=14))
    seen = tokens_at_each_extend(scheduler, question)  # the question's tokens on the host when each chunk runs
    scheduler.add(naive.request)
    steps(scheduler, 2)
    assert naive.request in scheduler.prefilling and seen == [0, 0]
    scheduler.add(question.request)
    scheduler.step()
    assert seen == [0, 0, 1]  # admitted in this step, its first token read before this step's chunk
    drain(scheduler)
    question.assert_matches(run_alone(engine, question.case))
    naive.assert_matches(run_alone(engine, naive.case))


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_naive_chunks_share_one_budget_per_step_in_one_forward_and_equal_alone(
    get_engine: Callable[..., StitchEngine], arch: str
) -> None:
    """Two long naive prompts: each step prefills `prefill_chunk` tokens in all, oldest first, the first's tail and
    the second's head in one batched forward; both finish their prompts in ceil(total / chunk) steps and give their
    tokens alone. With the batched prefill off, one chunk of the oldest per step (as before)."""
    engine = get_engine(arch, "cpu")
    cases = (Case((60, 40, 20), mode="naive", max_new=8, seed=12), Case((50, 30), mode="naive", max_new=6, seed=13))
    lengths = [len(c.prompt(engine).joined()) for c in cases]
    for minimum, steps_needed in ((2, -(-sum(lengths) // 16)), (0, sum(-(-n // 16) for n in lengths))):
        scheduler = Scheduler(engine, nan_pool(engine, 2000), prefill_chunk=16, batch_prefill_min=minimum)
        tracked = [Tracked(engine, case) for case in cases]
        for t in tracked:
            scheduler.add(t.request)
        scheduler.step()  # both admitted; the first chunk (the oldest's first 16 tokens)
        steps(scheduler, -(-lengths[0] // 16) - 1)  # the oldest's prompt is in after this step...
        filled = [t.request.buffer.length for t in tracked if t.request.kv is not None]
        if minimum:
            assert filled[0] == lengths[0] + 1 and 0 < filled[1] < lengths[1]  # ...and the second began beside it
        taken = -(-lengths[0] // 16)
        while scheduler.prefilling:
            scheduler.step()
            taken += 1
        assert taken == steps_needed, minimum
        drain(scheduler)
        for t in tracked:
            t.assert_matches(run_alone(engine, t.case))
        assert scheduler.pool.used_slots == 0


def test_a_cancelled_chunked_prefill_frees_its_slab(get_engine: Callable[..., StitchEngine]) -> None:
    engine = get_engine("qwen2", "cpu")
    scheduler = Scheduler(engine, nan_pool(engine, 2000), prefill_chunk=16)
    naive = Tracked(engine, Case((60, 40, 20), mode="naive", max_new=8, seed=12))
    scheduler.add(naive.request)
    steps(scheduler, 2)
    assert naive.request in scheduler.prefilling and scheduler.pool.used_slots > 0
    scheduler.cancel(naive.request)
    scheduler.step()
    assert naive.request.result.finish_reason == "cancelled" and naive.request.result.token_ids == []
    assert scheduler.pool.used_slots == 0 and not scheduler.has_work()


# ---- questions admitted together: one batched prefill ------------------------------------------------------

TOGETHER = (
    Case((20, 14, 30), max_new=6, seed=40, question=9),
    Case((8,), positions="composite", max_new=5, seed=41, question=23),
    Case((33, 5), max_new=7, seed=42, question=1),
    Case((12, 12), mode="naive", max_new=4, seed=43),  # naive: prefilled alone in the same step
)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_questions_admitted_together_are_prefilled_in_one_forward_and_match_alone(
    get_engine: Callable[..., StitchEngine], arch: str
) -> None:
    engine = get_engine(arch, "cpu")
    scheduler = Scheduler(engine, nan_pool(engine, 2000), batch_prefill_min=2)
    tracked = [Tracked(engine, case) for case in TOGETHER]
    for t in tracked:
        scheduler.add(t.request)
    scheduler.step()
    assert scheduler.prefilled_together == 3  # the three turbo questions, different contexts and lengths
    assert len(scheduler.running) == 4
    drain(scheduler)
    for t in tracked:
        t.assert_matches(run_alone(engine, t.case))
    assert scheduler.pool.used_slots == 0


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("with_decode", [True, False])
def test_questions_arriving_while_answers_run_are_prefilled_in_the_decode_steps_forward_and_match_alone(
    get_engine: Callable[..., StitchEngine], arch: str, with_decode: bool
) -> None:
    engine = get_engine(arch, "cpu")
    scheduler = Scheduler(engine, nan_pool(engine, 3000), batch_prefill_min=3, prefill_with_decode=with_decode)
    tracked = [Tracked(engine, case) for case in MIXED]
    scheduler.add(tracked[0].request)
    scheduler.step()  # nothing runs yet: prefilled alone, then its first decode step
    assert scheduler.prefilled_with_decode == 0 and len(tracked[0].request.result.token_ids) == 2
    scheduler.add(tracked[1].request)  # one turbo question, below the batched prefill's minimum of three
    scheduler.step()
    assert scheduler.prefilled_with_decode == (1 if with_decode else 0)
    assert len(tracked[0].request.result.token_ids) == 3  # the running answer decoded in the same step
    assert len(tracked[1].request.result.token_ids) == (1 if with_decode else 2)
    for t in tracked[2:]:  # a naive prompt, a question without context, more turbo ones: joining mid-stream
        scheduler.add(t.request)
    drain(scheduler)
    assert scheduler.prefilled_with_decode == (3 if with_decode else 0)  # MIXED holds four turbo cases
    for t in tracked:
        t.assert_matches(run_alone(engine, t.case))
    assert scheduler.pool.used_slots == 0


def test_batched_prefill_can_be_switched_off_or_needs_its_minimum(get_engine: Callable[..., StitchEngine]) -> None:
    engine = get_engine("qwen2", "cpu")
    for minimum, together in ((0, 0), (4, 0), (3, 3)):
        scheduler = Scheduler(engine, nan_pool(engine, 2000), batch_prefill_min=minimum)
        tracked = [Tracked(engine, case) for case in TOGETHER]
        for t in tracked:
            scheduler.add(t.request)
        drain(scheduler)
        assert scheduler.prefilled_together == together, minimum
        tracked[0].assert_matches(run_alone(engine, tracked[0].case))


def test_extend_rows_refuse_empty_requests_and_the_probe_agrees_with_itself(
    get_engine: Callable[..., StitchEngine],
) -> None:
    engine = get_engine("qwen2", "cpu")
    with pytest.raises(ValueError, match="at least one"):
        ExtendRows.build([], engine.spec.device)
    with pytest.raises(ValueError, match="at least one"):
        ExtendRows.build([([1], 0, 0, 0), ([], 0, 10, 0)], engine.spec.device)
    rows = ExtendRows.build([([5, 6], 7, 100, 3), ([8], 2, 0, 0)], engine.spec.device)
    assert rows.slots.tolist() == [103, 104, 0] and rows.positions.tolist() == [7, 8, 2]
    assert rows.cu_q.tolist() == [0, 2, 3] and rows.last.tolist() == [1, 2] and rows.used.tolist() == [5, 1]
    assert probe_extend(engine.spec, LOOP) == 0.0


@NEEDS_CUDA
@pytest.mark.gpu
def test_flash_extend_agrees_with_the_loop_on_a_poisoned_pool(get_engine: Callable[..., StitchEngine]) -> None:
    engine = get_engine("qwen2", "cuda")
    assert engine.spec.dtype == torch.bfloat16
    diff = probe_extend(engine.spec, "flash_varlen")
    assert diff <= 2e-2, f"flash varlen extend differs from the loop by {diff}"


# ---- the batched prefill captured in CUDA graphs: padded layouts ----------------------------------------------


def test_extend_layout_pads_rows_and_tokens_into_the_scratch_slab() -> None:
    flat, spans = extend_layout([([5, 6], 7, 100, 3), ([8], 2, 0, 0)], rows=4, tokens=8, scratch=500)
    ids, positions, slots = flat[0:8], flat[8:16], flat[16:24]
    starts, used, last, cu = flat[24:29], flat[29:34], flat[34:39], flat[39:]
    assert ids == [5, 6, 8, 0, 0, 0, 0, 0]
    assert positions == [7, 8, 2, 0, 1, 2, 3, 4]  # the padding row counts from 0 in its own slab
    assert slots == [103, 104, 0, 500, 501, 502, 503, 504]
    assert starts == [100, 0, 500, 500, 500] and used == [5, 1, 1, 1, 5]
    assert cu == [0, 2, 3, 3, 3, 8] and last == [1, 2, 2, 2, 7]
    assert spans == ((100, 5, 2), (0, 1, 1), (500, 1, 0), (500, 1, 0), (500, 5, 5))
    full, full_spans = extend_layout([([1, 2, 3], 0, 10, 0)], rows=1, tokens=3, scratch=50)
    assert full[-2:] == [3, 3] and full_spans[-1] == (50, 1, 0)  # no padding: an empty padding row
    for requests, rows, tokens in (([([1], 0, 0, 0)] * 3, 2, 8), ([([1] * 9, 0, 0, 0)], 1, 8), ([], 1, 8)):
        with pytest.raises(ValueError, match="do not fit"):
            extend_layout(requests, rows, tokens, 0)
    assert [token_bucket(n) for n in (1, 64, 65, 4096)] == [64, 64, 128, 4096] and token_bucket(4097) is None
    assert token_bucket(300, (64, 256)) is None


def test_a_group_longer_than_the_largest_bucket_is_split_in_order_with_requests_kept_whole() -> None:
    requests = [([1] * n, 0, 0, 0) for n in (100, 200, 50, 700, 10)]
    parts = split_by_tokens(requests, 300)
    assert [[len(r[0]) for r in part] for part in parts] == [[100, 200], [50], [700], [10]]
    many = split_by_tokens([([1], 0, 0, 0)] * 70, 4096)
    assert [len(part) for part in many] == [32, 32, 6]  # no part beyond the largest row bucket


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_a_padded_extend_equals_the_unpadded_one_and_writes_only_its_slots(
    get_engine: Callable[..., StitchEngine], arch: str
) -> None:
    """The layout a graph replays, run eagerly through the loop attention: the real rows' logits and K/V are the
    unpadded extend's exactly, and padding touches the scratch slab alone (every other slot keeps its NaN)."""
    engine = get_engine(arch, "cpu")
    pool = nan_pool(engine, 1500)
    stitched = _stitched_rows(engine, pool, TOGETHER[:3], extra=30)
    scratch = pool.allocate(64)
    requests = [([3, 9, 4][: i + 1], r[1].next_position, r[2], r[1].length) for i, r in enumerate(stitched)]
    decoder = BatchDecoder(engine.forward, pool)
    before = pool.data.clone()
    flat, spans = extend_layout(requests, rows=4, tokens=64, scratch=scratch.start)
    padded = decoder.extend(ExtendRows.from_flat(torch.tensor(flat), 5, 64, spans))
    after_padded = pool.data.clone()
    pool.data.copy_(before)
    plain = decoder.extend(ExtendRows.build(requests, engine.spec.device))
    # fp32 rounding only: a matmul over 64 rows may block differently from one over 6.
    assert float((padded[:3] - plain).abs().max()) <= 1e-5
    outside = torch.ones(pool.slots, dtype=torch.bool)
    outside[scratch.start : scratch.end] = False
    got, want = after_padded[:, :, :, outside], pool.data[:, :, :, outside]
    assert torch.equal(got.isnan(), want.isnan()), "padding wrote outside the scratch slab"
    assert float((got.nan_to_num(0.0) - want.nan_to_num(0.0)).abs().max()) <= 1e-5
    pad = 64 - sum(len(ids) for ids, *_ in requests)
    assert not after_padded[:, :, :, scratch.start : scratch.start + pad].isnan().any()  # the padding's own K/V
    assert after_padded[:, :, :, scratch.start + pad : scratch.end].isnan().all()


@pytest.mark.gpu
@NEEDS_CUDA
def test_gpu_extend_graphs_match_the_eager_extend(get_engine: Callable[..., StitchEngine]) -> None:
    """Two pools with the same contents: three questions prefilled through a graph (3 rows padded to 4, their
    tokens to 64), the same eagerly; then one question alone through its own bucket."""
    engine = get_engine("qwen2", "cuda")
    graphed_pool = nan_pool(engine, 3000)
    rows = _stitched_rows(engine, graphed_pool, TOGETHER[:3], extra=400)
    eager_pool = nan_pool(engine, 3000)
    eager_pool.data.copy_(graphed_pool.data)
    graphs = ExtendGraphs(BatchDecoder(engine.forward, graphed_pool))
    assert graphs.buckets[-1] == 512  # a quarter of the pool at most
    eager = BatchDecoder(engine.forward, eager_pool)
    questions = ([3, 9, 4, 4, 1], [7], [2, 2, 8, 5, 6, 1, 1, 9, 9, 3])
    for group in (rows, rows[1:2]):
        requests = [(questions[i], r[1].next_position, r[2], r[1].length) for i, r in enumerate(group)]
        replayed = graphs.extend(requests).clone()
        expected = eager.extend(ExtendRows.build(requests, engine.spec.device))
        diff = float((replayed - expected).abs().max())
        assert diff <= BF16_TOLERANCE, f"{len(group)} rows: |graph - eager| = {diff:.4f}"
    # Two long questions (600 tokens > the 512 bucket): two replays, one per request, logits joined in order.
    long_questions = [[(7 * i + j) % 50 + 1 for j in range(300)] for i in range(2)]
    requests = [(long_questions[i], r[1].next_position, r[2], r[1].length) for i, r in enumerate(rows[:2])]
    replayed = graphs.extend(requests)
    expected = eager.extend(ExtendRows.build(requests, engine.spec.device))
    assert replayed.shape == expected.shape and float((replayed - expected).abs().max()) <= BF16_TOLERANCE
    # The slabs' K/V (context + the questions written over each other) agree between the two pools.
    for _, buffer, start, _ in rows:
        span = slice(start, start + buffer.length + 300)
        graphed, eager_kv = graphed_pool.data[:, :, :, span].float(), eager_pool.data[:, :, :, span].float()
        assert torch.equal(graphed.isnan(), eager_kv.isnan())  # the same slots written (the rest keep their NaN)
        assert float((graphed.nan_to_num(0.0) - eager_kv.nan_to_num(0.0)).abs().max()) <= 0.1
    assert set(graphs._graphs) == {(4, 64), (1, 64), (1, 512)}
    graphs.close()
