"""The online-softmax steps the Triton attention kernels share (`_segment_kernel`, `_slot_kernel`).

No `from __future__ import annotations` here: Triton reads the `tl.constexpr` annotations as objects.
"""

import triton
import triton.language as tl

# ln 2 as a constexpr global: a jitted function reads no plain global.
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit  # type: ignore[untyped-decorator]
def tile_scores(q, k, ieee: tl.constexpr):  # type: ignore[no-untyped-def]
    """q [M, D] against a K tile [N, D]: [M, N] in fp32. `ieee`: fp32 tiles multiply in full precision, not TF32."""
    if ieee:  # noqa: SIM108 (a constexpr branch)
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    return s


@triton.jit  # type: ignore[untyped-decorator]
def online_softmax_step(s, v, m_i, l_i, acc, ieee: tl.constexpr):  # type: ignore[no-untyped-def]
    """One tile's scores `s` [M, N] (base 2, already scaled; -inf where masked) and values [N, D] into the running
    max `m_i`, sum `l_i` and output `acc` of M rows; a row with every score -inf so far keeps sum 0."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if ieee:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def finished_partial(m_i, l_i, acc):  # type: ignore[no-untyped-def]
    """The running state of M rows (`online_softmax_step`'s) as a partial: output acc / sum and the natural
    log-sum-exp; a row that saw no key gives zeros and -inf."""
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * LN2, float("-inf"))
    return out, lse


@triton.jit
def rope_rows(x, x_partner, cos, sin, first_half):  # type: ignore[no-untyped-def]
    """Rows x [M, D] rotated by RoPE's rotate-half form, in fp32: x_partner holds each column's partner (d + D/2
    in the first half, d - D/2 in the second), cos/sin the rows' tables (fp32, the model's own)."""
    x_partner = x_partner.to(tl.float32)
    return x.to(tl.float32) * cos + tl.where(first_half[None, :], -x_partner, x_partner) * sin


@triton.jit  # type: ignore[untyped-decorator]
def attend_key_range(  # type: ignore[no-untyped-def]
    q,
    kv_ptr,
    kv_desc,
    kv_head,
    start,
    length,
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
    block_n: tl.constexpr,
    ieee: tl.constexpr,
):
    """The running state of q [M, D] (rotated, the keys' dtype) after keys start .. start + length - 1 of KV head
    `kv_head` of kv [2, Hkv, slots, D] (unit stride on D), row i seeing only the first visible[i] of them;
    `qk_scale` carries log2(e).

    The K/V tiles are read by pointers, masked to the range; or, where `kv_desc` is given (kv contiguous), through
    that tensor descriptor of kv as rows of D (on Hopper TMA copies prefetched into shared memory, with no
    per-element pointers in registers). A described tile reaching past the range reads whatever rows follow (a free
    page may hold NaN): those keys' scores are masked and their values zeroed before the product."""
    if kv_desc is not None:
        # Rows of D: 2 x Hkv x slots of them (millions at most), so int32 offsets, as the descriptor takes them.
        k_row = ((kv_head * kv_stride_h) // kv_stride_t + start).to(tl.int32)
        v_row = k_row + (kv_stride_kv // kv_stride_t).to(tl.int32)
    else:
        k_base = kv_ptr + kv_head * kv_stride_h + start * kv_stride_t
        v_base = k_base + kv_stride_kv
    for n0 in range(0, length, block_n):
        n = n0 + tl.arange(0, block_n)
        if kv_desc is not None:
            k = kv_desc.load([k_row + n0, 0])
            v = tl.where((n < length)[:, None], kv_desc.load([v_row + n0, 0]), 0.0)
        else:
            kv_mask = (n < length)[:, None] & d_live[None, :]
            offs = n[:, None] * kv_stride_t + d[None, :]
            k = tl.load(k_base + offs, mask=kv_mask, other=0.0)
            v = tl.load(v_base + offs, mask=kv_mask, other=0.0)
        s = tl.where(n[None, :] < visible[:, None], tile_scores(q, k, ieee) * qk_scale, float("-inf"))
        m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, ieee)
    return m_i, l_i, acc
