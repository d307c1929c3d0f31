"""Token selection: greedy, or temperature / top-k / top-p sampling with a seedable generator, for one request
or a batch of requests with different settings (the same code: a request alone is a batch of one)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from service.engine.device_copy import to_device

MAX_NEW_TOKENS_LIMIT = 8192
MAX_STOP_STRINGS = 8
MAX_LOGPROBS = 20  # alternatives per token a request may ask for (OpenAI's top_logprobs bound)
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
    logprobs: int | None = None  # None: none; k: each picked token's log-probability and its k likeliest rivals

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
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be within 0..{MAX_LOGPROBS}")


class Sampler:
    """Picks the next token from fp32 logits [vocab]: `pick_rows` with this one request as its only row.

    A request alone and a request inside a batch go through the same `pick_rows`, and a sampled request draws
    its noise from its own generator (one [vocab] draw per pick whatever the batch), so a seed gives the same
    tokens alone and batched.
    """

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
        return pick_rows(logits.unsqueeze(0), [self])[0]


def pick_rows(logits: torch.Tensor, samplers: Sequence[Sampler]) -> list[int]:
    """One token per row of fp32 logits [B, vocab], row b picked as `samplers[b]` says: `pick_rows_on_device`,
    then one host copy of the B ids."""
    return [int(t) for t in pick_rows_on_device(logits, samplers).tolist()]


def pick_rows_on_device(logits: torch.Tensor, samplers: Sequence[Sampler]) -> torch.Tensor:
    """The picks of `pick_rows` as a [B] int64 tensor on the logits' device, without waiting for them (the
    overlapped decode step feeds them to the next step before the host has seen them).

    Greedy rows take the argmax; sampled rows are filtered (temperature, top-k, top-p) together and pick by an
    exponential race: argmax(p / E) with E ~ Exp(1) drawn per row from that row's generator selects token i
    with probability p_i, like `torch.multinomial`, but batches as one argmax.
    """
    if logits.dim() != 2 or logits.shape[0] != len(samplers):
        raise ValueError(f"logits {tuple(logits.shape)} need one row per sampler ({len(samplers)})")
    picks = torch.argmax(logits, dim=-1)
    sampled = [row for row, s in enumerate(samplers) if not s.greedy]
    if sampled:
        index = to_device(torch.tensor(sampled), logits.device)
        params = [samplers[row].params for row in sampled]
        probs = _filtered_probs(logits.index_select(0, index).float(), params)
        noise = torch.stack([_exponential(probs.shape[1], samplers[row]) for row in sampled])
        picks = picks.index_copy(0, index, torch.argmax(probs / noise, dim=-1))
    return picks


def _exponential(vocab: int, sampler: Sampler) -> torch.Tensor:
    assert sampler.generator is not None
    noise = torch.empty(vocab, device=sampler.generator.device).exponential_(generator=sampler.generator)
    # A draw of exactly 0 would make p / E inf (or NaN where p is 0) and win the race regardless of p.
    return noise.clamp_min_(torch.finfo(noise.dtype).tiny)


def _filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """softmax(logits / temperature) with each row's top-k and top-p cut applied, [n, vocab]."""
    device, vocab = logits.device, logits.shape[1]
    # top_k 0 (off) keeps every token; top_p 1 (off) drops none, even where a cumulative sum rounds above 1.
    # One asynchronous copy for the three settings (top_k exact in fp64 up to 2**53).
    settings = [
        [p.temperature for p in params],
        [p.top_k if 0 < p.top_k < vocab else vocab for p in params],
        [p.top_p if p.top_p < 1.0 else float("inf") for p in params],
    ]
    on_device = to_device(torch.tensor(settings, dtype=torch.float64), device)
    temperature = on_device[0].to(logits.dtype).unsqueeze(1)
    top_k, top_p = on_device[1].long(), on_device[2].to(logits.dtype)
    scores = logits / temperature
    if all(p.top_k <= 0 and p.top_p >= 1.0 for p in params):
        return torch.softmax(scores, dim=-1)  # no cut: skip the sort of a ~150K vocabulary
    sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
    # Top-k keeps every score at least the k-th largest (ties included).
    kth = sorted_scores.gather(1, (top_k - 1).unsqueeze(1))
    drop_sorted = sorted_scores < kth
    sorted_probs = torch.softmax(sorted_scores.masked_fill(drop_sorted, float("-inf")), dim=-1)
    # Top-p drops a token when the mass before it already reaches p; the top token always survives.
    drop_sorted |= (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p.unsqueeze(1)
    # A top_p that is 0 in fp32 (5e-324) would drop the top token too: all -inf, NaN probabilities (a 500 found by
    # the schema fuzz test).
    drop_sorted[:, 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return torch.softmax(scores.masked_fill(drop, float("-inf")), dim=-1)


@dataclass(frozen=True)
class TokenLogprobs:
    """A picked token's log-probability under the model (before temperature and cuts) and the `top` likeliest
    tokens with theirs, most likely first; ids, for the caller to name."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def logprobs_rows(logits: torch.Tensor, tokens: Sequence[int], top: Sequence[int]) -> list[TokenLogprobs]:
    """Log-probabilities of `tokens[b]` in row b of fp32 logits [B, vocab], with each row's `top[b]` likeliest
    tokens; one log-softmax and one top-k over the rows, one host copy."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    picked = logp.gather(1, torch.tensor(list(tokens), device=logits.device).unsqueeze(1)).squeeze(1)
    k = max(top, default=0)
    values, ids = torch.topk(logp, k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
    host = torch.cat((picked.unsqueeze(1), values, ids.to(logp.dtype)), dim=1).tolist()
    rows = []
    for b, row in enumerate(host):
        alternatives = tuple((int(row[1 + k + i]), row[1 + i]) for i in range(top[b]))
        rows.append(TokenLogprobs(int(tokens[b]), row[0], alternatives))
    return rows
