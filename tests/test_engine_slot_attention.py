"""The recompute's slot attention kernel (`slot_attention.py`) against masked SDPA, and the recompute through it.

The kernel tests run on CUDA, or under Triton's interpreter when the run sets TRITON_INTERPRET=1 and triton imports
(fp32 and fp16: the interpreter multiplies bf16 tiles wrongly); a CPU run without either skips them, and CI's
checks of the recompute's SDPA path are in test_engine_recompute.py. The sm_90 compilation runs wherever triton
imports without the interpreter or a GPU.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable

import pytest
import torch

from service.engine import recompute, slot_attention
from service.engine.engine import StitchEngine
from service.engine.fused_stitch import next_power_of_2, triton_runs_on
from service.engine.gate import default_tolerance, synthetic_ids
from service.engine.recompute_spec import parse_recompute
from service.engine.slot_attention import attend_slots_kernel, reference_at_slots, slot_kernel_usable
from service.engine.stitch import PositionMode
from tests.test_engine_segment_attention import compiles_for_sm90

INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_HERE = triton_runs_on(torch.device(DEVICE), interpreter=INTERPRETER)
NEEDS_KERNEL = pytest.mark.skipif(not _HERE, reason="needs CUDA and triton (or TRITON_INTERPRET=1 with triton)")
# Outputs of size ~1: fp32 agrees to rounding; fp16/bf16 round q, K, V and the probabilities (a few 1e-3), while
# a missed or an extra key moves an output by ~0.1.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def _case(
    heads: int, kv_heads: int, dim: int, picks: torch.Tensor, dtype: torch.dtype, capacity: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [1, heads, T, dim] as a strided view (the projection's layout), keys and values [kv_heads, capacity, dim]
    as views of one buffer; every slot after the last pick holds NaN, which no result may read."""
    generator = torch.Generator().manual_seed(heads * 100 + kv_heads * 10 + picks.numel())
    kv = torch.randn((2, kv_heads, capacity, dim), generator=generator).to(dtype).to(DEVICE)
    kv[:, :, int(picks[-1]) + 1 :] = float("nan")
    wide = torch.randn((1, picks.numel(), heads + 2 * kv_heads, dim), generator=generator).to(dtype).to(DEVICE)
    return wide[:, :, :heads].transpose(1, 2), kv[0], kv[1]


def _picks(kind: str, capacity: int) -> torch.Tensor:
    if kind == "dense":  # every slot from 0: the kernel's blocks are all masked diagonal
        return torch.arange(0, capacity - 5)
    if kind == "edge":  # a block whose first slot sits at a tile's last key
        return torch.arange(63, capacity - 5, 3)
    generator = torch.Generator().manual_seed(7)
    return torch.sort(torch.randperm(capacity - 5, generator=generator)[: capacity // 4]).values


@pytest.mark.gpu
@NEEDS_KERNEL
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16))
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 4, 32), (14, 2, 64), (28, 4, 128), (9, 3, 64)])
@pytest.mark.parametrize("kind", ("scattered", "dense", "edge"))
def test_kernel_equals_masked_sdpa(kind: str, heads: int, kv_heads: int, dim: int, dtype: torch.dtype) -> None:
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip("Triton's interpreter multiplies bf16 tiles wrongly (tl.dot); bf16 runs on CUDA")
    picks = _picks(kind, 300).to(DEVICE)
    q, keys, values = _case(heads, kv_heads, dim, picks, dtype, 300)
    got = attend_slots_kernel(q, keys, values, picks, dim**-0.5)
    want = reference_at_slots(q, keys, values, picks, dim**-0.5)
    assert got.shape == (1, picks.numel(), heads, dim) and got.dtype == dtype
    assert torch.isfinite(got).all()
    assert (got.float() - want.float()).abs().max().item() < TOLERANCE[dtype]


@pytest.mark.gpu
@NEEDS_KERNEL
def test_a_query_sees_its_own_slot_and_nothing_after() -> None:
    """Values that say which key was read: a query at slot s whose score is flat over keys 0..s averages their
    values; one key too many or too few moves the average by a whole unit over (s + 1) keys."""
    capacity, dim = 80, 32
    picks = torch.tensor([0, 5, 6, 40, 79], device=DEVICE)
    keys = torch.zeros((1, capacity, dim), device=DEVICE)
    values = torch.zeros((1, capacity, dim), device=DEVICE)
    values[0, :, 0] = torch.arange(capacity, dtype=torch.float32, device=DEVICE)
    q = torch.zeros((1, 1, picks.numel(), dim), device=DEVICE)
    got = attend_slots_kernel(q, keys, values, picks, 1.0)[0, :, 0, 0]
    assert torch.allclose(got, picks.float() / 2, atol=1e-5)


@pytest.mark.gpu
@NEEDS_KERNEL
@pytest.mark.parametrize("arch", ("llama", "qwen2"))
@pytest.mark.parametrize("spec", ("query:0.3", "prefix:5"))
def test_a_recompute_through_the_kernel_leaves_what_masked_sdpa_does(
    get_engine: Callable[[str, str], StitchEngine], arch: str, spec: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Scattered slots (the chosen tokens of four chunks, from layer 0 on: `selective` would start at layer 1,
    which a two-layer model leaves to the K/V write alone): the buffer and the question's logits equal the SDPA
    path's, the kernel having run in every layer but the last."""
    engine = get_engine(arch, DEVICE)
    chunks = synthetic_ids(engine, (23, 9, 31, 14), seed=3)
    prompt = engine.template.prompt(chunks, synthetic_ids(engine, [10], seed=53)[0])
    calls: list[int] = []

    def counted(*args: torch.Tensor | float) -> torch.Tensor:
        calls.append(1)
        return attend_slots_kernel(*args)  # type: ignore[arg-type]

    def run(kernel: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
        monkeypatch.setattr(recompute, "slot_kernel_usable", lambda *args: kernel)
        monkeypatch.setattr(recompute, "attend_slots_kernel", counted)
        chunk_kv = engine.precompute(prompt.blocks)
        buffer, plan = engine.stitch(chunk_kv, PositionMode.REORDERED, len(prompt.question))
        count = engine.recompute(buffer, plan, chunk_kv, parse_recompute(spec), prompt.question)
        logits = engine.prefill_question(buffer, prompt.question, all_logits=True)
        return buffer.data.clone(), logits, count

    sdpa_kv, sdpa_logits, sdpa_count = run(False)
    assert calls == []
    kernel_kv, kernel_logits, kernel_count = run(True)
    tolerance = default_tolerance(engine.spec.dtype)
    assert kernel_count == sdpa_count > 0 and len(calls) == engine.spec.num_layers - 1
    assert (kernel_kv.float() - sdpa_kv.float()).abs().max().item() <= tolerance
    assert (kernel_logits.float() - sdpa_logits.float()).abs().max().item() <= tolerance


def test_no_kernel_on_a_cpu_without_the_interpreter() -> None:
    """The recompute keeps masked SDPA on a CPU: the kernel neither applies nor passes the probe there."""
    assert not triton_runs_on(torch.device("cpu"))
    assert not slot_kernel_usable(torch.device("cpu"), torch.float32, 4, 2, 32)


def test_a_wrong_kernel_fails_the_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe compares with SDPA: a kernel that reads one key too many is refused, not used."""

    def off_by_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, s: float) -> torch.Tensor:
        return reference_at_slots(q, k, v, (slots + 1).clamp(max=k.shape[1] - 1), s)

    monkeypatch.setattr(slot_attention, "attend_slots_kernel", off_by_one)
    assert slot_attention._probe(torch.device("cpu"), torch.float32, 4, 2, 32) > 0.05
    monkeypatch.setattr(slot_attention, "triton_runs_on", lambda device: True)
    monkeypatch.setattr(slot_attention, "_PROBED", {})
    assert not slot_kernel_usable(torch.device("cpu"), torch.float32, 4, 2, 32)
    monkeypatch.setattr(slot_attention, "attend_slots_kernel", reference_at_slots)
    monkeypatch.setattr(slot_attention, "_PROBED", {})
    assert slot_kernel_usable(torch.device("cpu"), torch.float32, 4, 2, 32)


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or INTERPRETER or torch.cuda.is_available(),
    reason="a CPU check: needs triton importable, no interpreter, no CUDA",
)
@pytest.mark.parametrize("dtype", ("bf16", "fp16", "fp32"))
def test_kernel_compiles_for_an_h100_without_one(dtype: str) -> None:
    """Ahead-of-time compilation for sm_90 (ptxas ships with triton), for the Qwen2-7B and Llama-3.1-8B groups."""
    from service.engine import _slot_kernel

    kernel = _slot_kernel.slot_attention_kernel
    pointers = {"q_ptr": dtype, "k_ptr": dtype, "v_ptr": dtype, "out_ptr": dtype, "slots_ptr": "i64"}
    for group in (7, 4):
        block_q = slot_attention.BLOCK_ITEMS // group
        constants = {"group": group, "head_dim": 128, "dim_p2": 128, "block_q": block_q}
        constants |= {"block_m": next_power_of_2(block_q * group), "block_n": slot_attention.BLOCK_N}
        constants["ieee"] = dtype == "fp32"
        assert compiles_for_sm90(kernel, pointers, {"qk_scale": "fp32"}, constants, slot_attention.NUM_WARPS)


class _Here:
    """An engine loop that runs what it is given on the caller's thread."""

    @staticmethod
    def call(fn: Callable[[], bool]) -> bool:
        return fn()


def test_the_runtime_probes_the_kernel_at_start(
    get_engine: Callable[[str, str], StitchEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`Runtime.warm_up` asks for the kernel with the model's head shape and dtype, so the first recompute does not
    compile it; on a CPU the answer is masked SDPA."""
    from service.serving import runtime

    engine = get_engine("qwen2", "cpu")
    assert runtime.warm_slot_attention(engine, _Here()) is False  # type: ignore[arg-type]
    asked: list[tuple[object, ...]] = []
    monkeypatch.setattr(runtime, "slot_kernel_usable", lambda *args: asked.append(args) or True)
    assert runtime.warm_slot_attention(engine, _Here()) is True  # type: ignore[arg-type]
    spec = engine.spec
    assert asked == [(spec.device, spec.dtype, spec.num_heads, spec.num_kv_heads, spec.head_dim)]
