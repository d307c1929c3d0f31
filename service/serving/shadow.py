"""Fidelity you can watch in production: a share of turbo answers answered again naive, after the client's answer,
and compared (`shadow_compare.py`), into metrics and the figures `/readyz` shows.

`Shadows.pick(request)`, as an answer's request is built, draws against `share` (turbo answers only, whatever
their positions and recompute policy) and asks a sampled answer to keep its first-token logits; `Shadows.follow`,
once that answer's `done` went out, queues its shadow: the same prompt ids, naive, greedy, up to as many tokens as
turbo generated, in the scheduler's low-priority lane (`BatchRequest.shadow`). No client waits for a shadow: it
holds no place in the engine's line, at most `queue_size` are queued or running (one more is dropped and counted),
and the scheduler admits one only while no request waits, preempting it for one that does (`planner.py`); a
preempted shadow starts over, behind real traffic again, up to `SHADOW_RETRIES` times.

Both calls, and a shadow's end, run on the engine loop's thread (inside an answer's end); the figures are read
from other threads, under a lock.
"""

from __future__ import annotations

import logging
import math
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from service.engine.batch_request import BatchRequest
from service.engine.engine import GenerationMode
from service.engine.prompt import PromptIds
from service.engine.sampling import MIN_SAMPLING_TEMPERATURE, SamplingParams
from service.metrics import SHADOW_KINDS, SHADOW_OUTCOMES, Metrics
from service.serving.shadow_compare import Comparison, TurboAnswer, compare

log = logging.getLogger(__name__)

# Where shadows go: the engine loop's `add_answer` (the scheduler's `add` on the loop's thread).
Submit = Callable[[BatchRequest], None]
# A preempted shadow starts over (behind real traffic again) this many times before it is counted preempted: a
# burst that pushes shadows out should not leave the busiest periods without any fidelity figure, and a load that
# never lets a shadow finish should not keep a queue place forever.
SHADOW_RETRIES = 2


@dataclass(frozen=True)
class ShadowPolicy:
    """`share` of turbo answers shadowed (0 turns shadows off); `queue_size` shadows queued or running at most."""

    share: float
    queue_size: int

    def __post_init__(self) -> None:
        if not 0.0 <= self.share <= 1.0:  # nan fails this too
            raise ValueError(f"the shadow share must be within 0..1, got {self.share}")
        if self.queue_size < 1:
            raise ValueError(f"the shadow queue must hold at least 1, got {self.queue_size}")


@dataclass(frozen=True)
class _Shadowed:
    """A turbo answer whose shadow runs: what it is compared against, the labels it is counted under, and what
    its shadow (re)starts from."""

    turbo: TurboAnswer
    positions: str
    recompute: str  # the policy's kind (none, prefix, selective, ...): bounded, unlike a request's amount
    prompt: PromptIds  # what the shadow answers (not the turbo request itself: that would keep its chunk KV alive)
    ignore_eos: bool


class Shadows:
    """Picks turbo answers, queues their naive shadows, compares and counts them."""

    def __init__(
        self, policy: ShadowPolicy, submit: Submit, metrics: Metrics, draw: Callable[[], float] = random.random
    ) -> None:
        self.policy = policy
        self._submit = submit
        self._metrics = metrics
        self._draw = draw
        self._lock = threading.Lock()
        self._pending = 0
        self._outcomes = dict.fromkeys(SHADOW_OUTCOMES, 0)
        self._agreement = {kind: [0, 0] for kind in SHADOW_KINDS}  # compared, agreed
        self._kl_count, self._kl_sum = 0, 0.0
        metrics.shadow_pending.set_function(lambda: float(self._pending))

    def pick(self, request: BatchRequest) -> bool:
        """Whether `request` gets a shadow (a draw against the share; turbo answers only). A sampled answer picked
        keeps its first-token logits for the KL."""
        share = self.policy.share
        if share == 0.0 or request.mode is not GenerationMode.TURBO or self._draw() >= share:
            return False
        request.keep_first_logits = not _greedy(request.sampling)
        return True

    def follow(self, request: BatchRequest) -> None:
        """Queue the shadow of a picked answer that ended with its `done` (dropped and counted when the queue is
        full)."""
        tokens = tuple(request.result.token_ids)
        if request.result.finish_reason not in ("stop", "length") or not tokens:
            return
        with self._lock:
            if self._pending >= self.policy.queue_size:
                self._count("dropped")
                return
            self._pending += 1
        turbo = TurboAnswer(tokens, _greedy(request.sampling), request.first_logits)
        shadowed = _Shadowed(
            turbo,
            request.positions.value,
            request.recompute.kind.value,
            request.prompt,
            request.sampling.ignore_eos,
        )
        self._launch(shadowed, retries=0)

    def _launch(self, shadowed: _Shadowed, retries: int) -> None:
        """Queue the naive shadow of `shadowed` (its `retries`-th restart after preemptions)."""
        turbo = shadowed.turbo
        params = SamplingParams(max_new_tokens=len(turbo.tokens), ignore_eos=shadowed.ignore_eos)
        shadow = BatchRequest(
            shadowed.prompt,
            params,
            GenerationMode.NAIVE,
            shadowed.positions,
            on_finish=partial(self._ended, shadowed, retries),
            shadow=True,
            keep_first_logits=not turbo.greedy,
        )
        try:
            self._submit(shadow)
        except Exception:  # the loop is closing: the shadow is lost, the answer was not
            log.warning("a shadow answer could not be queued", exc_info=True)
            self._end("failed")

    def figures(self) -> dict[str, Any]:
        """What `/readyz` shows: the share, the queue, outcomes and agreement rates since start, the mean KL."""
        with self._lock:
            agreement = {
                kind: {"compared": n, "agreed": agreed, "rate": agreed / n if n else None}
                for kind, (n, agreed) in self._agreement.items()
            }
            count = self._kl_count
            mean = self._kl_sum / count if count else None
            return {
                "share": self.policy.share,
                "queue_size": self.policy.queue_size,
                "pending": self._pending,
                "answers": dict(self._outcomes),
                "agreement": agreement,
                "kl": {"count": count, "mean": mean if mean is None or math.isfinite(mean) else None},
            }

    # ---- a shadow's end (on the engine loop) ---------------------------------------------------------------

    def _ended(self, shadowed: _Shadowed, retries: int, shadow: BatchRequest) -> None:
        reason = shadow.result.finish_reason
        if reason == "preempted" and retries < SHADOW_RETRIES:
            self._launch(shadowed, retries + 1)  # keeps its queue place
            return
        if reason == "preempted":
            self._end("preempted")
            return
        if reason not in ("stop", "length") or not shadow.result.token_ids:
            self._end("failed")
            return
        try:
            comparison = compare(shadowed.turbo, shadow.result.token_ids, shadow.first_logits)
        except Exception:  # a comparison must never fail the engine step it ends in
            log.exception("comparing a shadow answer failed")
            self._end("failed")
            return
        self._record(shadowed, comparison)
        self._end("compared")

    def _record(self, shadowed: _Shadowed, comparison: Comparison) -> None:
        agreed = {"first_token": comparison.first_token, "answer": comparison.answer}
        self._metrics.observe_shadow(shadowed.positions, shadowed.recompute, agreed, comparison.kl)
        with self._lock:
            for kind, same in agreed.items():
                if same is not None:
                    self._agreement[kind][0] += 1
                    self._agreement[kind][1] += int(same)
            if comparison.kl is not None:
                self._kl_count += 1
                self._kl_sum += comparison.kl

    def _end(self, outcome: str) -> None:
        with self._lock:
            self._pending -= 1
            self._count(outcome)

    def _count(self, outcome: str) -> None:
        self._outcomes[outcome] += 1
        self._metrics.shadow_answers.labels(outcome).inc()


def _greedy(sampling: SamplingParams) -> bool:
    return sampling.temperature < MIN_SAMPLING_TEMPERATURE
