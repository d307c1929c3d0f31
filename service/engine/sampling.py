"""Token selection: greedy, or temperature / top-k / top-p sampling with a seedable generator."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

MAX_NEW_TOKENS_LIMIT = 8192
MAX_STOP_STRINGS = 8
# Below this, sampling is an argmax anyway, and dividing by it overflows: 5e-324 is 0 in fp32, so logits / it are
# inf and the probabilities NaN (a 500 found by the schema fuzz test). Such temperatures are greedy.
MIN_SAMPLING_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. temperature 0 (or below MIN_SAMPLING_TEMPERATURE) means greedy."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False  # benchmarks and equivalence tests decode a fixed number of tokens

    def __post_init__(self) -> None:
        if not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS_LIMIT:
            raise ValueError(f"max_new_tokens must be within 1..{MAX_NEW_TOKENS_LIMIT}")
        if not 0.0 <= self.temperature <= 5.0:
            raise ValueError("temperature must be within 0..5")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be within (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0 (0 disables it)")
        if len(self.stop) > MAX_STOP_STRINGS or any(not s for s in self.stop):
            raise ValueError(f"at most {MAX_STOP_STRINGS} non-empty stop strings")


class Sampler:
    """Picks the next token from fp32 logits [vocab]."""

    def __init__(self, params: SamplingParams, device: torch.device) -> None:
        self.params = params
        self.generator: torch.Generator | None = None
        if params.temperature >= MIN_SAMPLING_TEMPERATURE:
            self.generator = torch.Generator(device=device)
            if params.seed is not None:
                self.generator.manual_seed(params.seed)
            else:
                self.generator.seed()

    @property
    def greedy(self) -> bool:
        """Whether `pick` is a plain argmax (so a caller may take one computed elsewhere)."""
        return self.generator is None

    def pick(self, logits: torch.Tensor) -> int:
        if self.generator is None:
            return int(torch.argmax(logits))
        scores = logits.float() / self.params.temperature
        scores = _keep_top_k(scores, self.params.top_k)
        scores = _keep_top_p(scores, self.params.top_p)
        probs = torch.softmax(scores, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))


def _keep_top_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    if k <= 0 or k >= scores.numel():
        return scores
    threshold = torch.topk(scores, k).values[-1]
    return scores.masked_fill(scores < threshold, float("-inf"))


def _keep_top_p(scores: torch.Tensor, p: float) -> torch.Tensor:
    if p >= 1.0:
        return scores
    sorted_scores, order = torch.sort(scores, descending=True)
    cumulative = torch.softmax(sorted_scores, dim=-1).cumsum(dim=-1)
    # Drop a token when the mass before it already reaches p; the top token always survives.
    drop_sorted = (cumulative - torch.softmax(sorted_scores, dim=-1)) >= p
    drop_sorted[0] = False  # a top_p that is 0 in fp32 (5e-324) would drop it too: all -inf, NaN probabilities
    drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
    return scores.masked_fill(drop, float("-inf"))
