"""The Triton kernel behind `fused_stitch`: imported only where triton exists (see `fused_stitch._kernel`).

No `from __future__ import annotations` here: Triton reads the `tl.constexpr` annotations as objects.
"""

import triton
import triton.language as tl

# Columns of the per-block table (int64): source data pointer, tokens, first destination slot, first position.
TABLE_COLUMNS = 4


@triton.jit  # type: ignore[untyped-decorator]
def rotate_place_kernel(  # type: ignore[no-untyped-def]
    table_ptr,
    scale_ptr,
    dst_ptr,
    cos_ptr,
    sin_ptr,
    num_heads,
    first_layer,
    dst_layer_stride,
    dst_kv_stride,
    dst_head_stride,
    head_dim: tl.constexpr,
    half_p2: tl.constexpr,
    block_t: tl.constexpr,
):
    """One program: block_t tokens of one block for one (layer, head): keys rotated, values copied.

    Grid (token tiles of the longest block, blocks, layers * heads) over layers first_layer.. (a layer range of a
    pipelined stitch, or all of them from 0); tiles past a block's end return at once.
    Sources are contiguous `[layers, 2, heads, n, head_dim]`; the destination is the buffer's
    `[layers, 2, heads, capacity, head_dim]` (strides in elements). The rotation is the model's rotate_half form
    on pairs (i, i + D/2) with the model's own fp32 cos/sin rows [position, D]:
    out[i] = x[i] cos[i] - x[i+h] sin[i], out[i+h] = x[i+h] cos[i+h] + x[i] sin[i+h], times the block's fp32
    key scale (`scale_ptr`, one per table row: a context temperature's 1/T, else 1), cast once to the dtype.
    """
    tile = tl.program_id(0)
    block = tl.program_id(1)
    layer_head = tl.program_id(2)
    row = table_ptr + block * 4
    n = tl.load(row + 1)
    t0 = tile * block_t
    if t0 < n:
        src = tl.load(row).to(tl.pointer_type(dst_ptr.dtype.element_ty))
        slot = tl.load(row + 2)
        position = tl.load(row + 3)
        # int64 offsets: a long buffer of a deep model passes 2**31 elements.
        layer = (layer_head // num_heads + first_layer).to(tl.int64)
        head = (layer_head % num_heads).to(tl.int64)
        half = head_dim // 2
        t = t0 + tl.arange(0, block_t)
        d = tl.arange(0, half_p2)
        mask = (t < n)[:, None] & (d < half)[None, :]

        src_keys = src + (layer * 2 * num_heads + head) * n * head_dim
        src_values = src_keys + num_heads * n * head_dim
        src_offsets = t[:, None] * head_dim + d[None, :]
        x1 = tl.load(src_keys + src_offsets, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src_keys + src_offsets + half, mask=mask, other=0.0).to(tl.float32)
        trig = (position + t)[:, None] * head_dim + d[None, :]
        cos1 = tl.load(cos_ptr + trig, mask=mask, other=0.0)
        cos2 = tl.load(cos_ptr + trig + half, mask=mask, other=0.0)
        sin1 = tl.load(sin_ptr + trig, mask=mask, other=0.0)
        sin2 = tl.load(sin_ptr + trig + half, mask=mask, other=0.0)
        # Two rounded products then one add, as torch's x * cos + rotate_half(x) * sin does (launched with
        # fp fusion off so no FMA contracts them): the result is bit-identical to the torch path.
        factor = tl.load(scale_ptr + block)
        out1 = (x1 * cos1 - x2 * sin1) * factor
        out2 = (x2 * cos2 + x1 * sin2) * factor

        dst_keys = dst_ptr + layer * dst_layer_stride + head * dst_head_stride
        dst_offsets = (slot + t)[:, None] * head_dim + d[None, :]
        out_type = dst_ptr.dtype.element_ty
        tl.store(dst_keys + dst_offsets, out1.to(out_type), mask=mask)
        tl.store(dst_keys + dst_offsets + half, out2.to(out_type), mask=mask)
        v1 = tl.load(src_values + src_offsets, mask=mask, other=0.0)
        v2 = tl.load(src_values + src_offsets + half, mask=mask, other=0.0)
        dst_values = dst_keys + dst_kv_stride
        tl.store(dst_values + dst_offsets, v1, mask=mask)
        tl.store(dst_values + dst_offsets + half, v2, mask=mask)
