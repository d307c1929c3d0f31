"""The MLP's silu(gate) * up in one Triton kernel (`FUSED_ACT_MUL`) instead of torch's two.

`LeanForward.layers_static` computes the gate and up projections as one matmul ([T, 2W]) and then torch's silu and
product: two kernels, the second reading the first's [T, W] output back. One kernel reads the pair once and writes
the product, with the same roundings (silu's result in the activations' dtype, the product in fp32, rounded once).
Where the model's activation is not SiLU, or the kernels do not run on the device, torch's kernels stay.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from service.engine.fused_stitch import next_power_of_2, triton_runs_on

# Module-level so a benchmark can compare (and `random_engine`'s BENCH_ENGINE_CONSTANTS); on: measured faster
# through the gateway (§13.14).
FUSED_ACT_MUL = True
_BLOCK = 1024  # columns a program takes


@functools.cache
def _kernel() -> Any:
    from service.engine import _act_mul_kernel

    return _act_mul_kernel.silu_mul_kernel


def is_silu(act_fn: Any) -> bool:
    """Whether the model's MLP activation is SiLU (torch's module or transformers' own)."""
    return isinstance(act_fn, torch.nn.SiLU) or type(act_fn).__name__ == "SiLUActivation"


def applies(act_fn: Any, device: torch.device) -> bool:
    """Whether `silu_mul` serves this activation on `device`: the flag is on, it is SiLU, the kernels run there."""
    return FUSED_ACT_MUL and is_silu(act_fn) and triton_runs_on(device)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate_up [T, 2W] (gate the first W columns, unit stride on them) as [T, W]."""
    tokens, both = gate_up.shape
    width = both // 2
    if both % 2 or gate_up.stride(-1) != 1:
        raise ValueError("silu_mul: gate_up is [T, 2W] with unit stride on its columns")
    out = torch.empty((tokens, width), dtype=gate_up.dtype, device=gate_up.device)
    if tokens == 0:
        return out
    block = min(_BLOCK, next_power_of_2(width))
    _kernel()[(tokens, -(-width // block))](
        gate_up, out, width, gate_up.stride(0), out.stride(0), block=block, num_warps=4, enable_fp_fusion=False
    )
    return out
