"""The Triton kernels behind `segment_launch`: imported only where triton exists (see `segment_launch._kernels`).

No `from __future__ import annotations` here: Triton reads the `tl.constexpr` annotations as objects.
"""

from typing import Any

import torch
import triton
import triton.language as tl

from service.engine._softmax_tile import attend_key_range, finished_partial, rope_rows

# A tile row is segment_plan.TILE_COLUMNS = 5 int64s: key range start and length, the group's first pair and
# pair count, and which block of the group's query items it takes.


@triton.jit  # type: ignore[untyped-decorator]
def segment_partials_kernel(  # type: ignore[no-untyped-def]
    q_ptr,
    cos_ptr,
    sin_ptr,
    kv_ptr,
    tiles_ptr,
    count_ptr,
    q_rows_ptr,
    pair_q_ptr,
    pair_visible_ptr,
    out_ptr,
    lse_ptr,
    q_stride_t,
    q_stride_h,
    table_stride,
    kv_stride_kv,
    kv_stride_h,
    kv_stride_t,
    out_stride_p,
    out_stride_h,
    lse_stride_p,
    qk_scale,
    group: tl.constexpr,
    head_dim: tl.constexpr,
    dim_p2: tl.constexpr,
    block_m: tl.constexpr,
    block_n: tl.constexpr,
    ieee: tl.constexpr,
    prerotated: tl.constexpr = False,
    kv_desc=None,
):
    """Programs (grid axis 0) take the launch's live tiles (the first count_ptr[0] rows) in turn, one KV head each
    (axis 1): one tile a program where the grid holds a program per tile; a padded plan's smaller grid loops."""
    kv_head = tl.program_id(1)
    n_tiles = tl.load(count_ptr).to(tl.int32)
    for tile in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        _segment_tile(
            tile,
            kv_head,
            q_ptr,
            cos_ptr,
            sin_ptr,
            kv_ptr,
            tiles_ptr,
            q_rows_ptr,
            pair_q_ptr,
            pair_visible_ptr,
            out_ptr,
            lse_ptr,
            q_stride_t,
            q_stride_h,
            table_stride,
            kv_stride_kv,
            kv_stride_h,
            kv_stride_t,
            out_stride_p,
            out_stride_h,
            lse_stride_p,
            qk_scale,
            group,
            head_dim,
            dim_p2,
            block_m,
            block_n,
            ieee,
            prerotated,
            kv_desc,
        )


@triton.jit  # type: ignore[untyped-decorator]
def _segment_tile(  # type: ignore[no-untyped-def]
    tile,
    kv_head,
    q_ptr,
    cos_ptr,
    sin_ptr,
    kv_ptr,
    tiles_ptr,
    q_rows_ptr,
    pair_q_ptr,
    pair_visible_ptr,
    out_ptr,
    lse_ptr,
    q_stride_t,
    q_stride_h,
    table_stride,
    kv_stride_kv,
    kv_stride_h,
    kv_stride_t,
    out_stride_p,
    out_stride_h,
    lse_stride_p,
    qk_scale,
    group: tl.constexpr,
    head_dim: tl.constexpr,
    dim_p2: tl.constexpr,
    block_m: tl.constexpr,
    block_n: tl.constexpr,
    ieee: tl.constexpr,
    prerotated: tl.constexpr,
    kv_desc,
):
    """One tile (one key range, a block of the queries that read it) and one KV head.

    A tile's queries are `block_m` (pair, query head) items: pair p of the tile's group, query head
    kv_head * group + g. Pair p reads query entry e = pair_q[p]: row q_rows[e] of the unrotated q, rotated here in
    fp32 by the cos/sin rows e (the model's own tables, RoPE's rotate-half form) and cast to the keys' dtype once,
    as `Rotary.apply` does. Every K/V tile of the range is loaded once for all of them (the GQA heads of the KV head
    and every request reading the range), online softmax in base 2 (`qk_scale` carries log2(e)); item i sees
    keys 0 .. visible[pair] - 1 of the range (the whole chunk, or a causal prefix of a tail). Writes the pair's
    output (in the output buffer's dtype) and fp32 natural log-sum-exp; a pair that sees no key writes zeros and
    -inf. `prerotated`: q holds each entry's rotated query instead (`rotate_entries_kernel`, row e = entry e), read
    as it is. `kv_desc` (not None): the K/V tiles come through this descriptor of kv as rows of D
    (`attend_key_range`; kv contiguous).
    """
    row = tiles_ptr + tile * 5
    # Indices in int32 (every block offset below fits): 64-bit offset tensors double the registers of each tile's
    # pointers. Only the range's start goes 64-bit, into a scalar base pointer.
    kv_start = tl.load(row)
    kv_len = tl.load(row + 1).to(tl.int32)
    first_pair = tl.load(row + 2).to(tl.int32)
    n_pairs = tl.load(row + 3).to(tl.int32)
    block = tl.load(row + 4).to(tl.int32)

    item = block * block_m + tl.arange(0, block_m)
    live = item < n_pairs * group
    pair = first_pair + item // group
    head = kv_head * group + item % group
    d = tl.arange(0, dim_p2)
    d_live = d < head_dim
    entry = tl.load(pair_q_ptr + pair, mask=live, other=0).to(tl.int32)
    visible = tl.load(pair_visible_ptr + pair, mask=live, other=0).to(tl.int32)
    q_mask = live[:, None] & d_live[None, :]
    if prerotated:
        q_base = entry[:, None] * q_stride_t + head[:, None] * q_stride_h
        q = tl.load(q_ptr + q_base + d[None, :], mask=q_mask, other=0.0).to(kv_ptr.dtype.element_ty)
    else:
        q = _rotated_rows(
            q_ptr,
            cos_ptr,
            sin_ptr,
            q_rows_ptr,
            entry,
            head,
            live,
            d,
            q_mask,
            q_stride_t,
            q_stride_h,
            table_stride,
            head_dim,
        )
        q = q.to(kv_ptr.dtype.element_ty)

    m_i = tl.full((block_m,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((block_m,), dtype=tl.float32)
    acc = tl.zeros((block_m, dim_p2), dtype=tl.float32)
    m_i, l_i, acc = attend_key_range(
        q,
        kv_ptr,
        kv_desc,
        kv_head,
        kv_start,
        kv_len,
        visible,
        kv_stride_kv,
        kv_stride_h,
        kv_stride_t,
        d,
        d_live,
        qk_scale,
        m_i,
        l_i,
        acc,
        block_n,
        ieee,
    )

    out, lse = finished_partial(m_i, l_i, acc)
    out_offs = pair[:, None] * out_stride_p + head[:, None] * out_stride_h + d[None, :]
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=live[:, None] & d_live[None, :])
    tl.store(lse_ptr + pair * lse_stride_p + head, lse, mask=live)


@triton.jit  # type: ignore[untyped-decorator]
def _rotated_rows(  # type: ignore[no-untyped-def]
    q_ptr,
    cos_ptr,
    sin_ptr,
    q_rows_ptr,
    entry,
    head,
    live,
    d,
    q_mask,
    q_stride_t,
    q_stride_h,
    table_stride,
    head_dim: tl.constexpr,
):
    """The queries of `entry` x `head` (rows q_rows[entry] of the unrotated q), rotated in fp32 by the entries'
    cos/sin rows (RoPE's rotate-half form, the model's own tables)."""
    q_row = tl.load(q_rows_ptr + entry, mask=live, other=0).to(tl.int32)
    q_base = q_row[:, None] * q_stride_t + head[:, None] * q_stride_h
    half = head_dim // 2
    partner = tl.where(d < half, d + half, d - half)
    x = tl.load(q_ptr + q_base + d[None, :], mask=q_mask, other=0.0)
    x_partner = tl.load(q_ptr + q_base + partner[None, :], mask=q_mask, other=0.0)
    table = entry[:, None] * table_stride + d[None, :]
    cos = tl.load(cos_ptr + table, mask=q_mask, other=0.0)
    sin = tl.load(sin_ptr + table, mask=q_mask, other=0.0)
    return rope_rows(x, x_partner, cos, sin, d < half)


@triton.jit  # type: ignore[untyped-decorator]
def rotate_entries_kernel(  # type: ignore[no-untyped-def]
    q_ptr,
    cos_ptr,
    sin_ptr,
    q_rows_ptr,
    out_ptr,
    entries,
    q_stride_t,
    q_stride_h,
    table_stride,
    out_stride_e,
    out_stride_h,
    head_dim: tl.constexpr,
    dim_p2: tl.constexpr,
    block_e: tl.constexpr,
):
    """One program: `block_e` query entries, one query head (axis 1). Writes each entry's rotated query (as the
    partials kernel rotates it, cast to out's dtype) to out[entry, head], so that the partials kernel's tiles read
    one row per query item instead of the query, its rotation partner and two fp32 table rows."""
    head = tl.program_id(1)
    entry = tl.program_id(0) * block_e + tl.arange(0, block_e)
    live = entry < entries
    d = tl.arange(0, dim_p2)
    mask = live[:, None] & (d < head_dim)[None, :]
    heads = tl.zeros((block_e,), dtype=tl.int32) + head
    q = _rotated_rows(
        q_ptr, cos_ptr, sin_ptr, q_rows_ptr, entry, heads, live, d, mask, q_stride_t, q_stride_h, table_stride, head_dim
    )
    out = out_ptr + entry[:, None] * out_stride_e + head * out_stride_h + d[None, :]
    tl.store(out, q.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit  # type: ignore[untyped-decorator]
def segment_merge_kernel(  # type: ignore[no-untyped-def]
    part_out_ptr,
    part_lse_ptr,
    row_ptr_ptr,
    row_parts_ptr,
    row_tail_ptr,
    out_ptr,
    heads,
    part_stride_p,
    part_stride_h,
    lse_stride_p,
    out_stride_t,
    out_stride_h,
    context_scale,
    head_dim: tl.constexpr,
    dim_p2: tl.constexpr,
    block_h: tl.constexpr,
):
    """One program: query row r, block_h of its heads. Merges the row's chunk partials (row_parts[row_ptr[r] ..
    row_ptr[r + 1]]) into the context's by log-sum-exp, multiplies the context's log-sum-exp by `context_scale`
    (APE's S), then merges it with the row's tail partial (row_tail[r]; -1: none, a padded row), all in fp32."""
    r = tl.program_id(0)
    h = tl.program_id(1) * block_h + tl.arange(0, block_h)
    d = tl.arange(0, dim_p2)
    live_h = h < heads
    mask = live_h[:, None] & (d < head_dim)[None, :]
    lo = tl.load(row_ptr_ptr + r).to(tl.int32)
    hi = tl.load(row_ptr_ptr + r + 1).to(tl.int32)

    peak = tl.full((block_h,), float("-inf"), dtype=tl.float32)
    for i in range(lo, hi):
        part = tl.load(row_parts_ptr + i)
        peak = tl.maximum(peak, tl.load(part_lse_ptr + part * lse_stride_p + h, mask=live_h, other=float("-inf")))
    safe = tl.where(peak == float("-inf"), 0.0, peak)
    acc = tl.zeros((block_h, dim_p2), dtype=tl.float32)
    total = tl.zeros((block_h,), dtype=tl.float32)
    for i in range(lo, hi):
        part = tl.load(row_parts_ptr + i)
        lse = tl.load(part_lse_ptr + part * lse_stride_p + h, mask=live_h, other=float("-inf"))
        weight = tl.exp(lse - safe)
        offs = part * part_stride_p + h[:, None] * part_stride_h + d[None, :]
        acc += tl.load(part_out_ptr + offs, mask=mask, other=0.0).to(tl.float32) * weight[:, None]
        total += weight

    has_context = total > 0
    context_out = acc / tl.where(has_context, total, 1.0)[:, None]
    context_lse = tl.where(has_context, safe + tl.log(tl.where(has_context, total, 1.0)), float("-inf"))
    context_lse = context_lse * context_scale
    tail = tl.load(row_tail_ptr + r)
    has_tail = live_h & ((tail + h * 0) >= 0)  # as a block: a scalar mask does not broadcast everywhere
    tail_lse = tl.load(part_lse_ptr + tail * lse_stride_p + h, mask=has_tail, other=float("-inf"))
    tail_offs = tail * part_stride_p + h[:, None] * part_stride_h + d[None, :]
    tail_out = tl.load(part_out_ptr + tail_offs, mask=has_tail[:, None] & mask, other=0.0).to(tl.float32)
    top = tl.maximum(context_lse, tail_lse)
    top = tl.where(top == float("-inf"), 0.0, top)
    w_context = tl.exp(context_lse - top)
    w_tail = tl.exp(tail_lse - top)
    total_w = w_context + w_tail  # 0 only on a dead row of a padded plan, whose output is zero
    merged = (context_out * w_context[:, None] + tail_out * w_tail[:, None]) / tl.where(total_w > 0, total_w, 1.0)[
        :, None
    ]
    out_offs = r * out_stride_t + h[:, None] * out_stride_h + d[None, :]
    tl.store(out_ptr + out_offs, merged.to(out_ptr.dtype.element_ty), mask=mask)


def kv_descriptor(kv: torch.Tensor, block_n: int, dim_p2: int) -> Any:
    """A host tensor descriptor of kv [2, Hkv, slots, D] (contiguous) as rows of D, tiles of block_n rows; None
    where this triton has no tensor descriptors."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        return None
    return TensorDescriptor.from_tensor(kv.view(-1, kv.shape[-1]), [block_n, dim_p2])
