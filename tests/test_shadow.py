"""Shadow answers (`service/serving/shadow.py`, `shadow_compare.py`): a share of turbo answers answered again naive
after the client's answer, through a real scheduler on the tiny models, compared and counted.

Expected values are computed independently of the shadow path: naive answers through the offline generator
(`offline.generate`), first-token distributions through the HF model's own forward (`reference.py`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest
import torch
from pydantic import ValidationError

from service.engine.batch_request import BatchRequest
from service.engine.engine import StitchEngine
from service.engine.gate import synthetic_ids
from service.engine.kv_pool import KVPool
from service.engine.offline import generate
from service.engine.prompt import PromptIds
from service.engine.recompute_spec import parse_recompute
from service.engine.reference import prompt_reference_logits, reference_logits
from service.engine.sampling import SamplingParams
from service.engine.scheduler import Scheduler
from service.metrics import Metrics
from service.serving.shadow import SHADOW_RETRIES, ShadowPolicy, Shadows
from service.serving.shadow_compare import TurboAnswer, compare, first_token_kl
from service.settings import Settings

ARCH = "qwen2"


def prompt(engine: StitchEngine, seed: int) -> PromptIds:
    ids = synthetic_ids(engine, (30, 24, 18), seed=seed)
    return engine.template.prompt(ids, synthetic_ids(engine, (9,), seed=1000 + seed)[0])


class Served:
    """A scheduler as the engine loop runs it, with shadows submitted into it."""

    def __init__(self, engine: StitchEngine, share: float = 1.0, queue_size: int = 16, max_batch: int = 4) -> None:
        self.engine = engine
        pool = KVPool(engine.spec, 4000 * engine.spec.kv_bytes_per_token(), poison="nan")
        self.scheduler = Scheduler(engine, pool, max_batch=max_batch)
        self.metrics = Metrics()
        self.shadows = Shadows(ShadowPolicy(share, queue_size), self.scheduler.add, self.metrics)

    def answer(
        self, p: PromptIds, recompute: str = "none", temperature: float = 0.0, max_new: int = 6, follow: bool = True
    ) -> BatchRequest:
        """A turbo answer run to its end, then (picked) its shadow handed over, as `AnswerSession` does."""
        params = SamplingParams(max_new_tokens=max_new, temperature=temperature, seed=7 if temperature else None)
        request = BatchRequest(p, params, "turbo", recompute=parse_recompute(recompute))
        picked = self.shadows.pick(request)
        self.scheduler.add(request)
        self.scheduler.run_until_idle()
        if picked and follow:
            self.shadows.follow(request)
        return request

    def agreement(self, kind: str, outcome: str, recompute: str = "none") -> float:
        labels = {"positions": "reordered", "recompute": recompute, "kind": kind, "outcome": outcome}
        return self.metrics.registry.get_sample_value("kvstitch_shadow_agreement_total", labels) or 0.0

    def kl(self, suffix: str, recompute: str = "none") -> float:
        labels = {"positions": "reordered", "recompute": recompute, "kind": "first_token"}
        return self.metrics.registry.get_sample_value(f"kvstitch_shadow_kl_{suffix}", labels) or 0.0

    def outcome(self, outcome: str) -> float:
        return self.metrics.registry.get_sample_value("kvstitch_shadow_answers_total", {"outcome": outcome}) or 0.0


@pytest.fixture
def engine(get_engine: Callable[..., StitchEngine]) -> StitchEngine:
    return get_engine(ARCH, "cpu")


# ---- the comparison ------------------------------------------------------------------------------------------


def test_kl_is_zero_for_equal_logits_and_the_closed_form_otherwise() -> None:
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    naive, turbo = torch.tensor([0.5, 0.5]).log(), torch.tensor([0.9, 0.1]).log()

    assert first_token_kl(logits, logits.clone()) == 0.0
    assert first_token_kl(naive, turbo) == pytest.approx(0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1))
    assert first_token_kl(naive + 3.0, turbo - 1.0) == pytest.approx(first_token_kl(naive, turbo))  # a shift: none
    with pytest.raises(ValueError, match="shapes"):
        first_token_kl(naive, torch.zeros(3))


def test_greedy_answers_compare_tokens_and_sampled_ones_their_first_token_distribution() -> None:
    turbo_logits = torch.tensor([0.0, 2.0, 1.0])
    naive_logits = torch.tensor([0.0, 1.0, 2.0])

    greedy = compare(TurboAnswer((4, 5, 6), greedy=True), [4, 5, 7], None)
    sampled = compare(TurboAnswer((2, 9), greedy=False, first_logits=turbo_logits), [2, 3], naive_logits)
    unkept = compare(TurboAnswer((2, 9), greedy=False), [2, 3], naive_logits)

    assert (greedy.first_token, greedy.answer, greedy.kl) == (True, False, None)
    # Sampled: turbo's likeliest first token (1) against naive's greedy one (2), whatever turbo drew (2).
    assert (sampled.first_token, sampled.answer) == (False, None)
    assert sampled.kl == pytest.approx(first_token_kl(naive_logits, turbo_logits)) and sampled.kl > 0.1
    assert (unkept.first_token, unkept.answer, unkept.kl) == (None, None, None)
    with pytest.raises(ValueError, match="at least one token"):
        compare(TurboAnswer((), greedy=True), [1], None)


# ---- the setting and the draw --------------------------------------------------------------------------------


@pytest.mark.parametrize("share", [-0.01, 1.01, float("nan")])
def test_a_share_outside_0_to_1_is_refused(share: float) -> None:
    with pytest.raises(ValueError, match=r"within 0\.\.1"):
        ShadowPolicy(share, 4)
    with pytest.raises(ValidationError, match="shadow_share"):
        Settings(shadow_share=share)


def test_the_queue_holds_at_least_one() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        ShadowPolicy(0.5, 0)
    fields = Settings.model_fields  # the defaults (tests/conftest.py sets the share to 0 for every server)
    assert (fields["shadow_share"].default, fields["shadow_queue"].default) == (0.01, 16)
    with pytest.raises(ValidationError, match="shadow_queue"):
        Settings(shadow_queue=0)


def test_the_draw_picks_the_share_of_turbo_answers_and_never_naive_ones(engine: StitchEngine) -> None:
    p = prompt(engine, 1)
    greedy, sampled = SamplingParams(max_new_tokens=2), SamplingParams(max_new_tokens=2, temperature=0.7)
    draws = random.Random(3)
    shadows = Shadows(ShadowPolicy(0.25, 4), lambda r: None, Metrics(), draws.random)

    picked = [shadows.pick(BatchRequest(p, greedy, "turbo")) for _ in range(400)]
    same_draws = random.Random(3)
    expected = [same_draws.random() < 0.25 for _ in range(400)]
    naive = BatchRequest(p, greedy, "naive")
    sampled_turbo = BatchRequest(p, sampled, "turbo")
    always = Shadows(ShadowPolicy(1.0, 4), lambda r: None, Metrics(), draws.random)

    assert picked == expected and 80 < sum(picked) < 120
    assert not always.pick(naive) and not naive.keep_first_logits
    assert always.pick(sampled_turbo) and sampled_turbo.keep_first_logits  # sampled: its logits kept for the KL
    never = Shadows(ShadowPolicy(0.0, 4), lambda r: None, Metrics(), lambda: pytest.fail("share 0 draws nothing"))
    assert not never.pick(BatchRequest(p, greedy, "turbo"))


# ---- shadows through the scheduler ---------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_recomputing_every_chunk_token_agrees_with_its_shadow(engine: StitchEngine, temperature: float) -> None:
    """selective:1 reordered answers as naive by construction: agreement 1, KL ~0."""
    served = Served(engine)

    for seed in (11, 12):
        served.answer(prompt(engine, seed), "selective:1", temperature)
        served.scheduler.run_until_idle()

    assert served.outcome("compared") == 2 and served.outcome("dropped") == 0
    assert served.agreement("first_token", "agreed", "selective") == 2
    assert served.agreement("first_token", "differed", "selective") == 0
    if temperature == 0.0:
        assert served.agreement("answer", "agreed", "selective") == 2 and served.kl("count", "selective") == 0
    else:
        assert served.agreement("answer", "agreed", "selective") == 0  # a draw is compared by its distribution
        assert served.kl("count", "selective") == 2 and served.kl("sum", "selective") < 1e-9
    figures = served.shadows.figures()
    assert figures["agreement"]["first_token"] == {"compared": 2, "agreed": 2, "rate": 1.0}
    assert figures["pending"] == 0 and figures["answers"]["compared"] == 2


def test_plain_turbo_agreement_is_what_an_independent_naive_run_gives(engine: StitchEngine) -> None:
    served = Served(engine)
    prompts = [prompt(engine, 20 + i) for i in range(6)]
    answers = [served.answer(p, max_new=5) for p in prompts]
    served.scheduler.run_until_idle()

    naive = [
        generate(engine, p, SamplingParams(max_new_tokens=len(a.result.token_ids)), "naive").token_ids
        for p, a in zip(prompts, answers, strict=True)
    ]
    same_answer = sum(n == a.result.token_ids for n, a in zip(naive, answers, strict=True))
    same_first = sum(n[0] == a.result.token_ids[0] for n, a in zip(naive, answers, strict=True))

    assert served.agreement("answer", "agreed") == same_answer
    assert served.agreement("answer", "differed") == 6 - same_answer
    assert served.agreement("first_token", "agreed") == same_first
    assert served.agreement("first_token", "differed") == 6 - same_first
    assert same_answer < 6  # the tiny random model's turbo answers are not all naive's: the test can tell


def test_a_sampled_answers_kl_is_that_of_the_reference_forwards(engine: StitchEngine) -> None:
    served = Served(engine)
    prompts = [prompt(engine, 30 + i) for i in range(3)]
    for p in prompts:
        served.answer(p, temperature=1.0)
    served.scheduler.run_until_idle()

    expected = []
    for p in prompts:
        ids = list(p.joined())
        causal = torch.ones(len(ids), len(ids), dtype=torch.bool).tril()
        naive = reference_logits(engine.model, ids, torch.arange(len(ids)), causal)[-1]
        expected.append(first_token_kl(naive, prompt_reference_logits(engine.model, p, "reordered")[-1]))

    assert served.kl("count") == 3
    assert served.kl("sum") == pytest.approx(sum(expected), rel=1e-3, abs=1e-6)
    assert sum(expected) > 1e-3  # stitching moved the distribution: a nonzero figure to match
    assert served.shadows.figures()["kl"]["mean"] == pytest.approx(sum(expected) / 3, rel=1e-3, abs=1e-6)


def test_a_full_queue_drops_and_counts(engine: StitchEngine) -> None:
    served = Served(engine, queue_size=2)
    answers = [served.answer(prompt(engine, 40 + i), max_new=3, follow=False) for i in range(3)]
    for answer in answers:  # the scheduler does not step meanwhile: the shadows queue
        served.shadows.follow(answer)

    assert served.outcome("dropped") == 1 and len(served.scheduler.planner.shadows) == 2
    assert served.metrics.registry.get_sample_value("kvstitch_shadow_pending") == 2
    assert served.shadows.figures()["answers"]["dropped"] == 1

    served.scheduler.run_until_idle()

    assert served.outcome("compared") == 2 and served.shadows.figures()["pending"] == 0
    served.shadows.follow(answers[0])  # room again
    served.scheduler.run_until_idle()
    assert served.outcome("compared") == 3 and served.outcome("dropped") == 1


def _preempt_running_shadow(served: Served, engine: StitchEngine, seed: int) -> BatchRequest:
    """Step until the shadow runs alone, then add a real request that takes its place."""
    scheduler = served.scheduler
    for _ in range(10):
        if len(scheduler.running) == 1 and scheduler.running[0].shadow:
            break
        scheduler.step()
    assert len(scheduler.running) == 1 and scheduler.running[0].shadow
    real = BatchRequest(prompt(engine, seed), SamplingParams(max_new_tokens=2), "turbo")
    scheduler.add(real)
    scheduler.step()  # the real request is admitted, the shadow preempted
    assert not any(r.shadow for r in scheduler.running)
    return real


def test_a_preempted_shadow_starts_over_and_is_compared(engine: StitchEngine) -> None:
    served = Served(engine, max_batch=1)
    served.shadows.follow(served.answer(prompt(engine, 51), max_new=30, follow=False))
    real = _preempt_running_shadow(served, engine, 52)
    served.scheduler.run_until_idle()

    assert real.result.finish_reason == "length"
    assert served.outcome("preempted") == 0 and served.outcome("compared") == 1  # the restart finished
    assert served.shadows.figures()["pending"] == 0
    assert served.agreement("first_token", "agreed") + served.agreement("first_token", "differed") == 1


def test_a_shadow_preempted_past_its_retries_is_counted_and_frees_its_place(engine: StitchEngine) -> None:
    served = Served(engine, max_batch=1)
    served.shadows.follow(served.answer(prompt(engine, 53), max_new=30, follow=False))
    for attempt in range(SHADOW_RETRIES + 1):  # the first run and every restart preempted
        _preempt_running_shadow(served, engine, 54 + attempt)
        _finish_real(served)
    served.scheduler.run_until_idle()

    assert served.outcome("preempted") == 1 and served.outcome("compared") == 0
    assert served.shadows.figures()["pending"] == 0
    assert served.agreement("first_token", "agreed") == served.agreement("first_token", "differed") == 0


def _finish_real(served: Served) -> None:
    """Step until only the restarted shadow is left waiting or running."""
    scheduler = served.scheduler
    while any(not r.shadow for r in scheduler.running) or any(not r.shadow for r in scheduler.waiting):
        scheduler.step()


def test_share_0_runs_no_shadow(engine: StitchEngine) -> None:
    served = Served(engine, share=0.0)

    request = served.answer(prompt(engine, 60), temperature=0.5)

    assert not request.keep_first_logits and not served.scheduler.planner.shadows
    assert served.outcome("compared") == 0 and served.shadows.figures()["answers"] == dict.fromkeys(
        ("compared", "dropped", "preempted", "failed"), 0
    )
