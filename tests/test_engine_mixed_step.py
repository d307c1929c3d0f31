"""Questions piggybacked on the running answers' decode step (`BatchDecoder.mixed`, `MixedGraphs`).

CPU: the mixed forward is the decode step and the extend run apart, to fp32 rounding, and writes exactly their
slots of a NaN-poisoned pool; through the scheduler (overlapped or not) every request's tokens are its tokens
alone. GPU (bf16, marked `gpu`): a captured mixed step (fed from unread picks) equals the eager one, and the
scheduler with graphs and the overlap follows eager greedy decoding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch

from service.engine.batch_decode import BatchDecoder, DecodeRows, ExtendRows, StepFeed
from service.engine.batch_request import BatchRequest
from service.engine.engine import StitchEngine
from service.engine.gate import BF16_TOLERANCE
from service.engine.kv_pool import KVPool
from service.engine.mixed_graph import MixedGraphs
from service.engine.scheduler import Scheduler
from tests.test_engine_batch import (
    MIXED,
    NEEDS_CUDA,
    TOGETHER,
    Case,
    Tracked,
    _assert_greedy_under_eager,
    _stitched_rows,
    drain,
    nan_pool,
    run_alone,
    steps,
    tokens_at_each_extend,
)

OVERLAP = pytest.mark.parametrize("overlap", [False, True], ids=["read-each-step", "overlapped"])
QUESTIONS = ([3, 9, 4, 4, 1], [7, 2, 8])


def _step_and_questions(
    engine: StitchEngine, pool: KVPool
) -> tuple[tuple[list[int], list[int], list[tuple[int, int]]], list[tuple[list[int], int, int, int]]]:
    """Three stitched requests each feeding one token, and two more with a question each, in `pool`."""
    rows = _stitched_rows(engine, pool, MIXED[:2] + MIXED[4:5] + TOGETHER[:2], extra=20)
    decode = rows[:3]
    ids = [token for *_, token in decode]
    positions = [buffer.next_position for _, buffer, _, _ in decode]
    spans = [(start, buffer.length + 1) for _, buffer, start, _ in decode]
    questions = [(QUESTIONS[i], r[1].next_position, r[2], r[1].length) for i, r in enumerate(rows[3:])]
    return (ids, positions, spans), questions


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_a_mixed_step_is_the_decode_step_and_the_extend_and_writes_only_their_slots(
    get_engine: Callable[..., StitchEngine], arch: str
) -> None:
    engine = get_engine(arch, "cpu")
    pool = nan_pool(engine, 2000)
    decoder = BatchDecoder(engine.forward, pool)
    (ids, positions, spans), questions = _step_and_questions(engine, pool)
    device = engine.spec.device
    before = pool.data.clone()
    mixed = decoder.mixed(DecodeRows.build(ids, positions, spans, device), ExtendRows.build(questions, device))
    after_mixed = pool.data.clone()
    pool.data.copy_(before)
    step = decoder.step(DecodeRows.build(ids, positions, spans, device))
    extend = decoder.extend(ExtendRows.build(questions, device))
    assert mixed.shape == (5, engine.spec.vocab_size)
    # fp32 rounding only: one matmul over 11 rows may block differently from 3 and 8.
    assert float((mixed[:3] - step).abs().max()) <= 1e-5
    assert float((mixed[3:] - extend).abs().max()) <= 1e-5
    assert torch.equal(after_mixed.isnan(), pool.data.isnan()), "the mixed step wrote other slots"
    assert float((after_mixed.nan_to_num(0.0) - pool.data.nan_to_num(0.0)).abs().max()) <= 1e-5
    written = before.isnan() & ~after_mixed.isnan()
    assert int(written[0, 0, 0, :, 0].sum()) == 3 + sum(len(q[0]) for q in questions)  # one per token fed, no more


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@OVERLAP
def test_questions_ride_in_the_decode_step_and_equal_alone(
    get_engine: Callable[..., StitchEngine], arch: str, overlap: bool
) -> None:
    """A question arriving while an answer runs is prefilled in that answer's step; overlapped, the step is
    launched before the previous one is read and the question's first token is read with the step, one step
    later. Requests joining mid-stream (naive, no context, more turbo) all match their runs alone."""
    engine = get_engine(arch, "cpu")
    scheduler = Scheduler(
        engine, nan_pool(engine, 3000), batch_prefill_min=3, prefill_with_decode=True, overlap=overlap
    )
    tracked = [Tracked(engine, case) for case in MIXED]
    scheduler.add(tracked[0].request)
    scheduler.step()  # nothing runs yet: prefilled alone, then its first decode step
    assert scheduler.prefilled_with_decode == 0
    scheduler.add(tracked[1].request)
    scheduler.step()
    assert scheduler.prefilled_with_decode == 1 and scheduler.last_batch == 1
    # Read each step: the step's token and the question's first are here. Overlapped: not yet (read next step).
    assert len(tracked[1].request.result.token_ids) == (0 if overlap else 1)
    scheduler.step()
    assert len(tracked[1].request.result.token_ids) == (1 if overlap else 2)
    timings = tracked[1].request.result.timings
    assert timings.stitch_ms > 0 and timings.prefill_ms > 0 and timings.ttft_ms >= timings.stages_ms
    for t in tracked[2:]:
        scheduler.add(t.request)
    drain(scheduler)
    assert scheduler.prefilled_with_decode == 3  # MIXED holds four turbo cases, the first prefilled alone
    for t in tracked:
        t.assert_matches(run_alone(engine, t.case))
    assert scheduler.pool.used_slots == 0 and not scheduler.has_work()


@pytest.mark.parametrize("logprobs", [None, 1], ids=["overlapped", "read-first"])
def test_questions_are_prefilled_apart_when_every_answer_ends_before_their_step(
    get_engine: Callable[..., StitchEngine], logprobs: int | None
) -> None:
    """Overlapped, the one running answer's last token (by its budget) is still unread when a question is
    admitted beside it: the next step has no row for the answer, so the question has no step to ride in and is
    prefilled on its own, not lost. With log-probabilities the question's step cannot overlap: reading what is
    in flight first ends the answer, with the same outcome."""
    engine = get_engine("qwen2", "cpu")
    scheduler = Scheduler(engine, nan_pool(engine, 3000), batch_prefill_min=3, prefill_with_decode=True, overlap=True)
    answer = Tracked(engine, Case((30, 17), max_new=3, seed=1))
    scheduler.add(answer.request)
    steps(scheduler, 2)  # the answer's third (last) token is in flight
    assert len(answer.request.result.token_ids) == 2 and len(scheduler.running) == 1
    case = Case((5,), max_new=6, seed=2)
    question = BatchRequest(case.prompt(engine), replace(case.params(), logprobs=logprobs), "turbo", "reordered")
    scheduler.add(question)
    scheduler.step()
    assert answer.request.result.finish_reason == "length"
    assert scheduler.prefilled_with_decode == 0 and scheduler.prefilled_together == 1
    drain(scheduler)
    assert question.result.token_ids == run_alone(engine, case).tokens
    assert len(question.result.logprobs) == (len(question.result.token_ids) if logprobs else 0)
    assert scheduler.pool.used_slots == 0


def test_a_question_does_not_ride_in_a_step_behind_a_naive_chunk(get_engine: Callable[..., StitchEngine]) -> None:
    """A naive chunk runs (timed synchronously) before the step: a question admitted then is prefilled apart,
    so its first token is read before the chunk instead of waiting for it in the step."""
    engine = get_engine("qwen2", "cpu")
    scheduler = Scheduler(
        engine,
        nan_pool(engine, 3000),
        max_batch=8,
        prefill_chunk=16,
        batch_prefill_min=3,
        prefill_with_decode=True,
        overlap=True,
    )
    answer = Tracked(engine, Case((30, 17), max_new=30, seed=1))
    naive = Tracked(engine, Case((60, 40, 20), mode="naive", max_new=4, seed=13))
    question = Tracked(engine, Case((20,), max_new=6, seed=14))
    scheduler.add(answer.request)
    steps(scheduler, 2)
    scheduler.add(naive.request)
    scheduler.step()
    assert naive.request in scheduler.prefilling and len(scheduler.running) == 1
    seen = tokens_at_each_extend(scheduler, question)  # the question's tokens on the host when each chunk runs
    scheduler.add(question.request)
    scheduler.step()
    assert seen == [1] and scheduler.prefilled_with_decode == 0
    drain(scheduler)
    for t in (answer, naive, question):
        t.assert_matches(run_alone(engine, t.case))
    assert scheduler.pool.used_slots == 0


@OVERLAP
def test_a_question_that_fails_to_start_ends_alone_and_the_step_goes_on(
    get_engine: Callable[..., StitchEngine], overlap: bool
) -> None:
    """A question whose sampler cannot start (here: made to raise) ends with an error at admission; the step it
    was to ride in runs for the others, whose tokens are their runs alone."""
    engine = get_engine("qwen2", "cpu")
    scheduler = Scheduler(
        engine, nan_pool(engine, 3000), batch_prefill_min=3, prefill_with_decode=True, overlap=overlap
    )
    answer, bad, good = (Tracked(engine, case) for case in (MIXED[0], MIXED[1], MIXED[4]))
    scheduler.add(answer.request)
    steps(scheduler, 2)
    start = scheduler.runner.start_decoding

    def failing_start(request: BatchRequest) -> None:
        if request is bad.request:
            raise RuntimeError("no sampler for this one")
        start(request)

    scheduler.runner.start_decoding = failing_start  # type: ignore[method-assign]
    scheduler.add(bad.request)
    scheduler.add(good.request)
    scheduler.step()
    assert bad.request.result.finish_reason == "error" and bad.request.slab is None
    assert scheduler.prefilled_with_decode == 1  # the good question rode in the step
    drain(scheduler)
    for t in (answer, good):
        t.assert_matches(run_alone(engine, t.case))
    assert scheduler.pool.used_slots == 0


def test_questions_that_no_longer_fit_a_mixed_step_at_launch_are_prefilled_apart(
    get_engine: Callable[..., StitchEngine],
) -> None:
    """Admitted to ride (a mixed step held them then), the questions find at launch that none holds them beside
    the step's rows (requests prefilled alone in the same admission joined them): they are prefilled apart, and
    every request still equals its run alone."""
    engine = get_engine("qwen2", "cpu")
    scheduler = Scheduler(engine, nan_pool(engine, 3000), batch_prefill_min=3, prefill_with_decode=True, overlap=True)
    answer, question = Tracked(engine, MIXED[0]), Tracked(engine, MIXED[4])
    scheduler.add(answer.request)
    steps(scheduler, 2)
    answers: list[bool] = []

    def mixes_at_admission_only(batch: int, questions: Any) -> bool:
        answers.append(not answers)
        return answers[-1]

    scheduler.slabs.mixes = mixes_at_admission_only  # type: ignore[method-assign]
    scheduler.add(question.request)
    scheduler.step()
    assert answers == [True, False]
    assert scheduler.prefilled_with_decode == 0 and scheduler.prefilled_together == 1
    drain(scheduler)
    for t in (answer, question):
        t.assert_matches(run_alone(engine, t.case))
    assert scheduler.pool.used_slots == 0


def test_mixed_graphs_need_cuda(get_engine: Callable[..., StitchEngine]) -> None:
    engine = get_engine("qwen2", "cpu")
    with pytest.raises(ValueError, match="CUDA"):
        MixedGraphs(BatchDecoder(engine.forward, nan_pool(engine, 500)))


# ---- GPU (bf16) -------------------------------------------------------------------------------------------


@pytest.mark.gpu
@NEEDS_CUDA
def test_gpu_mixed_graphs_match_the_eager_mixed_step(get_engine: Callable[..., StitchEngine]) -> None:
    """Two pools with the same contents: three decode rows (two fed from picks on the device) and two
    questions through a graph (3 rows padded to 4, 2 questions of 8 tokens padded to 64), the same eagerly;
    the logits and every slab's K/V agree to bf16 rounding, and the same slots are written."""
    engine = get_engine("qwen2", "cuda")
    graphed_pool = nan_pool(engine, 4000)
    (ids, positions, spans), questions = _step_and_questions(engine, graphed_pool)
    eager_pool = nan_pool(engine, 4000)
    eager_pool.data.copy_(graphed_pool.data)
    held = graphed_pool.used_slots
    graphs = MixedGraphs(BatchDecoder(engine.forward, graphed_pool), max_picks=8)
    assert graphs.fits(3, [5, 3]) and not graphs.fits(3, [1] * 5) and not graphs.fits(33, [5])
    eager = BatchDecoder(engine.forward, eager_pool)
    picks = torch.tensor([ids[2], 11, ids[0]], device="cuda")
    feed = StepFeed(picks, (2, -1, 0))
    host_ids = [0, ids[1], 0]  # rows 0 and 2 must take their ids from the feed
    replayed = graphs.step((host_ids, positions, spans, None), feed, questions).clone()
    device = engine.spec.device
    expected = eager.mixed(DecodeRows.build(ids, positions, spans, device), ExtendRows.build(questions, device))
    diff = float((replayed - expected).abs().max())
    assert replayed.shape == expected.shape and diff <= BF16_TOLERANCE, f"|graph - eager| = {diff:.4f}"
    outside = torch.ones(graphed_pool.slots, dtype=torch.bool)
    outside[graphs._scratch.start : graphs._scratch.end] = False
    graphed, eager_kv = graphed_pool.data[:, :, :, outside].float(), eager_pool.data[:, :, :, outside].float()
    assert torch.equal(graphed.isnan(), eager_kv.isnan())  # no slot outside the scratch written but theirs
    assert float((graphed.nan_to_num(0.0) - eager_kv.nan_to_num(0.0)).abs().max()) <= 0.1
    assert set(graphs._graphs) == {(4, 2, 64, 1024)}
    graphs.close()
    assert graphed_pool.used_slots == held  # the scratch slots went back


@pytest.mark.gpu
@NEEDS_CUDA
@OVERLAP
def test_gpu_questions_in_the_step_follow_eager(get_engine: Callable[..., StitchEngine], overlap: bool) -> None:
    engine = get_engine("qwen2", "cuda")
    scheduler = Scheduler(
        engine,
        nan_pool(engine, 4000),
        max_batch=8,
        cuda_graphs=True,
        batch_prefill_min=3,
        prefill_with_decode=True,
        overlap=overlap,
    )
    assert scheduler.slabs.mixed_graphs is not None
    tracked = [Tracked(engine, case) for case in MIXED]
    scheduler.add(tracked[0].request)
    steps(scheduler, 2)
    for t in tracked[1:]:  # one question a step joins the running answers
        scheduler.add(t.request)
        scheduler.step()
    drain(scheduler)
    assert scheduler.prefilled_with_decode >= 2
    for t in tracked:
        assert t.request.result.finish_reason == "length"
        timings = t.request.result.timings
        assert timings.prefill_ms > 0 and timings.ttft_ms >= t.request.queue_ms + timings.stages_ms - 1e-3
        _assert_greedy_under_eager(engine, t.case, t.request.result.token_ids)
