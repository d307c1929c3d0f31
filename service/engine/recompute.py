"""Recompute part of a stitched context before the question: EPIC's `prefix:N`, CacheBlend's `selective:R`, the
question-aware `query:R` and the adaptive `auto` (the last two choose in `recompute_select.py`).

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
  values): CacheBlend's selection, on the first layer where cached and full KV can differ. `selective:R:F` first
  takes each chunk's own top F share, then the rest of the count overall (`query:R:F` likewise).

Rotary positions are the plan's, `reordered` only: `composite` chunks share positions, so a recomputed token
would attend to earlier chunks at positions at or after its own (answers collapsed when it was allowed); it is
refused. It runs eagerly, never in a CUDA graph: the chosen tokens change with every request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from service.engine.attention import SlotGroup, attend_at_slots, attend_causal_end, slot_groups
from service.engine.forward import LeanForward
from service.engine.kv_buffer import KVBuffer
from service.engine.kv_layout import KEYS, VALUES
from service.engine.recompute_select import (
    auto_choice,
    layer1_change,
    layer1_deviation,
    question_attention,
    top_share,
)
from service.engine.recompute_spec import COMPOSITE_RECOMPUTE, RecomputeKind, RecomputeSpec
from service.engine.rotary import Rotary
from service.engine.slot_attention import attend_slots_kernel, slot_kernel_usable
from service.engine.stitch import PositionMode, StitchPlan


@torch.inference_mode()
def recompute_context(
    forward: LeanForward,
    buffer: KVBuffer,
    plan: StitchPlan,
    context_ids: Sequence[int],
    spec: RecomputeSpec,
    question_ids: Sequence[int] = (),
) -> int:
    """Recompute the tokens `spec` chooses in a buffer holding exactly the stitched context of `plan`
    (`context_ids`: prefix and chunk block ids, as stitched; `question_ids`: the question suffix, which `query`
    and `auto` read); returns how many tokens were recomputed."""
    _check(buffer, plan, context_ids)
    if spec.active and plan.mode is PositionMode.COMPOSITE:
        raise ValueError(COMPOSITE_RECOMPUTE)
    if spec.kind in QUESTION_KINDS and not question_ids:
        raise ValueError(f"recompute {spec} reads the question: it needs the question's ids")
    candidates = candidate_slots(plan, spec)
    if candidates.numel() == 0:
        return 0
    device = buffer.data.device
    host_candidates, candidates = candidates, candidates.to(device)
    ids = torch.tensor(list(context_ids), dtype=torch.long, device=device)
    cos, sin = forward.rotary.cos_sin(plan.positions().to(device))
    # Every chunk token a candidate and chosen: the queries are the context's tail, which the eager causal kernel
    # (flash where it runs) covers without a mask; known here, on the host, before the slots move to the device.
    all_tail = _is_tail(host_candidates, plan.context_tokens)
    choice = _choose(forward, buffer, plan, spec, question_ids, candidates, ids, (cos, sin), all_tail)
    if choice is None or choice.chosen.numel() == 0:
        return 0
    chosen = choice.chosen
    tail = all_tail and chosen.numel() == host_candidates.numel()
    slots = candidates[chosen]
    cos_sin = (cos[slots], sin[slots])
    model = forward.spec
    kernel = not tail and slot_kernel_usable(
        device, buffer.data.dtype, model.num_heads, model.num_kv_heads, model.head_dim
    )
    # SDPA's path: one host copy of the chosen slots per recompute (not per layer) bounds the keys each run of
    # queries reads. The kernel reads the slots on the device and bounds each block's keys itself.
    groups = () if tail or kernel else slot_groups(slots.tolist())
    key_scale = _chunk_key_scale(plan)
    if choice.after_layer0 is not None:  # the selection ran layer 0 for every candidate: keep the chosen rows
        hidden, first = choice.after_layer0.index_select(1, chosen), 1
    else:
        hidden, first = forward.decoder.embed_tokens(ids[slots].unsqueeze(0)), 0
    last = forward.spec.num_layers - 1
    for index in range(first, last):
        # Layer 0's cached K/V already are full attention's (they depend on the token and its position alone).
        write = index > 0
        hidden = _layer(forward, index, buffer, hidden, slots, cos_sin, write, tail, key_scale, groups, kernel)
    if first <= last:  # the last layer's output feeds nothing the recompute keeps: only its K/V are written
        _write_kv(forward, last, buffer, hidden, slots, cos_sin, key_scale, write=last > 0)
    return int(chosen.numel())


@dataclass(frozen=True)
class Choice:
    """The chunk tokens to recompute (indices, ascending, on the device, into the candidates) and, where the
    selection already ran layer 0 over every candidate, its output [1, candidates, hidden]: the chosen rows are
    the recompute's layer-0 output (layer 0 reads only cached K/V, which are full attention's), not run twice."""

    chosen: torch.Tensor
    after_layer0: torch.Tensor | None = None


def _chunk_key_scale(plan: StitchPlan) -> float:
    """The factor the stitch put on every chunk key (a context temperature's 1/T): recomputed chunk keys carry it
    too, so that every chunk key a later query reads is tempered alike."""
    return plan.key_scale(1) if len(plan.lengths) > 1 else 1.0


QUESTION_KINDS = frozenset({RecomputeKind.QUERY, RecomputeKind.AUTO})


def _choose(
    forward: LeanForward,
    buffer: KVBuffer,
    plan: StitchPlan,
    spec: RecomputeSpec,
    question_ids: Sequence[int],
    candidates: torch.Tensor,
    ids: torch.Tensor,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    all_tail: bool,
) -> Choice | None:
    """The tokens to recompute among `candidates`; None for none."""
    total = candidates.numel()
    everything = torch.arange(total, device=candidates.device)
    if spec.kind is RecomputeKind.PREFIX:
        return Choice(everything)
    count = chosen_count(spec, total)  # auto decides below
    if spec.kind is not RecomputeKind.AUTO and count in (0, total):
        return Choice(everything) if count else None
    blocks = plan.lengths[1:]  # every chunk token is a candidate of `selective` and `query`: blocks in order
    if spec.kind is RecomputeKind.QUERY:
        scores = question_attention(forward, buffer, plan, question_ids)[candidates]
        return Choice(top_share(scores, count, blocks, spec.floor))
    # Layer 0 of every candidate under full attention: the first layer where cached and full K/V can differ.
    cos, sin = cos_sin[0][candidates], cos_sin[1][candidates]
    hidden = forward.decoder.embed_tokens(ids[candidates].unsqueeze(0))
    hidden = _layer(forward, 0, buffer, hidden, candidates, (cos, sin), write=False, tail=all_tail)
    # Fresh keys compared with stitched ones carry the stitch's factor too (folded into cos and sin: keys alone).
    key_scale = _chunk_key_scale(plan)
    keys_cos_sin = (cos, sin) if key_scale == 1.0 else (cos * key_scale, sin * key_scale)
    if spec.kind is RecomputeKind.AUTO:
        attention = question_attention(forward, buffer, plan, question_ids)[candidates]
        deviation = layer1_deviation(forward, buffer, hidden, candidates, keys_cos_sin)
        return Choice(auto_choice(attention, deviation, spec.amount).chosen, hidden)
    change, _ = layer1_change(forward, buffer, hidden, candidates, keys_cos_sin)
    return Choice(top_share(change, count, blocks, spec.floor), hidden)


def _is_tail(slots: torch.Tensor, end: int) -> bool:
    """Whether host `slots` are exactly end - T .. end - 1: every chunk token chosen (after one prefix block)."""
    count = slots.numel()
    return count > 0 and int(slots[0]) == end - count and int(slots[-1]) == end - 1


def candidate_slots(plan: StitchPlan, spec: RecomputeSpec) -> torch.Tensor:
    """Buffer slots [T] (ascending) `spec` may recompute: the first N of every chunk block for `prefix:N`, every
    chunk token for `selective`, `query` and `auto`, none for `none`. Block 0 (the template prefix) is exact and
    never a candidate."""
    if not spec.active:
        return torch.empty(0, dtype=torch.long)
    limit = int(spec.amount) if spec.kind is RecomputeKind.PREFIX else max(plan.lengths, default=0)
    parts = [torch.arange(s, s + min(limit, n)) for s, n in zip(plan.slots[1:], plan.lengths[1:], strict=True)]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)


# At or above this share of chunk tokens a recompute costs more than the full prefill it approximates (it runs
# eagerly, token slots scattered: ~1.3x a prefill's time per token at 8K on a 7B shape, docs/benchmarks.md).
FULL_PREFILL_SHARE = 0.6


def planned_count(spec: RecomputeSpec, block_lengths: Sequence[int]) -> int | None:
    """How many chunk tokens `spec` will recompute over chunk blocks of these lengths; None where only the request
    decides (`auto`, which recomputes at most `AUTO_MAX_SHARE`)."""
    if not spec.active:
        return 0
    if spec.kind is RecomputeKind.PREFIX:
        return sum(min(int(spec.amount), n) for n in block_lengths)
    if spec.kind is RecomputeKind.AUTO:
        return None
    return chosen_count(spec, sum(block_lengths))


def full_prefill_is_cheaper(spec: RecomputeSpec, block_lengths: Sequence[int], context: int, short: int) -> bool:
    """Whether to serve `spec` by a full prefill instead (exact, and faster): a context under `short` tokens (where
    the eager recompute's fixed cost outweighs a whole prefill), or a plan recomputing `FULL_PREFILL_SHARE` of the
    chunk tokens or more."""
    if not spec.active:
        return False
    if context < short:
        return True
    planned = planned_count(spec, block_lengths)
    return planned is not None and planned >= FULL_PREFILL_SHARE * sum(block_lengths)


def chosen_count(spec: RecomputeSpec, candidates: int) -> int:
    """How many of the candidates are recomputed: all for `prefix`, the share R (rounded half up) for `selective`
    and `query` (`auto` decides per request)."""
    if spec.kind in (RecomputeKind.SELECTIVE, RecomputeKind.QUERY):
        return min(candidates, int(spec.amount * candidates + 0.5))
    return candidates


def _layer(
    forward: LeanForward,
    index: int,
    buffer: KVBuffer,
    hidden: torch.Tensor,
    slots: torch.Tensor,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    write: bool,
    tail: bool,
    key_scale: float = 1.0,
    groups: Sequence[SlotGroup] = (),
    kernel: bool = False,
) -> torch.Tensor:
    """Layer `index` for the tokens at `slots` (`hidden` [1, T, hidden]) over the buffer's context; with `write`
    their fresh K/V replace the cached ones first, so they attend to themselves and to each other as recomputed.
    `tail`: the slots are the context's last T (one end-aligned causal kernel, no mask). The lean forward's own
    per-layer pieces keep the arithmetic that of `extend`. `key_scale`: the stitch's factor on chunk keys, which
    the written keys carry too. `groups`: `attention.slot_groups` of `slots` (scattered slots, SDPA's path only).
    `kernel`: scattered slots go to `slot_attention`'s kernel instead of masked SDPA."""
    layer = forward.layers[index]
    q = _write_kv(forward, index, buffer, hidden, slots, cos_sin, key_scale, write)
    keys, values, scale = (
        buffer.keys(index, buffer.length),
        buffer.values(index, buffer.length),
        layer.self_attn.scaling,
    )
    if tail:
        out = attend_causal_end(q, keys.unsqueeze(0), values.unsqueeze(0), scale)
    elif kernel:
        out = attend_slots_kernel(q, keys, values, slots, scale)
    else:
        out = attend_at_slots(q, keys, values, slots, scale, groups)
    return forward._finish_layer(layer, hidden, out)


def _write_kv(
    forward: LeanForward,
    index: int,
    buffer: KVBuffer,
    hidden: torch.Tensor,
    slots: torch.Tensor,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    key_scale: float,
    write: bool,
) -> torch.Tensor:
    """Layer `index`'s projections of the tokens at `slots`, rotated; with `write` their K/V replace the cached
    ones (keys times the stitch's `key_scale`). Returns the rotated queries [1, H, T, D]."""
    layer = forward.layers[index]
    q, k, v = forward._project(layer, layer.input_layernorm(hidden))
    q, k = Rotary.apply(q, *cos_sin), Rotary.apply(k, *cos_sin)
    if write:
        buffer.data[index, KEYS].index_copy_(1, slots, k[0] if key_scale == 1.0 else (k[0] * key_scale).to(k.dtype))
        buffer.data[index, VALUES].index_copy_(1, slots, v[0])
    return q


def _check(buffer: KVBuffer, plan: StitchPlan, context_ids: Sequence[int]) -> None:
    if len(context_ids) != plan.context_tokens:
        raise ValueError(f"{len(context_ids)} context ids for a stitch plan of {plan.context_tokens} tokens")
    if buffer.length != plan.context_tokens:
        # After the question the question's KV would be stale; before the stitch there is nothing to attend to.
        raise ValueError(
            f"recompute needs the stitched context alone ({plan.context_tokens} tokens), not {buffer.length}"
        )
