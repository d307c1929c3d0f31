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
