"""The Triton kernel behind `act_mul`: imported only where triton exists.

No `from __future__ import annotations` here: Triton reads the `tl.constexpr` annotations as objects.
"""

import triton
import triton.language as tl


@triton.jit  # type: ignore[untyped-decorator]
def silu_mul_kernel(  # type: ignore[no-untyped-def]
    gate_up_ptr,
    out_ptr,
    width,
    row_stride,
    out_stride,
    block: tl.constexpr,
):
    """One program: `block` columns of one row of gate_up [T, 2W] (gate first, up after) into out [T, W]:
    silu(gate) rounded to the output's dtype, as torch's silu returns it, then times up in fp32, rounded once
    more: torch's two kernels' arithmetic in one pass over the row."""
    row = tl.program_id(0)
    col = tl.program_id(1) * block + tl.arange(0, block)
    live = col < width
    base = gate_up_ptr + row * row_stride
    gate = tl.load(base + col, mask=live, other=0.0).to(tl.float32)
    up = tl.load(base + width + col, mask=live, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * out_stride + col, (silu * up).to(out_ptr.dtype.element_ty), mask=live)
