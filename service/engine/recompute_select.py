"""Which stitched context tokens to recompute: by what the question reads, and whether to recompute at all.

`query:R` (ProphetKV's idea): run the question once over the stitched context, through every layer, and score
each chunk token by the attention the question's tokens give it (summed over heads and question tokens, averaged
over layers); recompute the share R with the highest scores. A token the question never reads costs nothing
when its KV is off, so the budget goes where the answer looks, not where the cache deviates most.

`auto` (the adaptive trigger of seed 002): per request, estimate how far the answer's reading of the context is
from a full prefill's, E = sum_i a_i * d_i, with a_i the question's attention share on chunk token i and d_i the
relative deviation of its cached layer-1 K/V from the ones full attention gives (CacheBlend's measure,
||full - cached|| / ||full||). Below the threshold nothing is recomputed; above it, the tokens with the largest
a_i * d_i are recomputed until what is left of E falls to the threshold, at most a share of the chunk tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from service.engine.forward import LeanForward
from service.engine.kv_buffer import KVBuffer
from service.engine.kv_layout import KEYS, VALUES
from service.engine.recompute_spec import AUTO_THRESHOLD
from service.engine.rotary import Rotary
from service.engine.stitch import StitchPlan

AUTO_MAX_SHARE = 0.3  # `auto` never recomputes more than this share of chunk tokens


@dataclass(frozen=True)
class AutoChoice:
    """What `auto` decided for one request: the estimate, and the chunk tokens (indices into the candidates)."""

    estimate: float
    chosen: torch.Tensor

    @property
    def triggered(self) -> bool:
        return self.chosen.numel() > 0


@torch.inference_mode()
def question_attention(
    forward: LeanForward, buffer: KVBuffer, plan: StitchPlan, question_ids: Sequence[int]
) -> torch.Tensor:
    """fp32 [context_tokens]: the attention the question gives each context slot, summed over query heads and
    question tokens and averaged over layers. Writes nothing: the buffer still holds the stitched context only."""
    device, context = buffer.data.device, plan.context_tokens
    count = len(question_ids)
    positions = torch.arange(plan.question_start, plan.question_start + count, device=device)
    cos, sin = forward.rotary.cos_sin(positions)
    hidden = forward.decoder.embed_tokens(torch.tensor([list(question_ids)], dtype=torch.long, device=device))
    own = torch.ones(count, count, dtype=torch.bool, device=device).tril()
    visible = torch.cat([torch.ones(count, context, dtype=torch.bool, device=device), own], dim=1)
    scores = torch.zeros(context, dtype=torch.float32, device=device)
    for index, layer in enumerate(forward.layers):
        q, k, v = forward._project(layer, layer.input_layernorm(hidden))
        q, k = Rotary.apply(q, cos, sin), Rotary.apply(k, cos, sin)
        keys = torch.cat([buffer.keys(index, context), k[0]], dim=1)
        values = torch.cat([buffer.values(index, context), v[0]], dim=1)
        group = q.shape[1] // keys.shape[0]
        logits = torch.einsum("htd,hkd->htk", q[0].float(), keys.float().repeat_interleave(group, dim=0))
        logits = (logits * layer.self_attn.scaling).masked_fill(~visible, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        scores += probs[..., :context].sum(dim=(0, 1))
        out = torch.einsum("htk,hkd->htd", probs, values.float().repeat_interleave(group, dim=0))
        hidden = forward._finish_layer(layer, hidden, out.to(hidden.dtype).transpose(0, 1).unsqueeze(0))
    return scores / len(forward.layers)


def top_share(scores: torch.Tensor, count: int, blocks: Sequence[int] = (), floor: float = 0.0) -> torch.Tensor:
    """Indices (ascending) of the `count` highest scores; with a `floor`, each block (consecutive runs of `blocks`
    scores) first gives its own best `floor` share (rounded down, so the floors never pass `count`), and the rest
    of the count goes to the highest scores left."""
    if floor <= 0.0 or not blocks:
        return torch.topk(scores, count).indices.sort().values
    if sum(blocks) != scores.numel():
        raise ValueError(f"blocks of {sum(blocks)} scores for {scores.numel()} scores")
    owns = [int(floor * size) for size in blocks]  # on the host: no wait for the device
    picked, start = [], 0
    for size, own in zip(blocks, owns, strict=True):
        if own:
            picked.append(torch.topk(scores[start : start + size], own).indices + start)
        start += size
    rest = count - sum(owns)
    if rest > 0:
        left = scores.float().clone()
        if picked:
            left[torch.cat(picked)] = float("-inf")
        picked.append(torch.topk(left, rest).indices)
    return torch.cat(picked).sort().values


def layer1_change(
    forward: LeanForward,
    buffer: KVBuffer,
    hidden: torch.Tensor,
    slots: torch.Tensor,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [T] each: ||full - cached|| and ||full|| of the layer-1 K/V of the tokens at `slots` (`hidden`
    [1, T, hidden]: the tokens after a full-attention layer 0), CacheBlend's deviation and its scale. A one-layer
    model's cached K/V are exact: no change."""
    if forward.spec.num_layers < 2:
        zeros = torch.zeros(slots.numel(), dtype=torch.float32, device=slots.device)
        return zeros, torch.ones_like(zeros)
    layer = forward.layers[1]
    _, keys, values = forward._project(layer, layer.input_layernorm(hidden))
    full = torch.cat([Rotary.apply(keys, *cos_sin)[0], values[0]], dim=-1).float()  # [Hkv, T, 2D]
    cached = torch.cat(
        [buffer.data[1, KEYS].index_select(1, slots), buffer.data[1, VALUES].index_select(1, slots)], dim=-1
    ).float()
    return (full - cached).square().sum(dim=(0, 2)).sqrt(), full.square().sum(dim=(0, 2)).sqrt()


def layer1_deviation(
    forward: LeanForward,
    buffer: KVBuffer,
    hidden: torch.Tensor,
    slots: torch.Tensor,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """fp32 [T]: `layer1_change` relative to the K/V's own size, the form `auto` weighs against attention."""
    change, size = layer1_change(forward, buffer, hidden, slots, cos_sin)
    return change / size.clamp_min(1e-12)


def auto_choice(
    attention: torch.Tensor,
    deviation: torch.Tensor,
    threshold: float = AUTO_THRESHOLD,
    max_share: float = AUTO_MAX_SHARE,
) -> AutoChoice:
    """The `auto` decision over candidate tokens: `attention` (their question attention) and `deviation` (their
    relative layer-1 deviation), both [T]."""
    share = attention / attention.sum().clamp_min(1e-12)
    risk = share * deviation
    estimate = float(risk.sum())
    if estimate <= threshold or risk.numel() == 0:
        return AutoChoice(estimate, torch.empty(0, dtype=torch.long, device=risk.device))
    order = torch.argsort(risk, descending=True)
    left = estimate - torch.cumsum(risk[order], dim=0)  # what is left of E after recomputing the first n + 1
    needed = int(torch.count_nonzero(left > threshold)) + 1
    limit = max(1, int(max_share * risk.numel()))
    return AutoChoice(estimate, order[: min(needed, limit)].sort().values)
