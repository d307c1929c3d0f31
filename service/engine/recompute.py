"""Recompute part of a stitched context before the question: EPIC's `prefix:N` and CacheBlend's `selective:R`.

A stitched context is exact for the template prefix (computed at positions 0..P-1 with nothing before it), but
every chunk block's KV was computed with attention to that block alone. Recomputing a token runs it through the
layers again with attention to every context token before it in slot order (the joined prompt's order, the one a
full causal prefill sees), its K/V overwriting the cached ones layer by layer, so the next layer of every other
recomputed token reads them. Tokens not chosen keep their cached K/V. Recomputing every chunk token therefore gives
back the naive prefill's KV where the plan's positions are the naive ones (`reordered`).

Layer 0's K/V depend only on the token and its position, so the cached ones already are full attention's: layer 0
runs attention for the chosen tokens over the cached layer-0 K/V, and overwriting starts at layer 1.

- `prefix:N` chooses the first min(N, length) tokens of every chunk block (EPIC's remedy: a block computed alone
  makes its first tokens attention sinks of its own, which a full prefill would not).
- `selective:R` runs layer 0 for every chunk token, computes their layer-1 K/V as full attention gives them, and
  chooses the round(R * chunk tokens) whose cached layer-1 K/V deviate most (squared L2 over heads, keys and
  values): CacheBlend's selection, on the first layer where cached and full KV can differ.

Rotary positions are the plan's (with `composite`, recomputed tokens keep their chunk-local positions). It runs
eagerly, never in a CUDA graph: the chosen tokens change with every request.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from service.engine.attention import attend_at_slots, attend_causal_end
from service.engine.forward import LeanForward
from service.engine.kv_buffer import KVBuffer
from service.engine.kv_layout import KEYS, VALUES
from service.engine.recompute_spec import RecomputeKind, RecomputeSpec
from service.engine.rotary import Rotary
from service.engine.stitch import StitchPlan


@torch.inference_mode()
def recompute_context(
    forward: LeanForward, buffer: KVBuffer, plan: StitchPlan, context_ids: Sequence[int], spec: RecomputeSpec
) -> int:
    """Recompute the tokens `spec` chooses in a buffer holding exactly the stitched context of `plan`
    (`context_ids`: prefix and chunk block ids, as stitched); returns how many tokens were recomputed."""
    _check(buffer, plan, context_ids)
    candidates = candidate_slots(plan, spec)
    count = chosen_count(spec, candidates.numel())
    if count == 0:
        return 0
    # Every chunk token chosen: the queries are the context's tail, which the eager causal kernel (flash where it
    # runs) covers without a mask; known here, on the host, before the slots move to the device.
    tail = count == candidates.numel() and _is_tail(candidates, plan.context_tokens)
    device = buffer.data.device
    candidates = candidates.to(device)
    ids = torch.tensor(list(context_ids), dtype=torch.long, device=device)[candidates]
    cos, sin = forward.rotary.cos_sin(plan.positions().to(device)[candidates])
    hidden = forward.decoder.embed_tokens(ids.unsqueeze(0))
    hidden = _layer(forward, 0, buffer, hidden, candidates, (cos, sin), write=False, tail=tail)
    if count < candidates.numel():
        keep = most_deviating(forward, buffer, hidden, candidates, (cos, sin), count)
        candidates, hidden, cos, sin = candidates[keep], hidden[:, keep], cos[keep], sin[keep]
    for index in range(1, forward.spec.num_layers):
        hidden = _layer(forward, index, buffer, hidden, candidates, (cos, sin), write=True, tail=tail)
    return count


def _is_tail(slots: torch.Tensor, end: int) -> bool:
    """Whether host `slots` are exactly end - T .. end - 1: every chunk token chosen (after one prefix block)."""
    count = slots.numel()
    return count > 0 and int(slots[0]) == end - count and int(slots[-1]) == end - 1


def candidate_slots(plan: StitchPlan, spec: RecomputeSpec) -> torch.Tensor:
    """Buffer slots [T] (ascending) `spec` may recompute: the first N of every chunk block for `prefix:N`, every
    chunk token for `selective`, none for `none`. Block 0 (the template prefix) is exact and never a candidate."""
    if not spec.active:
        return torch.empty(0, dtype=torch.long)
    limit = int(spec.amount) if spec.kind is RecomputeKind.PREFIX else max(plan.lengths, default=0)
    parts = [torch.arange(s, s + min(limit, n)) for s, n in zip(plan.slots[1:], plan.lengths[1:], strict=True)]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)


def chosen_count(spec: RecomputeSpec, candidates: int) -> int:
    """How many of the candidates are recomputed: all for `prefix`, the share R (rounded half up) for `selective`."""
    if spec.kind is RecomputeKind.SELECTIVE:
        return min(candidates, int(spec.amount * candidates + 0.5))
    return candidates


def most_deviating(
    forward: LeanForward,
    buffer: KVBuffer,
    hidden: torch.Tensor,
    slots: torch.Tensor,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    count: int,
) -> torch.Tensor:
    """Indices (ascending) into `slots` of the `count` tokens whose cached layer-1 K/V differ most from those
    full attention gives (`hidden` [1, T, hidden]: the tokens after a full-attention layer 0)."""
    if forward.spec.num_layers < 2:  # one layer: the cached K/V are exact, any choice recomputes nothing new
        return torch.arange(count, device=slots.device)
    layer = forward.layers[1]
    _, keys, values = forward._project(layer, layer.input_layernorm(hidden))
    keys = Rotary.apply(keys, *cos_sin)[0]
    cached_keys = buffer.data[1, KEYS].index_select(1, slots)
    cached_values = buffer.data[1, VALUES].index_select(1, slots)
    deviation = (keys.float() - cached_keys.float()).square().sum(dim=(0, 2))
    deviation += (values[0].float() - cached_values.float()).square().sum(dim=(0, 2))
    return torch.topk(deviation, count).indices.sort().values


def _layer(
    forward: LeanForward,
    index: int,
    buffer: KVBuffer,
    hidden: torch.Tensor,
    slots: torch.Tensor,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    write: bool,
    tail: bool,
) -> torch.Tensor:
    """Layer `index` for the tokens at `slots` (`hidden` [1, T, hidden]) over the buffer's context; with `write`
    their fresh K/V replace the cached ones first, so they attend to themselves and to each other as recomputed.
    `tail`: the slots are the context's last T (one end-aligned causal kernel, no mask). The lean forward's own
    per-layer pieces keep the arithmetic that of `extend`."""
    layer = forward.layers[index]
    q, k, v = forward._project(layer, layer.input_layernorm(hidden))
    q, k = Rotary.apply(q, *cos_sin), Rotary.apply(k, *cos_sin)
    if write:
        buffer.data[index, KEYS].index_copy_(1, slots, k[0])
        buffer.data[index, VALUES].index_copy_(1, slots, v[0])
    keys, values, scale = (
        buffer.keys(index, buffer.length),
        buffer.values(index, buffer.length),
        layer.self_attn.scaling,
    )
    if tail:
        out = attend_causal_end(q, keys.unsqueeze(0), values.unsqueeze(0), scale)
    else:
        out = attend_at_slots(q, keys, values, slots, scale)
    return forward._finish_layer(layer, hidden, out)


def _check(buffer: KVBuffer, plan: StitchPlan, context_ids: Sequence[int]) -> None:
    if len(context_ids) != plan.context_tokens:
        raise ValueError(f"{len(context_ids)} context ids for a stitch plan of {plan.context_tokens} tokens")
    if buffer.length != plan.context_tokens:
        # After the question the question's KV would be stale; before the stitch there is nothing to attend to.
        raise ValueError(
            f"recompute needs the stitched context alone ({plan.context_tokens} tokens), not {buffer.length}"
        )
