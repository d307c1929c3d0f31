"""The KV path chosen at start (kv_path.py) and the gate over the zero-copy path (gate.py, shared_gate.py).

The choice: `KVSTITCH_SHARED_CHUNKS=auto` (the default) serves the shared path where its Triton kernels run and the
copy path elsewhere; `on` asks for the shared one wherever segment attention runs for the model on its device
(Triton on CUDA, the torch reference on the CPU); `off` never. The gate holds the zero-copy path (the
question through `SharedDecoder` over a NaN-poisoned arena) to the same reference and tolerance as the stitched path,
and fails it, alone, when its positions are off.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import pytest
import torch

import service.engine.kv_path as kv_path_module
import service.engine.shared_gate as shared_gate_module
from service.engine.engine import StitchEngine
from service.engine.gate import GateCase, GateResult, run_gate
from service.engine.kv_layout import ChunkContext, ModelSpec
from service.engine.kv_path import KVPathMode, KVPathReason, choose_kv_path
from service.engine.segment_attention import ChunkRange
from service.engine.shared_decode import Placement, placements
from service.engine.stitch import PositionMode, StitchPlan


def test_the_copy_path_unless_asked(get_engine: Callable[[str, str], StitchEngine]) -> None:
    spec = get_engine("qwen2", "cpu").spec
    off = choose_kv_path("off", spec)
    assert (off.mode, off.reason, off.attention, off.shared) == (KVPathMode.COPY, KVPathReason.OFF, None, False)
    on = choose_kv_path("on", spec)
    assert (on.mode, on.reason, on.attention, on.shared) == (KVPathMode.SHARED, KVPathReason.ON, "torch", True)
    assert on.as_json() == {
        "mode": "shared",
        "reason": "on",
        "detail": "KVSTITCH_SHARED_CHUNKS=on",
        "attention": "torch",
    }


@pytest.mark.parametrize(
    ("device", "head_dim", "triton", "want", "named"),
    [
        ("cuda", 16, True, (KVPathMode.SHARED, KVPathReason.ON, "triton"), "=on"),
        ("cuda", 16, False, (KVPathMode.COPY, KVPathReason.TRITON, None), "Triton"),
        ("meta", 16, True, (KVPathMode.COPY, KVPathReason.DEVICE, None), "not meta"),
        ("cpu", 15, True, (KVPathMode.COPY, KVPathReason.HEAD_DIM, None), "not 15"),
    ],
)
def test_the_shared_path_falls_back_where_segment_attention_cannot_run(
    get_engine: Callable[[str, str], StitchEngine],
    monkeypatch: pytest.MonkeyPatch,
    device: str,
    head_dim: int,
    triton: bool,
    want: tuple[KVPathMode, KVPathReason, str | None],
    named: str,
) -> None:
    """Asked for, the shared path still falls back to the copy path, naming why: CUDA without Triton, a device
    segment attention does not run on, an odd head size."""
    path = choose_kv_path("on", spec_on(get_engine, monkeypatch, device, head_dim, triton))
    assert (path.mode, path.reason, path.attention) == want
    assert named in path.detail


@pytest.mark.parametrize(
    ("device", "head_dim", "triton", "want"),
    [
        ("cuda", 16, True, (KVPathMode.SHARED, KVPathReason.ON, "triton")),
        ("cuda", 16, False, (KVPathMode.COPY, KVPathReason.AUTO, None)),
        ("cuda", 15, True, (KVPathMode.COPY, KVPathReason.AUTO, None)),
        ("cpu", 16, True, (KVPathMode.COPY, KVPathReason.AUTO, None)),
    ],
)
def test_auto_serves_the_shared_path_only_where_its_kernels_run(
    get_engine: Callable[[str, str], StitchEngine],
    monkeypatch: pytest.MonkeyPatch,
    device: str,
    head_dim: int,
    triton: bool,
    want: tuple[KVPathMode, KVPathReason, str | None],
) -> None:
    """The default: the Triton kernels on CUDA serve the shared path; the CPU (whose torch reference `on` would
    serve), CUDA without Triton and an odd head size get the copy path, which `/readyz` names as auto's choice."""
    path = choose_kv_path("auto", spec_on(get_engine, monkeypatch, device, head_dim, triton))
    assert (path.mode, path.reason, path.attention) == want
    assert path.detail.startswith("KVSTITCH_SHARED_CHUNKS=auto")
    if not path.shared:
        assert f"the copy path serves on {device}" in path.detail


def spec_on(
    get_engine: Callable[[str, str], StitchEngine],
    monkeypatch: pytest.MonkeyPatch,
    device: str,
    head_dim: int,
    triton: bool,
) -> ModelSpec:
    """A tiny model's spec placed on `device` with `head_dim`, Triton running there only where `triton` and CUDA."""
    monkeypatch.setattr(kv_path_module, "triton_runs_on", lambda d: triton and d.type == "cuda")
    return dataclasses.replace(get_engine("qwen2", "cpu").spec, device=torch.device(device), head_dim=head_dim)


def test_an_unknown_request_is_refused(get_engine: Callable[[str, str], StitchEngine]) -> None:
    with pytest.raises(ValueError, match="auto, on or off"):
        choose_kv_path("maybe", get_engine("qwen2", "cpu").spec)


@pytest.mark.parametrize("arch", ("llama", "qwen2", "mistral"))
@pytest.mark.parametrize("context", ("alone", "prefix"))
def test_the_gate_holds_the_zero_copy_path_to_the_reference(
    get_engine: Callable[[str, str], StitchEngine], arch: str, context: str
) -> None:
    """With `shared` every case runs the zero-copy path too: within the fp32 tolerance, each order and position
    mode, for chunks precomputed alone and after the prefix; without, none is run."""
    engine = get_engine(arch, "cpu")
    before = engine.chunk_context
    engine.chunk_context = ChunkContext(context)
    try:
        result = run_gate(engine, chunk_lengths=(13, 6, 21), question_length=6, shared=True)
        plain = run_gate(engine, chunk_lengths=(13, 6, 21), question_length=6)
    finally:
        engine.chunk_context = before
    assert result.passed and result.shared_passed is True
    assert [(c.order, c.positions) for c in result.shared_cases] == [(c.order, c.positions) for c in result.cases]
    assert len(result.shared_cases) == 4
    zero_copy = result.shared_max_abs_logit_diff
    assert zero_copy is not None and 0 < zero_copy <= result.tolerance == 1e-4
    assert plain.shared_cases == [] and plain.shared_passed is None and plain.shared_max_abs_logit_diff is None
    assert plain.max_abs_logit_diff == result.max_abs_logit_diff


def _shifted(plan: StitchPlan, ranges: Sequence[ChunkRange]) -> tuple[Placement, ...]:
    """Each chunk read one position later than it is placed: what a wrong per-chunk offset does."""
    return tuple(Placement(p.chunk, p.offset + 1) for p in placements(plan, ranges))


def test_the_gate_fails_the_zero_copy_path_alone_when_its_offsets_are_off(
    get_engine: Callable[[str, str], StitchEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = get_engine("qwen2", "cpu")
    monkeypatch.setattr(shared_gate_module, "placements", _shifted)
    result = run_gate(engine, chunk_lengths=(13, 6, 21), question_length=6, shared=True)
    assert result.passed  # the copy path is untouched
    assert result.shared_passed is False
    zero_copy = result.shared_max_abs_logit_diff
    assert zero_copy is not None and zero_copy > 1e-2 > result.tolerance


def test_a_nan_fails_the_gate() -> None:
    """A read of a poisoned slot turns the logits NaN: no case with a NaN passes, whatever the others say."""
    cases = [GateCase((0,), PositionMode.REORDERED, 1e-6), GateCase((0,), PositionMode.COMPOSITE, float("nan"))]
    result = GateResult(1e-4, cases[:1], shared_cases=cases)
    assert result.passed and result.shared_passed is False
    assert not GateResult(1e-4, cases[1:]).passed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_gpu_the_gate_holds_the_triton_zero_copy_path_to_the_reference(
    get_engine: Callable[[str, str], StitchEngine],
) -> None:
    """On CUDA (bf16) the shared path is chosen with the Triton kernels, and the gate's zero-copy cases (through them,
    over a NaN-poisoned arena) pass the same relative bf16 bound as the stitched path's."""
    engine = get_engine("llama", "cuda")
    path = choose_kv_path("on", engine.spec)
    assert (path.mode, path.attention) == (KVPathMode.SHARED, "triton")
    assert choose_kv_path("auto", engine.spec).shared
    result = run_gate(engine, shared=True)
    assert result.passed and result.shared_passed is True, (result.cases, result.shared_cases)
    zero_copy = result.shared_max_abs_logit_diff
    assert zero_copy is not None and zero_copy <= result.tolerance
