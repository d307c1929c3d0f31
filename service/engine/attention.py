"""Attention kernels, all in one place: the eager path (flash-attn when it imports and fits, torch SDPA
otherwise), and the backends the CUDA graphs attend with over a full-capacity buffer (flash varlen with
`seqused_k`, split-KV flash for prefills, masked SDPA), with the start-up probe that picks between them.

Eager: one shape of attention covers the whole engine: the queries are the last `Tq` of `Tk` keys and see every key up
to their own position ("causal, aligned to the end"). Precompute is the case Tq == Tk (right-padded batches
stay exact because padding only ever follows real tokens); question prefill over a stitched cache is Tq < Tk;
a decode step is Tq == 1.
"""

from __future__ import annotations

import importlib
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from service.engine.kv_layout import ModelSpec
from service.engine.lse_merge import fused_merge, fused_merge_applies

log = logging.getLogger(__name__)

# Attention of T queries q [T, Hq, D] (rotated, written at contiguous slots) over one layer's full-capacity keys
# and values [Hkv, C, D] with `scale`; returns [T, Hq, D]. The caller decides which slots each query sees (the
# live context and, causally, the queries up to itself).
StaticAttend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]

FLASH_VARLEN = "flash_varlen"
SDPA_MASK = "sdpa_mask"
ATTENTION_BACKENDS = (FLASH_VARLEN, SDPA_MASK)
# A prefill's attention over the context is split into this many key ranges run side by side and merged by
# their log-sum-exp (flash-decoding's split-KV): one causal call runs one thread block per head and query tile,
# a few dozen for a question on a GPU of 132 SMs, and each walks the whole context alone.
PREFILL_KV_SPLITS = 8
# The batched prefill (several requests' new tokens, `extend_split`) splits each request's context the same way
# while its new tokens are few: flash-attention 2 splits keys over thread blocks only for one query per row, so
# otherwise a few questions over long contexts leave most SMs idle while each block walks a whole context.
# Above `EXTEND_SPLIT_TOKENS` new tokens the query blocks fill more of the GPU: fewer ranges, then none.
EXTEND_KV_SPLITS = 8
EXTEND_SPLIT_TOKENS = 256
# Agreement between the two attention backends on the start-up probe: both are bf16 kernels with fp32
# softmax; measured differences are a few bf16 ulps of outputs of size ~1, a wrong length is off by ~0.1.
_PROBE_TOLERANCE = 2e-2


def _import_flash() -> Callable[..., Any] | None:
    try:
        module = importlib.import_module("flash_attn")
    except Exception:  # flash-attn is optional; any import failure means "not available"
        return None
    return getattr(module, "flash_attn_func", None)


_FLASH_ATTN_FUNC = _import_flash()


def flash_available() -> bool:
    """Whether the flash-attn package imported in this process."""
    return _FLASH_ATTN_FUNC is not None


def backend_for(q: torch.Tensor) -> str:
    """The kernel `attend_causal_end` will use for tensors like q."""
    if _FLASH_ATTN_FUNC is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        return "flash_attn"
    return "sdpa"


def _end_aligned_mask(tq: int, tk: int, device: torch.device) -> torch.Tensor:
    """Bool [Tq, Tk]: query i may see key j iff j <= (Tk - Tq) + i."""
    rows = torch.arange(tq, device=device).unsqueeze(1) + (tk - tq)
    cols = torch.arange(tk, device=device).unsqueeze(0)
    return cols <= rows


def attend_causal_end(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of q [B, Hq, Tq, D] over k, v [B, Hkv, Tk, D], end-aligned causal; returns [B, Tq, Hq, D]."""
    tq, tk = q.shape[-2], k.shape[-2]
    if tq > tk:
        raise ValueError(f"{tq} queries cannot be the tail of {tk} keys")
    if backend_for(q) == "flash_attn":
        assert _FLASH_ATTN_FUNC is not None
        # flash-attn >= 2.1 aligns the causal mask to the bottom-right corner, which is exactly this shape.
        out = _FLASH_ATTN_FUNC(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True, softmax_scale=scale
        )
        return out  # type: ignore[no-any-return]
    gqa = q.shape[1] != k.shape[1]
    if tq == 1:
        out = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa)
    elif tq == tk:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        mask = _end_aligned_mask(tq, tk, q.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2)


# A recompute's scattered queries go to the kernel in up to this many groups of at least this many queries: each
# group reads the keys up to its own last slot, not the whole context (the masked kernel skips no masked key), so
# at an even spread four groups read ~62 % of the keys one call would, for three more launches per layer.
SLOT_GROUPS = 4
SLOT_GROUP_MIN_QUERIES = 256


@dataclass(frozen=True)
class SlotGroup:
    """Queries `start:end` of a recompute (slots ascending) and the keys they read: slots `0:keys`."""

    start: int
    end: int
    keys: int


def slot_groups(
    slots: Sequence[int], groups: int = SLOT_GROUPS, min_queries: int = SLOT_GROUP_MIN_QUERIES
) -> tuple[SlotGroup, ...]:
    """Host `slots` (ascending) split into at most `groups` runs of near-equal size, none under `min_queries`
    (one run when there are few): computed once per recompute, so no layer waits on the device for them."""
    count = len(slots)
    parts = max(1, min(groups, count // max(min_queries, 1)))
    bounds = [round(i * count / parts) for i in range(parts + 1)]
    return tuple(SlotGroup(a, b, int(slots[b - 1]) + 1) for a, b in itertools.pairwise(bounds) if b > a)


def attend_at_slots(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
    groups: Sequence[SlotGroup] = (),
) -> torch.Tensor:
    """Attention of q [1, Hq, T, D] for tokens sitting at buffer `slots` [T] (ascending, not contiguous) over one
    layer's keys and values [Hkv, Tk, D]: each query sees the keys at slots up to its own. Returns [1, T, Hq, D].

    The recompute's shape: a few tokens scattered through a stitched context, each causal over what precedes it.
    `groups` (`slot_groups` of the same slots; default one group over every key) bound the keys each run of
    queries reads. The KV heads are repeated rather than passed as `enable_gqa`, which keeps SDPA on its fused
    kernels with a mask.
    """
    group = q.shape[1] // keys.shape[0]
    k = keys.repeat_interleave(group, dim=0).unsqueeze(0)
    v = values.repeat_interleave(group, dim=0).unsqueeze(0)
    runs = groups or (SlotGroup(0, slots.numel(), keys.shape[-2]),)
    outs = []
    for run in runs:
        visible = torch.arange(run.keys, device=q.device).unsqueeze(0) <= slots[run.start : run.end].unsqueeze(1)
        qs, ks, vs = q[:, :, run.start : run.end], k[:, :, : run.keys], v[:, :, : run.keys]
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=visible, scale=scale))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.transpose(1, 2)


# ---- attention over a full-capacity buffer ---------------------------------------------------------------


def _sdpa_masked(mask: torch.Tensor) -> StaticAttend:
    """SDPA with an additive mask (0 for visible slots, -inf elsewhere) over the whole capacity C.

    The query heads of one KV group share their keys, so they go in as that group's G * T "query tokens":
    q [1, Hkv, G * T, D] against k, v [1, Hkv, C, D] reads each key once and needs no GQA expansion. `mask` is
    [1, 1, 1, C] for one query (broadcast) or [1, 1, G * T, C] (row g * T + t is query t's row).
    """

    def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
        tokens, heads, dim = q.shape
        kv_heads = keys.shape[0]
        group = heads // kv_heads
        grouped = q.reshape(tokens, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(1, kv_heads, -1, dim)
        out = F.scaled_dot_product_attention(grouped, keys.unsqueeze(0), values.unsqueeze(0), mask, scale=scale)
        return out.view(kv_heads, group, tokens, dim).permute(2, 0, 1, 3).reshape(tokens, heads, dim)

    return attend


def flash_varlen(
    cu_q: torch.Tensor, cu_k: torch.Tensor, used: torch.Tensor, tokens: int, capacity: int
) -> StaticAttend:
    """flash-attention's variable-length kernel with `seqused_k`: only the live keys are read at all.

    With several queries it runs causal, which flash aligns to the bottom-right corner of the *used* keys:
    query t sees keys 0 .. used - tokens + t, i.e. the context and the question up to itself.
    `torch.ops.aten._flash_attention_forward` is a private op; `resolve_attention` checks it against the SDPA
    path on the device (one query and several) before a graph uses it, and falls back when it is missing or
    disagrees.
    """

    def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
        out: torch.Tensor = torch.ops.aten._flash_attention_forward(
            q,
            keys.transpose(0, 1),
            values.transpose(0, 1),
            cu_q,
            cu_k,
            tokens,
            capacity,
            0.0,
            tokens > 1,
            False,
            scale=scale,
            seqused_k=used,
        )[0]
        return out

    return attend


def _flash(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    causal: bool,
    scale: float,
    used_k: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """flash varlen over keys/values [total_k, Hkv, D]; returns the output [total_q, H, D] and its fp32 log-sum-exp.
    `used_k`: each sequence's key count (seqused_k; its keys start at cu_k, which then need not increase)."""
    result = torch.ops.aten._flash_attention_forward(
        q, keys, values, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale, seqused_k=used_k
    )
    return result[0], result[1]


def _merge(outs: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Partial attentions `outs` [P, T, H, D] over disjoint key ranges merged by their log-sum-exp `lse` [P, T, H]
    (-inf: an empty range, weighing nothing; one range per query must be non-empty), in fp32."""
    weights = torch.exp(lse - lse.amax(dim=0, keepdim=True)).unsqueeze(-1)
    return ((outs.float() * weights).sum(dim=0) / weights.sum(dim=0)).to(outs.dtype)


def _merge_split(
    context: tuple[torch.Tensor, torch.Tensor],
    own: tuple[torch.Tensor, torch.Tensor],
    splits: int,
    lse_parts: Callable[[], torch.Tensor],
) -> torch.Tensor:
    """A split prefill's attention: the context ranges' (output [splits * T, H, D], flash log-sum-exp) and the
    own causal part's (output [T, H, D], log-sum-exp) merged, by the Triton kernel where it applies
    (`lse_merge`), else by `_merge` over `lse_parts()` ([splits + 1, T, H] in torch's layout). Each query's own
    part holds at least itself, so every query has a finite maximum."""
    if fused_merge_applies(*context, *own, splits):
        return fused_merge(*context, *own, splits)
    own_out = own[0]
    total, heads, dim = own_out.shape
    outs = torch.cat((context[0].view(splits, total, heads, dim), own_out.view(1, total, heads, dim)))
    return _merge(outs, lse_parts())


def _lse_rows(lse: torch.Tensor, parts: int, tokens: int, heads: int) -> torch.Tensor:
    """flash's log-sum-exp as [parts, tokens, heads], whichever layout this build returns: [heads, total_q]
    (newer flash-attention) or [batch, heads, max_q] (older). An empty key range reports +inf with a zero
    output; it must weigh nothing, so it becomes -inf."""
    flat = lse.dim() == 2
    rows = lse.view(heads, parts, tokens).permute(1, 2, 0) if flat else lse[:, :, :tokens].permute(0, 2, 1)
    return rows.masked_fill(rows == float("inf"), float("-inf"))


def _flash_split(
    cu_parts: torch.Tensor,
    cu_context: torch.Tensor,
    cu_q: torch.Tensor,
    cu_own: torch.Tensor,
    tokens: int,
    capacity: int,
    splits: int,
) -> StaticAttend:
    """A prefill's attention as `splits` non-causal context ranges plus the causal question-over-itself part,
    each a flash varlen "sequence" of the same call shape, merged by log-sum-exp in fp32.

    `cu_context` [splits + 1] holds the range boundaries over slots 0..start (the live context), `cu_own`
    [start, start + tokens] the question's own slots; both are computed inside the graph from the slots.
    """

    def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
        heads, dim = q.shape[1], q.shape[2]
        k, v = keys.transpose(0, 1), values.transpose(0, 1)
        repeated = q.unsqueeze(0).expand(splits, tokens, heads, dim).reshape(splits * tokens, heads, dim)
        context_out, context_lse = _flash(repeated, k, v, cu_parts, cu_context, tokens, capacity, False, scale)
        own_out, own_lse = _flash(q, k, v, cu_q, cu_own, tokens, tokens, True, scale)
        return _merge_split(
            (context_out, context_lse),
            (own_out, own_lse),
            splits,
            lambda: torch.cat((_lse_rows(context_lse, splits, tokens, heads), _lse_rows(own_lse, 1, tokens, heads))),
        )

    return attend


def extend_splits(tokens: int) -> int:
    """Context key ranges for a batched prefill of `tokens` new tokens in all (1: one causal flash call). Splitting
    pays while the query tiles alone leave the GPU idle (8 ranges took one 122-token question over 8K from 13.4 to
    10.0 ms); as the tokens grow the tiles fill it and the extra ranges and their merge cost more than they save."""
    if tokens <= EXTEND_SPLIT_TOKENS:
        return EXTEND_KV_SPLITS
    return EXTEND_KV_SPLITS // 2 if tokens <= 2 * EXTEND_SPLIT_TOKENS else 1


def extend_split(
    cu_q: torch.Tensor,
    starts: torch.Tensor,
    used: torch.Tensor,
    bounds: tuple[int, int],
    pool_slots: int,
    splits: int,
) -> StaticAttend:
    """Several requests' new tokens (row r's are queries cu_q[r]..cu_q[r+1], cu_q[-1] of them in all) after each
    one's live context in the pool (row r's slab starts at starts[r] with used[r] live slots, its new tokens the
    last ones): every row's context as `splits` non-causal key ranges, plus its new tokens over themselves
    (causal), merged by log-sum-exp as `_flash_split` does for one request. `bounds`: upper bounds of any row's
    new tokens and live slots. Ranges and indices are built here, once per forward and on the device (a CUDA
    graph captures them); `cu_q`'s length and the query count are the only shapes they depend on."""
    cu, rows = cu_q.long(), starts.shape[0]
    new = cu[1:] - cu[:-1]
    context = used.long() - new
    part = torch.arange(splits + 1, device=cu.device)
    edges = starts.long() + torch.div(context * part.unsqueeze(1), splits, rounding_mode="floor")  # [S + 1, R]
    end = cu.new_full((1,), pool_slots)
    # Range s of row r is sequence s * R + r; its keys start at edges[s, r] and number edges[s + 1, r] - edges[s, r].
    cu_ranges = torch.cat((edges[:-1].reshape(-1), end)).to(torch.int32)
    range_used = (edges[1:] - edges[:-1]).reshape(-1).to(torch.int32)
    own_starts = torch.cat((starts.long() + context, end)).to(torch.int32)
    own_cu, own_used = cu.to(torch.int32), new.to(torch.int32)
    max_q, max_k = bounds
    indices: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def by_token(total: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """For `total` queries: cu_q of the repeated queries, each repeated query's sequence [S, T] and row and
        index within its sequence [T] (the first layer builds them, the others reuse them)."""
        if total not in indices:
            token = torch.arange(total, device=cu.device)
            row_of = torch.searchsorted(cu[1:], token, right=True)
            repeated_cu = torch.cat(
                ((part[:-1].unsqueeze(1) * total + cu[:-1]).reshape(-1), end.new_full((1,), splits * total))
            )
            entry = part[:-1].unsqueeze(1) * rows + row_of
            indices[total] = (repeated_cu.to(torch.int32), entry, row_of, token - cu[row_of])
        return indices[total]

    def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
        total, heads, dim = q.shape
        repeated_cu, entry, row_of, offset = by_token(total)
        k, v = keys.transpose(0, 1), values.transpose(0, 1)
        repeated = q.unsqueeze(0).expand(splits, total, heads, dim).reshape(splits * total, heads, dim)
        ranges = (repeated_cu, cu_ranges, max_q, max_k, False, scale, range_used)
        context_out, context_lse = _flash(repeated, k, v, *ranges)
        own_out, own_lse = _flash(q, k, v, own_cu, own_starts, max_q, max_q, True, scale, own_used)
        return _merge_split(
            (context_out, context_lse),
            (own_out, own_lse),
            splits,
            lambda: torch.cat(
                (
                    _lse_by_token(context_lse, splits, entry, offset),
                    _lse_by_token(own_lse, 1, row_of.unsqueeze(0), offset),
                )
            ),
        )

    return attend


def _lse_by_token(lse: torch.Tensor, parts: int, entry: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """flash's log-sum-exp as [parts, T, heads] for queries laid out part after part: [heads, parts * T] (newer
    flash-attention) or [sequences, heads, max_q] (older; query t of part p is row offset[t] of sequence
    entry[p, t]). An empty key range reports +inf with a zero output; it must weigh nothing, so it becomes -inf."""
    total = offset.shape[0]
    rows = lse.view(lse.shape[0], parts, total).permute(1, 2, 0) if lse.dim() == 2 else lse[entry, :, offset]
    return rows.masked_fill(rows == float("inf"), float("-inf"))


class LengthInputs:
    """Device tensors that tell the attention which slots are live, derived from the slots inside the graph."""

    def __init__(self, spec: ModelSpec, capacity: int, tokens: int = 1, kv_splits: int = 1) -> None:
        device = spec.device
        self.capacity = capacity
        self.tokens = tokens
        self.kv_splits = kv_splits if tokens > 1 else 1
        self.group = spec.num_heads // spec.num_kv_heads
        self.dtype = spec.dtype
        self.arange = torch.arange(capacity, device=device)
        self.cu_q = torch.tensor([0, tokens], dtype=torch.int32, device=device)
        self.cu_k = torch.tensor([0, capacity], dtype=torch.int32, device=device)
        self.splits = torch.arange(self.kv_splits + 1, device=device)
        self.cu_parts = (self.splits * tokens).to(torch.int32)

    def attend_for(self, backend: str, slots: torch.Tensor) -> StaticAttend:
        """The attention for `tokens` queries written at contiguous `slots` [T]: query t sees slots 0..slots[t]."""
        if backend == FLASH_VARLEN and self.kv_splits > 1:
            start = slots[:1]
            cu_context = torch.div(start * self.splits, self.kv_splits, rounding_mode="floor").to(torch.int32)
            cu_own = torch.cat((start, slots[-1:] + 1)).to(torch.int32)
            return _flash_split(
                self.cu_parts, cu_context, self.cu_q, cu_own, self.tokens, self.capacity, self.kv_splits
            )
        if backend == FLASH_VARLEN:
            used = (slots[-1:] + 1).to(torch.int32)
            return flash_varlen(self.cu_q, self.cu_k, used, self.tokens, self.capacity)
        visible = self.arange.unsqueeze(0) <= slots.unsqueeze(1)  # [T, C]
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=slots.device).masked_fill(~visible, float("-inf"))
        if self.tokens == 1:
            return _sdpa_masked(mask.view(1, 1, 1, -1))
        # One mask per replay (not per layer), repeated for the G query heads of a group stacked as rows.
        return _sdpa_masked(mask.repeat(self.group, 1).unsqueeze(0).unsqueeze(0))


_SPLITS_PROBED: dict[tuple[str, torch.dtype, int, int, int], int] = {}


def prefill_kv_splits(spec: ModelSpec, attention: str) -> int:
    """Key-range splits a flash prefill graph uses: PREFILL_KV_SPLITS when the split path runs and agrees with
    masked SDPA on the probe (empty ranges included), else 1 (one causal flash call); probed once per shape."""
    if attention != FLASH_VARLEN:
        return 1
    key = (str(spec.device), spec.dtype, spec.num_heads, spec.num_kv_heads, spec.head_dim)
    if key not in _SPLITS_PROBED:
        try:
            diff = _probe_flash(spec, PREFILL_KV_SPLITS)
        except Exception as err:  # a refusing private op only means "one range"
            log.info("split-KV flash prefill unavailable (%s); one causal call", err)
            diff = float("inf")
        if not diff <= _PROBE_TOLERANCE:
            log.warning("split-KV flash prefill differs from SDPA by %.4f; one causal call", diff)
        _SPLITS_PROBED[key] = PREFILL_KV_SPLITS if diff <= _PROBE_TOLERANCE else 1
    return _SPLITS_PROBED[key]


def resolve_attention(spec: ModelSpec, requested: str = "auto") -> str:
    """The attention backend a graph uses: `requested`, or for "auto" flash-varlen when it runs and agrees
    with masked SDPA on a random probe (poisoned tail included), else masked SDPA."""
    if requested in ATTENTION_BACKENDS:
        return requested
    if requested != "auto":
        raise ValueError(f"attention backend must be auto or one of {', '.join(ATTENTION_BACKENDS)}")
    if spec.dtype not in (torch.float16, torch.bfloat16):
        return SDPA_MASK
    return flash_if_it_agrees(lambda: _probe_flash(spec), SDPA_MASK, "decode attention")


def flash_if_it_agrees(probe: Callable[[], float], fallback: str, what: str) -> str:
    """FLASH_VARLEN when `probe()` (the largest difference from a reference kernel) runs and stays within the
    tolerance, else `fallback`: a missing or refusing private op, or a wrong answer, only means "use the other"."""
    try:
        diff = probe()
    except Exception as err:
        log.info("flash varlen %s unavailable (%s); using %s", what, err, fallback)
        return fallback
    if not diff <= _PROBE_TOLERANCE:
        log.warning("flash varlen %s differs from the reference by %.4f; using %s", what, diff, fallback)
        return fallback
    return FLASH_VARLEN


@torch.inference_mode()
def _probe_flash(spec: ModelSpec, kv_splits: int = 1, capacity: int = 512) -> float:
    """Largest |flash-varlen - masked SDPA| on random data whose dead tail holds huge values, for one query (a
    decode step) and for several causal queries (a prefill, with `kv_splits` context ranges; a short context
    leaves some ranges empty); q is a strided slice as in `forward_static`."""
    generator = torch.Generator(device=spec.device).manual_seed(0)
    dev, d, heads = spec.device, spec.head_dim, spec.num_heads
    worst = 0.0
    for tokens, live in ((1, 300), (5, 300), (5, 8)):
        kv = torch.randn((2, spec.num_kv_heads, capacity, d), generator=generator, device=dev).to(spec.dtype)
        kv[:, :, live:] = 1e4
        wide = torch.randn((tokens, heads + spec.num_kv_heads, d), generator=generator, device=dev).to(spec.dtype)
        q = wide[:, :heads]
        inputs = LengthInputs(spec, capacity, tokens, kv_splits)
        slots = torch.arange(live - tokens, live, device=dev)
        flash = inputs.attend_for(FLASH_VARLEN, slots)(q, kv[0], kv[1], d**-0.5)
        sdpa = inputs.attend_for(SDPA_MASK, slots)(q, kv[0], kv[1], d**-0.5)
        worst = max(worst, float((flash.float() - sdpa.float()).abs().max()))
    return worst
