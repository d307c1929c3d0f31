"""The scheduler's low-priority lane (`BatchRequest.shadow`) and the kept first-token logits it compares.

A shadow is admitted only while no other request waits and the batch has room; when the head of the line cannot
be admitted (batch full, or no slab in the pool), every admitted shadow is preempted, so a request never waits
for a shadow longer than the step already launched. Kept first-token logits are checked against the HF model's
own forward (`reference.py`), not against the path that produced them.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from service.engine.batch_request import BatchRequest, RequestStatus
from service.engine.engine import StitchEngine
from service.engine.gate import BF16_TOLERANCE, synthetic_ids
from service.engine.kv_pool import KVPool
from service.engine.prompt import PromptIds
from service.engine.reference import prompt_reference_logits, reference_logits
from service.engine.sampling import SamplingParams
from service.engine.scheduler import Scheduler
from service.engine.scheduler_config import BatchingOptions, build_scheduler, release, scratch_slots

OVERLAP = pytest.mark.parametrize("overlap", [False, True], ids=["read-each-step", "overlapped"])
MAX_STEPS = 400


def prompt(engine: StitchEngine, chunks: tuple[int, ...], seed: int) -> PromptIds:
    ids = synthetic_ids(engine, chunks, seed=seed)
    return engine.template.prompt(ids, synthetic_ids(engine, (9,), seed=1000 + seed)[0])


def request(
    engine: StitchEngine,
    seed: int,
    chunks: tuple[int, ...] = (30, 20),
    mode: str = "turbo",
    max_new: int = 6,
    shadow: bool = False,
    keep: bool = False,
    ended: list[BatchRequest] | None = None,
) -> BatchRequest:
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    on_finish = ended.append if ended is not None else None
    return BatchRequest(
        prompt(engine, chunks, seed), params, mode, on_finish=on_finish, shadow=shadow, keep_first_logits=keep
    )


def pool(engine: StitchEngine, slots: int) -> KVPool:
    return KVPool(engine.spec, slots * engine.spec.kv_bytes_per_token(), poison="nan")


def step_until(scheduler: Scheduler, done: Callable[[], bool]) -> int:
    """Steps until `done()`; how many it took."""
    for steps in range(1, MAX_STEPS + 1):
        scheduler.step()
        if done():
            return steps
    raise AssertionError(f"not done after {MAX_STEPS} steps")


def admitted(r: BatchRequest) -> bool:
    return r.status is not RequestStatus.WAITING


@OVERLAP
def test_a_request_added_after_shadows_is_admitted_before_them(
    get_engine: Callable[..., StitchEngine], overlap: bool
) -> None:
    engine = get_engine("qwen2", "cpu")
    ended: list[BatchRequest] = []
    shadows = [request(engine, 1 + i, mode="naive", shadow=True, ended=ended) for i in range(2)]
    real = request(engine, 5, ended=ended)
    scheduler = Scheduler(engine, pool(engine, 1000), max_batch=1, overlap=overlap)
    for r in [*shadows, real]:
        scheduler.add(r)

    scheduler.step()

    assert admitted(real) and not any(admitted(s) for s in shadows)
    assert list(scheduler.planner.shadows) == shadows and not scheduler.waiting
    scheduler.run_until_idle()
    assert ended == [real, *shadows]  # one row: each shadow ran after the request, in its lane's order
    assert all(r.result.finish_reason == "length" and len(r.result.token_ids) == 6 for r in ended)


@OVERLAP
def test_a_shadow_is_admitted_only_while_no_request_waits(
    get_engine: Callable[..., StitchEngine], overlap: bool
) -> None:
    engine = get_engine("qwen2", "cpu")
    shadow = request(engine, 10, mode="naive", shadow=True, max_new=4)
    reals = [request(engine, 11 + i, max_new=3 + 2 * i) for i in range(4)]
    scheduler = Scheduler(engine, pool(engine, 2000), max_batch=2, overlap=overlap)
    scheduler.add(shadow)
    for r in reals:
        scheduler.add(r)

    while scheduler.has_work():
        scheduler.step()
        if admitted(shadow):
            assert all(admitted(r) for r in reals)  # it never took a row a waiting request could have had
            assert shadow.result.finish_reason != "preempted"

    assert shadow.result.finish_reason == "length" and len(shadow.result.token_ids) == 4


@OVERLAP
@pytest.mark.parametrize("blocked_by", ["batch", "pool"])
def test_a_running_shadow_is_preempted_for_a_request_that_waits(
    get_engine: Callable[..., StitchEngine], overlap: bool, blocked_by: str
) -> None:
    """Blocked by the batch: one row; by the pool: room for one answer's slab only. Either way the request is
    admitted at most one step later (the step already launched, where steps overlap) and answers as alone."""
    engine = get_engine("qwen2", "cpu")
    alone = request(engine, 21)
    single = Scheduler(engine, pool(engine, alone.tokens_needed), max_batch=1)
    single.add(alone)
    single.run_until_idle()
    shadow = request(engine, 20, mode="naive", shadow=True, max_new=40)
    real = request(engine, 21)
    slots = max(shadow.tokens_needed, real.tokens_needed) + 8
    max_batch = 1 if blocked_by == "batch" else 8
    scheduler = Scheduler(engine, pool(engine, slots), max_batch=max_batch, overlap=overlap)
    scheduler.add(shadow)
    step_until(scheduler, lambda: len(shadow.result.token_ids) >= 2)

    scheduler.add(real)
    steps = step_until(scheduler, lambda: admitted(real))

    assert steps <= (2 if overlap else 1)
    assert shadow.result.finish_reason == "preempted" and shadow.slab is None
    assert not scheduler.planner.shadows  # not run again
    scheduler.run_until_idle()
    assert real.result.token_ids == alone.result.token_ids and real.result.finish_reason == "length"


def test_a_shadow_waits_behind_a_request_the_pool_cannot_hold_yet(get_engine: Callable[..., StitchEngine]) -> None:
    """A request blocked at the head of the line blocks the shadows' lane too, even where a shadow would fit."""
    engine = get_engine("qwen2", "cpu")
    running, big = request(engine, 30, chunks=(60,), max_new=8), request(engine, 31, chunks=(60, 60), max_new=4)
    shadow = request(engine, 32, chunks=(8,), mode="naive", shadow=True, max_new=2)
    slots = max(big.tokens_needed, running.tokens_needed + shadow.tokens_needed)
    assert running.tokens_needed + big.tokens_needed > slots  # `big` fits only once `running` ended
    scheduler = Scheduler(engine, pool(engine, slots), max_batch=8)
    scheduler.add(running)
    scheduler.step()
    scheduler.add(big)
    scheduler.add(shadow)

    while scheduler.has_work():
        scheduler.step()
        if admitted(shadow):
            assert admitted(big)

    assert big.result.finish_reason == shadow.result.finish_reason == "length"


def test_naive_chunks_of_requests_go_before_a_shadows(get_engine: Callable[..., StitchEngine]) -> None:
    engine = get_engine("qwen2", "cpu")
    shadow = request(engine, 40, chunks=(60, 50), mode="naive", shadow=True, max_new=2)
    real = request(engine, 41, chunks=(60, 50), mode="naive", max_new=2)
    scheduler = Scheduler(engine, pool(engine, 1000), max_batch=4, prefill_chunk=16)
    scheduler.add(shadow)
    scheduler.step()
    assert shadow.buffer.length == 16

    scheduler.add(real)
    scheduler.step()

    assert (real.buffer.length, shadow.buffer.length) == (16, 16)  # the budget went to the request
    scheduler.run_until_idle()
    assert real.result.finish_reason == shadow.result.finish_reason == "length"


def naive_first_logits(engine: StitchEngine, p: PromptIds) -> torch.Tensor:
    ids = list(p.joined())
    causal = torch.ones(len(ids), len(ids), dtype=torch.bool).tril()
    return reference_logits(engine.model, ids, torch.arange(len(ids)), causal)[-1]


@OVERLAP
@pytest.mark.parametrize("path", ["alone", "batched-prefill", "in-decode-step"])
def test_kept_first_logits_are_the_first_tokens_logits(
    get_engine: Callable[..., StitchEngine], overlap: bool, path: str
) -> None:
    """Each way a first token comes: a question prefilled alone, questions prefilled in one batched forward, and
    questions prefilled inside the running answers' decode step; a naive prompt by chunks."""
    engine = get_engine("qwen2", "cpu")
    turbo = [request(engine, 50 + i, keep=True) for i in range(1 if path == "alone" else 2)]
    naive = request(engine, 60, mode="naive", keep=True)
    other = request(engine, 61, max_new=12)  # keeps none
    scheduler = Scheduler(
        engine,
        pool(engine, 2000),
        max_batch=8,
        prefill_chunk=32,
        batch_prefill_min=2,
        prefill_with_decode=path == "in-decode-step",
        overlap=overlap,
    )
    scheduler.add(other)
    scheduler.step()  # answers run: the questions admitted next may ride in their step
    for r in turbo:
        scheduler.add(r)
    scheduler.step()
    scheduler.add(naive)  # after: a naive prompt going in by chunks keeps questions out of the decode step

    scheduler.run_until_idle()

    assert scheduler.prefilled_with_decode == (2 if path == "in-decode-step" else 0)
    assert scheduler.prefilled_together == (0 if path == "alone" else 2)
    assert other.first_logits is None
    for r, mode in [*((t, "turbo") for t in turbo), (naive, "naive")]:
        kept = r.first_logits
        assert kept is not None and kept.dtype == torch.float32 and kept.device.type == "cpu"
        expected = (
            prompt_reference_logits(engine.model, r.prompt, "reordered")[-1]
            if mode == "turbo"
            else naive_first_logits(engine, r.prompt)
        )
        torch.testing.assert_close(kept, expected, atol=1e-4, rtol=1e-4)
        assert kept[r.result.token_ids[0]] == kept.max()  # the logits the token was picked from (ties aside)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_kept_first_logits_on_cuda_land_on_the_host_as_served(get_engine: Callable[..., StitchEngine]) -> None:
    """As served on CUDA (graphs, overlapped steps, batched and mixed prefills): the copy queued without waiting
    has landed by the request's end, in pinned host memory, and holds the logits its token was picked from."""
    engine = get_engine("qwen2", "cuda")
    served_pool = KVPool(engine.spec, (4000 + scratch_slots(engine)) * engine.spec.kv_bytes_per_token())
    scheduler = build_scheduler(engine, served_pool, BatchingOptions())
    other = request(engine, 70, max_new=16)
    alone, batched = [request(engine, 71, keep=True)], [request(engine, 72 + i, keep=True) for i in range(3)]
    riding = [request(engine, 75 + i, keep=True) for i in range(2)]
    naive = request(engine, 77, mode="naive", keep=True)
    for group in ([other, *alone], batched, riding, [naive]):
        for r in group:
            scheduler.add(r)
        scheduler.step()

    scheduler.run_until_idle()

    for r in [*alone, *batched, *riding, naive]:
        kept = r.first_logits
        assert kept is not None and kept.device.type == "cpu" and kept.is_pinned() and kept.dtype == torch.float32
        expected = (
            naive_first_logits(engine, r.prompt).cpu()
            if r.mode.value == "naive"
            else prompt_reference_logits(engine.model, r.prompt, "reordered")[-1].cpu()
        )
        assert float((kept - expected).abs().max()) <= BF16_TOLERANCE
        assert kept[r.result.token_ids[0]] == kept.max()
    release(scheduler)
