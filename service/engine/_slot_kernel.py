"""The Triton kernel behind `slot_attention`: imported only where triton exists (see `slot_attention._kernel`).

No `from __future__ import annotations` here: Triton reads the `tl.constexpr` annotations as objects.
"""

import triton
import triton.language as tl

from service.engine._softmax_tile import online_softmax_step, tile_scores


@triton.jit
def _tile(  # type: ignore[no-untyped-def]
    q, k_base, v_base, n0, kv_stride_t, d, d_live, slot, m_i, l_i, acc, qk_scale, masked, block_n, ieee
):
    """One K/V tile of `block_n` keys from key n0 into the online softmax (base 2) of the block's items."""
    n = n0 + tl.arange(0, block_n)
    kv_offs = n[:, None] * kv_stride_t + d[None, :]
    kv_mask = d_live[None, :]
    if masked:
        kv_mask = kv_mask & (n <= tl.max(slot, 0))[:, None]
    k = tl.load(k_base + kv_offs, mask=kv_mask, other=0.0)
    v = tl.load(v_base + kv_offs, mask=kv_mask, other=0.0)
    s = tile_scores(q, k, ieee) * qk_scale
    if masked:
        s = tl.where(n[None, :] <= slot[:, None], s, float("-inf"))
    return online_softmax_step(s, v, m_i, l_i, acc, ieee)


@triton.jit  # type: ignore[untyped-decorator]
def slot_attention_kernel(  # type: ignore[no-untyped-def]
    q_ptr,
    k_ptr,
    v_ptr,
    slots_ptr,
    out_ptr,
    queries,
    q_stride_t,
    q_stride_h,
    kv_stride_h,
    kv_stride_t,
    out_stride_t,
    out_stride_h,
    qk_scale,
    group: tl.constexpr,
    head_dim: tl.constexpr,
    dim_p2: tl.constexpr,
    block_q: tl.constexpr,
    block_m: tl.constexpr,
    block_n: tl.constexpr,
    ieee: tl.constexpr,
):
    """One program: `block_q` consecutive queries (slots ascending) times the `group` query heads of one KV head,
    as `block_m` items (item i: query i // group, head kv_head * group + i % group). Query t sees the keys at
    slots 0 .. slots[t]. Every K/V tile up to the block's last slot is loaded once for all the items; the tiles
    before the block's first slot are visible to every item and skip the mask. Keys and values share strides.
    Online softmax in base 2 (`qk_scale` carries log2(e)); writes the output in the output buffer's dtype."""
    block = tl.program_id(0)
    kv_head = tl.program_id(1)
    item = tl.arange(0, block_m)
    query = block * block_q + item // group
    live = (item < block_q * group) & (query < queries)
    head = kv_head * group + item % group
    slot = tl.load(slots_ptr + query, mask=live, other=-1).to(tl.int32)
    first = tl.min(tl.where(live, slot, 2147483647), 0)
    d = tl.arange(0, dim_p2)
    d_live = d < head_dim
    q_mask = live[:, None] & d_live[None, :]
    q_offs = query[:, None] * q_stride_t + head[:, None] * q_stride_h + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=q_mask, other=0.0)

    m_i = tl.full((block_m,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((block_m,), dtype=tl.float32)
    acc = tl.zeros((block_m, dim_p2), dtype=tl.float32)
    k_base = k_ptr + kv_head * kv_stride_h
    v_base = v_ptr + kv_head * kv_stride_h
    open_end = (first + 1) // block_n * block_n  # every key before it is visible to every item
    for n0 in range(0, open_end, block_n):
        m_i, l_i, acc = _tile(
            q, k_base, v_base, n0, kv_stride_t, d, d_live, slot, m_i, l_i, acc, qk_scale, False, block_n, ieee
        )
    last = tl.max(slot, 0)
    for n0 in range(open_end, last + 1, block_n):
        m_i, l_i, acc = _tile(
            q, k_base, v_base, n0, kv_stride_t, d, d_live, slot, m_i, l_i, acc, qk_scale, True, block_n, ieee
        )

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_offs = query[:, None] * out_stride_t + head[:, None] * out_stride_h + d[None, :]
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=q_mask)
