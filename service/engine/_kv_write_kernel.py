"""The Triton kernel behind `kv_write`: imported only where triton exists.

No `from __future__ import annotations` here: Triton reads the `tl.constexpr` annotations as objects.
"""

import triton
import triton.language as tl


@triton.jit  # type: ignore[untyped-decorator]
def rotate_write_kernel(  # type: ignore[no-untyped-def]
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    slots_ptr,
    q_out_ptr,
    keys_ptr,
    values_ptr,
    tokens,
    qkv_stride_t,
    qkv_stride_h,
    table_stride,
    q_out_stride_t,
    q_out_stride_h,
    kv_stride_h,
    kv_stride_s,
    first: tl.constexpr,
    num_heads: tl.constexpr,
    num_kv_heads: tl.constexpr,
    head_dim: tl.constexpr,
    dim_p2: tl.constexpr,
    block_t: tl.constexpr,
):
    """One program: `block_t` tokens of one head of qkv [T, Hq + 2 Hkv, D] (axis 1 counts from head `first`).
    A query head is rotated into q_out [T, Hq, D]; a key head rotated into keys [Hkv, slots, D] at each token's
    slot; a value head copied into values the same way. The rotation is `LeanForward.layers_static`'s in the same
    fp32 order (x * cos, then + partner * signed sin, with FP fusion off at launch), cast to the output's dtype once.
    """
    head = first + tl.program_id(1)
    token = tl.program_id(0) * block_t + tl.arange(0, block_t)
    live = token < tokens
    d = tl.arange(0, dim_p2)
    mask = live[:, None] & (d < head_dim)[None, :]
    row = qkv_ptr + token[:, None] * qkv_stride_t + head * qkv_stride_h
    x = tl.load(row + d[None, :], mask=mask, other=0.0)
    if head < num_heads + num_kv_heads:
        half = head_dim // 2
        partner = tl.where(d < half, d + half, d - half)
        x_partner = tl.load(row + partner[None, :], mask=mask, other=0.0).to(tl.float32)
        table = token[:, None] * table_stride + d[None, :]
        cos = tl.load(cos_ptr + table, mask=mask, other=0.0)
        sin = tl.load(sin_ptr + table, mask=mask, other=0.0)
        signed = tl.where((d < half)[None, :], -sin, sin)
        rotated = x.to(tl.float32) * cos + x_partner * signed
        if head < num_heads:
            out = q_out_ptr + token[:, None] * q_out_stride_t + head * q_out_stride_h + d[None, :]
            tl.store(out, rotated.to(q_out_ptr.dtype.element_ty), mask=mask)
        else:
            slot = tl.load(slots_ptr + token, mask=live, other=0)
            out = keys_ptr + (head - num_heads) * kv_stride_h + slot[:, None] * kv_stride_s + d[None, :]
            tl.store(out, rotated.to(keys_ptr.dtype.element_ty), mask=mask)
    else:
        slot = tl.load(slots_ptr + token, mask=live, other=0)
        out = values_ptr + (head - num_heads - num_kv_heads) * kv_stride_h + slot[:, None] * kv_stride_s + d[None, :]
        tl.store(out, x, mask=mask)
