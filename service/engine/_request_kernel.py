"""The Triton kernel behind a by-request segment plan (`segment_launch`, question prefill): imported only where
triton exists.

No `from __future__ import annotations` here: Triton reads the `tl.constexpr` annotations as objects.
"""

import triton
import triton.language as tl

from service.engine._softmax_tile import attend_key_range, finished_partial, rope_rows

# A tile row is segment_plan.REQUEST_COLUMNS = 9 int64s: the request's first query row and row count, its first
# rotation entry and segment count, its first segment in the segment table, the split's segments lo .. hi - 1
# (request-local), which block of the request's query items the tile takes, and the split's first pair.


@triton.jit  # type: ignore[untyped-decorator]
def request_partials_kernel(  # type: ignore[no-untyped-def]
    q_ptr,
    cos_ptr,
    sin_ptr,
    kv_ptr,
    tiles_ptr,
    count_ptr,
    segments_ptr,
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
    kv_desc=None,
    prerotated: tl.constexpr = False,
):
    """Programs (grid axis 0) take the launch's live tiles (the first count_ptr[0] rows) in turn, one KV head each
    (axis 1): one tile a program where the grid holds a program per tile; a padded plan's smaller grid loops."""
    kv_head = tl.program_id(1)
    n_tiles = tl.load(count_ptr).to(tl.int32)
    for tile in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        _request_tile(
            tile,
            kv_head,
            q_ptr,
            cos_ptr,
            sin_ptr,
            kv_ptr,
            tiles_ptr,
            segments_ptr,
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
            kv_desc,
            prerotated,
        )


@triton.jit  # type: ignore[untyped-decorator]
def _request_tile(  # type: ignore[no-untyped-def]
    tile,
    kv_head,
    q_ptr,
    cos_ptr,
    sin_ptr,
    kv_ptr,
    tiles_ptr,
    segments_ptr,
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
    kv_desc,
    prerotated: tl.constexpr,
):
    """One tile: a block of one request's query items (row, query head of the KV head) and one KV head, over
    a run of the request's chunk segments, all in one online softmax.

    A prefill's queries are many rows of one request, each reading every chunk of it: grouped by chunk (the
    decode step's kernel) each chunk's few K/V tiles are paid for with a query gather, a rotation and a partial
    written and merged. Here the K/V tiles of all the split's chunks stream through one accumulator; per chunk
    only the queries are rotated again (the request's rows, to m - o + base, by the cos/sin rows of entry
    entry0 + row * segments + j, the model's own tables in fp32, cast to the keys' dtype as `Rotary.apply` does).
    Writes the (row, split) pair's output and fp32 natural log-sum-exp; a pair that saw no key writes zeros and
    -inf. `kv_desc` (not None): the K/V tiles come through this descriptor of kv as rows of D
    (`attend_key_range`). `prerotated`: q holds every entry's rotated query (`rotate_entries_kernel`, row e = entry
    e), read per chunk as it is: no query, partner or fp32 table rows held across the chunks.
    """
    row = tiles_ptr + tile * 9
    n_rows = tl.load(row + 1).to(tl.int32)
    row0 = tl.load(row).to(tl.int32)
    entry0 = tl.load(row + 2).to(tl.int32)
    segments = tl.load(row + 3).to(tl.int32)
    seg0 = tl.load(row + 4).to(tl.int32)
    lo = tl.load(row + 5).to(tl.int32)
    hi = tl.load(row + 6).to(tl.int32)
    block = tl.load(row + 7).to(tl.int32)
    pair0 = tl.load(row + 8).to(tl.int32)

    item = block * block_m + tl.arange(0, block_m)
    live = item < n_rows * group
    local = item // group
    head = kv_head * group + item % group
    d = tl.arange(0, dim_p2)
    d_live = d < head_dim
    q_mask = live[:, None] & d_live[None, :]
    head_offs = head[:, None] * q_stride_h + d[None, :]
    if not prerotated:
        q_base = (row0 + local)[:, None] * q_stride_t + head[:, None] * q_stride_h
        half = head_dim // 2
        partner = tl.where(d < half, d + half, d - half)
        # Kept in q's dtype between chunks (half an fp32 copy's registers); each rotation starts from the same values.
        x = tl.load(q_ptr + q_base + d[None, :], mask=q_mask, other=0.0)
        x_partner = tl.load(q_ptr + q_base + partner[None, :], mask=q_mask, other=0.0)

    m_i = tl.full((block_m,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((block_m,), dtype=tl.float32)
    acc = tl.zeros((block_m, dim_p2), dtype=tl.float32)
    for j in range(lo, hi):
        start = tl.load(segments_ptr + (seg0 + j) * 2)
        length = tl.load(segments_ptr + (seg0 + j) * 2 + 1).to(tl.int32)
        entry = entry0 + local * segments + j
        if prerotated:
            q = tl.load(q_ptr + entry[:, None] * q_stride_t + head_offs, mask=q_mask, other=0.0)
            q = q.to(kv_ptr.dtype.element_ty)
        else:
            table = entry[:, None] * table_stride + d[None, :]
            cos = tl.load(cos_ptr + table, mask=q_mask, other=0.0)
            sin = tl.load(sin_ptr + table, mask=q_mask, other=0.0)
            q = rope_rows(x, x_partner, cos, sin, d < half).to(kv_ptr.dtype.element_ty)
        every_key = tl.zeros((block_m,), dtype=tl.int32) + length  # a chunk is fully visible to every row
        m_i, l_i, acc = attend_key_range(
            q,
            kv_ptr,
            kv_desc,
            kv_head,
            start,
            length,
            every_key,
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
    pair = pair0 + local
    out_offs = pair[:, None] * out_stride_p + head[:, None] * out_stride_h + d[None, :]
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    tl.store(lse_ptr + pair * lse_stride_p + head, lse, mask=live)
