"""The Triton kernel behind `lse_merge.merge_split`: imported only where triton exists (see `lse_merge._kernel`).

No `from __future__ import annotations` here: Triton reads the `tl.constexpr` annotations as objects.
"""

import triton
import triton.language as tl


@triton.jit  # type: ignore[untyped-decorator]
def merge_split_kernel(  # type: ignore[no-untyped-def]
    context_out_ptr,
    context_lse_ptr,
    own_out_ptr,
    own_lse_ptr,
    out_ptr,
    tokens,
    heads,
    context_stride_t,
    context_stride_h,
    own_stride_t,
    own_stride_h,
    out_stride_t,
    out_stride_h,
    context_lse_stride_h,
    own_lse_stride_h,
    splits: tl.constexpr,
    head_dim: tl.constexpr,
    dim_p2: tl.constexpr,
    block_h: tl.constexpr,
):
    """One program: query token t, block_h of its heads. Merges the `splits` context partials (query s * tokens +
    t of `context_out`, laid out part after part) and the own (causal) partial by their log-sum-exp, in fp32.

    Log-sum-exps are flash-attention's flat layout [heads, queries]; an empty key range reports +inf with a zero
    output and weighs nothing. The own part always holds the query's own key, so the maximum is finite. Parts are
    summed in the order torch's merge sums them (context ranges, then own), so both paths round alike.
    """
    t = tl.program_id(0)
    h = tl.program_id(1) * block_h + tl.arange(0, block_h)
    d = tl.arange(0, dim_p2)
    live_h = h < heads
    mask = live_h[:, None] & (d < head_dim)[None, :]

    own_lse = tl.load(own_lse_ptr + h * own_lse_stride_h + t, mask=live_h, other=0.0)
    peak = own_lse
    for s in tl.static_range(splits):
        lse = tl.load(context_lse_ptr + h * context_lse_stride_h + s * tokens + t, mask=live_h, other=0.0)
        peak = tl.maximum(peak, tl.where(lse == float("inf"), float("-inf"), lse))

    acc = tl.zeros((block_h, dim_p2), dtype=tl.float32)
    total = tl.zeros((block_h,), dtype=tl.float32)
    for s in tl.static_range(splits):
        lse = tl.load(context_lse_ptr + h * context_lse_stride_h + s * tokens + t, mask=live_h, other=0.0)
        weight = tl.exp(tl.where(lse == float("inf"), float("-inf"), lse) - peak)
        rows = (s * tokens + t) * context_stride_t + h * context_stride_h
        part = tl.load(context_out_ptr + rows[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)
        acc += part * weight[:, None]
        total += weight
    weight = tl.exp(own_lse - peak)
    own_rows = t * own_stride_t + h * own_stride_h
    part = tl.load(own_out_ptr + own_rows[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)
    acc += part * weight[:, None]
    total += weight

    out_rows = t * out_stride_t + h * out_stride_h
    merged = acc / tl.where(live_h, total, 1.0)[:, None]
    tl.store(out_ptr + out_rows[:, None] + d[None, :], merged.to(out_ptr.dtype.element_ty), mask=mask)
