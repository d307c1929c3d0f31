"""`act_mul`: the MLP's silu(gate) * up in one Triton kernel, the numbers of torch's two kernels.

The kernel runs on CUDA, or on the CPU under Triton's interpreter (TRITON_INTERPRET=1 with triton importable)."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import pytest
import torch
from transformers.activations import ACT2FN

from service.engine import act_mul
from service.engine.engine import StitchEngine
from tests.test_engine_kv_write import step_twice
from tests.test_engine_segment_attention import INTERPRETER, KERNEL_DEVICE, NEEDS_KERNELS, compiles_for_sm90


@pytest.mark.gpu
@NEEDS_KERNELS
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16))
@pytest.mark.parametrize(("tokens", "width"), [(1, 64), (5, 300), (3, 2500)])
def test_one_kernel_gives_torchs_silu_times_up(dtype: torch.dtype, tokens: int, width: int) -> None:
    """Rows strided (a slice of a wider projection), widths that are not a power of two and wider than a block."""
    gen = torch.Generator().manual_seed(width)
    wide = (torch.randn((tokens, 2 * width + 7), generator=gen) * 4).to(KERNEL_DEVICE, dtype)
    gate_up = wide[:, : 2 * width]
    gate, up = gate_up.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    got = act_mul.silu_mul(gate_up)
    assert got.shape == (tokens, width) and got.dtype == dtype
    # silu's result rounded to the dtype, then one rounded product, as torch does; exp may differ in its last bit.
    ulp = {torch.float32: 1e-6, torch.float16: 1e-3}[dtype]
    assert float(((got.float() - want.float()).abs() / want.float().abs().clamp(min=1.0)).max()) <= 2 * ulp
    assert float((got.float() - (gate * up).float()).abs().max()) > 0.1  # the activation matters: can fail


@pytest.mark.gpu
@NEEDS_KERNELS
def test_a_decode_step_through_the_kernel_equals_torchs(
    get_engine: Callable[[str, str], StitchEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = get_engine("llama", KERNEL_DEVICE)
    assert act_mul.is_silu(engine.forward.layers[0].mlp.act_fn)

    def switch_on() -> None:
        monkeypatch.setattr(act_mul, "FUSED_ACT_MUL", True)
        monkeypatch.setattr(act_mul, "triton_runs_on", lambda device: True)  # the CPU's interpreter too

    plain, fused, _, _ = step_twice(engine, switch_on)
    assert float((fused - plain).abs().max()) <= 1e-5
    assert not torch.equal(fused, torch.zeros_like(fused))


def test_only_silu_takes_the_kernel_and_only_where_the_kernels_run(monkeypatch: pytest.MonkeyPatch) -> None:
    assert act_mul.is_silu(ACT2FN["silu"]) and act_mul.is_silu(torch.nn.SiLU())
    assert not act_mul.is_silu(ACT2FN["gelu"]) and not act_mul.is_silu(torch.nn.GELU())
    monkeypatch.setattr(act_mul, "FUSED_ACT_MUL", True)
    assert not act_mul.applies(torch.nn.SiLU(), torch.device("cpu"))
    monkeypatch.setattr(act_mul, "triton_runs_on", lambda device: True)
    cpu = torch.device("cpu")
    assert act_mul.applies(torch.nn.SiLU(), cpu) and not act_mul.applies(torch.nn.GELU(), cpu)
    monkeypatch.setattr(act_mul, "FUSED_ACT_MUL", False)
    assert not act_mul.applies(torch.nn.SiLU(), torch.device("cpu"))
    with pytest.raises(ValueError, match="unit stride"):
        act_mul.silu_mul(torch.zeros((4, 6)).t())


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or INTERPRETER or torch.cuda.is_available(),
    reason="a CPU check: needs triton importable, no interpreter, no CUDA",
)
@pytest.mark.parametrize("dtype", ("bf16", "fp16", "fp32"))
def test_the_kernel_compiles_for_an_h100_without_one(dtype: str) -> None:
    from service.engine import _act_mul_kernel

    pointers = {"gate_up_ptr": dtype, "out_ptr": dtype}
    assert compiles_for_sm90(_act_mul_kernel.silu_mul_kernel, pointers, {}, {"block": 1024})
