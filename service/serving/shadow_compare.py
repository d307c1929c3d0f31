"""How a turbo answer compares with its shadow, the same prompt answered naive (greedily, up to as many tokens).

- First token: whether naive's likeliest first token (its greedy first token) is turbo's likeliest one. For a
  greedy answer that is turbo's first token; for a sampled one, the argmax of turbo's kept first-token logits:
  its sampled token differs from any argmax by chance, which would count the sampling against the stitching.
- Answer (greedy answers only): the same tokens, one for one. A sampled answer is a draw: no naive answer is the
  one it should equal.
- KL(naive || turbo) of the first-token distributions (sampled answers only, whose first-token logits were kept):
  the model's own distributions, temperature 1 and no truncation, so the figure means the same whatever the
  request's sampling settings; computed in float64 so that equal logits give 0, not rounding noise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TurboAnswer:
    """What a shadow is compared against: the turbo answer's tokens and, for a sampled answer, its first-token
    logits ([vocab] fp32 on the host)."""

    tokens: tuple[int, ...]
    greedy: bool
    first_logits: torch.Tensor | None = None


@dataclass(frozen=True)
class Comparison:
    first_token: bool | None  # None: a sampled answer without its first-token logits
    answer: bool | None  # None: a sampled answer
    kl: float | None  # None: a greedy answer (or logits missing on either side)


def compare(turbo: TurboAnswer, naive_tokens: Sequence[int], naive_logits: torch.Tensor | None) -> Comparison:
    """The turbo answer against its naive shadow's tokens (greedy) and first-token logits (kept when turbo's
    answer was sampled)."""
    if not turbo.tokens or not naive_tokens:
        raise ValueError("a shadow compares answers of at least one token")
    if turbo.greedy:
        return Comparison(naive_tokens[0] == turbo.tokens[0], list(naive_tokens) == list(turbo.tokens), None)
    if turbo.first_logits is None:
        return Comparison(None, None, None)
    first = naive_tokens[0] == int(torch.argmax(turbo.first_logits))
    kl = first_token_kl(naive_logits, turbo.first_logits) if naive_logits is not None else None
    return Comparison(first, None, kl)


def first_token_kl(naive_logits: torch.Tensor, turbo_logits: torch.Tensor) -> float:
    """KL(naive || turbo) in nats of the softmax of two [vocab] logit rows."""
    if naive_logits.shape != turbo_logits.shape:
        raise ValueError(f"logits of shapes {tuple(naive_logits.shape)} and {tuple(turbo_logits.shape)}")
    naive = torch.log_softmax(naive_logits.double(), dim=-1)
    turbo = torch.log_softmax(turbo_logits.double(), dim=-1)
    p = naive.exp()
    kl = float(torch.sum(torch.where(p > 0, p * (naive - turbo), 0.0)))  # a token naive rules out adds nothing
    return max(kl, 0.0)  # rounding may leave a hair below 0 for equal rows
