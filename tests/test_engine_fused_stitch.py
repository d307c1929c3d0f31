"""The fused Triton rotate-and-place equals the torch stitch (bit for bit: same fp32 math, same order).

GPU tests (marked `gpu`) compare the stitched buffers of both paths for every tiny model family (llama carries
llama3 rope scaling), both position modes, uneven blocks, a block reused at two offsets, blocks arriving through
events on another stream and from pinned host memory; the CPU tests check the selection and the grouping.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import pytest
import torch

from service.engine.engine import StitchEngine
from service.engine.fused_stitch import FusedStitch, _groups, fused_stitch_enabled, triton_available
from service.engine.gate import run_gate, synthetic_ids
from service.engine.kv_buffer import KVBuffer
from service.engine.kv_layout import KVBlock
from service.engine.stitch import BlockReady, PositionMode, plan_positions, stitch_into

NEEDS_TRITON_CUDA = pytest.mark.skipif(
    not (torch.cuda.is_available() and triton_available()), reason="needs a CUDA device and triton"
)
POISON = 1e4


def test_groups_cut_at_each_new_wait() -> None:
    a, b = object(), object()
    assert _groups([None]) == [(0, 1)]
    assert _groups([None, None, None]) == [(0, 3)]
    assert _groups([None, a, b, None]) == [(0, 1), (1, 2), (2, 4)]
    assert _groups([a, a, None, b, b]) == [(0, 3), (3, 5)]


def test_cpu_stays_on_the_torch_path(get_engine: Callable[..., StitchEngine]) -> None:
    assert not fused_stitch_enabled(None, torch.device("cpu"))
    assert not fused_stitch_enabled(False, torch.device("cuda"))
    with pytest.raises(ValueError, match="CUDA"):
        fused_stitch_enabled(True, torch.device("cpu"))
    assert get_engine("qwen2", "cpu").fused_stitch is None


def _blocks(engine: StitchEngine, lengths: Sequence[int], seed: int) -> list[KVBlock]:
    """Prefix + chunk blocks, the last chunk reused again at a later offset."""
    chunks = [engine.template.chunk_block(ids) for ids in synthetic_ids(engine, lengths, seed)]
    kv = engine.precompute(chunks)
    return [engine.prefix_block, *kv, kv[0]]


def _stitch_both(
    engine: StitchEngine,
    blocks: Sequence[KVBlock],
    positions: PositionMode,
    ready: Sequence[BlockReady | None] | None = None,
    dtype: torch.dtype | None = None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    plan = plan_positions(positions, [b.num_tokens for b in blocks], context_temperature=temperature)
    spec = engine.spec if dtype is None else dataclasses.replace(engine.spec, dtype=dtype)
    if dtype is not None:
        blocks = [KVBlock(b.token_ids, b.kv.to(dtype)) for b in blocks]
    fused = FusedStitch(engine.forward.rotary, spec.head_dim)
    out = []
    for path in (None, fused):
        buffer = KVBuffer(spec, plan.context_tokens + 13)
        buffer.data.fill_(POISON)
        stitch_into(buffer, engine.forward.rotary, blocks, plan, ready if path is not None else None, path)
        assert (buffer.length, buffer.next_position) == (plan.context_tokens, plan.question_start)
        out.append(buffer.data)
    torch.cuda.synchronize()
    return out[0], out[1], plan.context_tokens


@pytest.mark.gpu
@NEEDS_TRITON_CUDA
@pytest.mark.parametrize("positions", list(PositionMode))
def test_fused_equals_torch_bit_for_bit(
    get_engine: Callable[..., StitchEngine], arch: str, positions: PositionMode
) -> None:
    engine = get_engine(arch, "cuda")
    assert engine.fused_stitch is not None
    blocks = _blocks(engine, (37, 5, 64, 19, 1, 70), seed=3)
    torch_buf, fused_buf, used = _stitch_both(engine, blocks, positions)
    diff = float((torch_buf[:, :, :, :used].float() - fused_buf[:, :, :, :used].float()).abs().max())
    assert diff <= 0.02, f"{arch} {positions}: max |fused - torch| {diff}"
    assert torch.equal(torch_buf, fused_buf), f"{arch} {positions}: within bf16 tolerance ({diff}) but not exact"
    # Nothing past the stitched slots is touched.
    assert bool((fused_buf[:, :, :, used:] == POISON).all())


@pytest.mark.gpu
@NEEDS_TRITON_CUDA
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_other_dtypes(get_engine: Callable[..., StitchEngine], dtype: torch.dtype) -> None:
    engine = get_engine("llama", "cuda")
    blocks = _blocks(engine, (33, 8, 50), seed=5)
    torch_buf, fused_buf, used = _stitch_both(engine, blocks, PositionMode.REORDERED, dtype=dtype)
    assert torch.allclose(torch_buf[:, :, :, :used].float(), fused_buf[:, :, :, :used].float(), atol=1e-6, rtol=0)


@pytest.mark.gpu
@NEEDS_TRITON_CUDA
def test_fused_waits_for_blocks_arriving_on_another_stream(get_engine: Callable[..., StitchEngine]) -> None:
    engine = get_engine("qwen2", "cuda")
    blocks = _blocks(engine, (40, 12, 90, 7), seed=9)
    host = [KVBlock(b.token_ids, b.kv.cpu().pin_memory()) for b in blocks]
    side = torch.cuda.Stream()
    arrived: list[KVBlock] = []
    ready: list[BlockReady | None] = []
    calls: list[int] = []
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        for i, block in enumerate(host):
            arrived.append(KVBlock(block.token_ids, block.kv.to("cuda", non_blocking=True)))
            event = torch.cuda.Event()
            event.record(side)

            def wait(event: torch.cuda.Event = event, i: int = i) -> None:
                calls.append(i)
                torch.cuda.current_stream().wait_event(event)

            ready.append(None if i == 0 else wait)
    for block in arrived[1:]:
        block.kv.record_stream(torch.cuda.current_stream())
    torch_buf, fused_buf, _ = _stitch_both(engine, blocks, PositionMode.REORDERED)
    plan = plan_positions("reordered", [b.num_tokens for b in blocks])
    buffer = KVBuffer(engine.spec, plan.context_tokens + 4)
    buffer.data.fill_(POISON)
    stitch_into(buffer, engine.forward.rotary, arrived, plan, ready, engine.fused_stitch)
    torch.cuda.synchronize()
    assert calls == list(range(1, len(blocks)))
    assert torch.equal(buffer.data[:, :, :, : plan.context_tokens], torch_buf[:, :, :, : plan.context_tokens])
    # Host-resident (pinned) blocks are copied over inside the fused stitch, as the torch path does.
    buffer.truncate(0, 0)
    stitch_into(buffer, engine.forward.rotary, host, plan, None, engine.fused_stitch)
    torch.cuda.synchronize()
    assert torch.equal(buffer.data[:, :, :, : plan.context_tokens], fused_buf[:, :, :, : plan.context_tokens])


@pytest.mark.gpu
@NEEDS_TRITON_CUDA
def test_gate_passes_with_the_fused_stitch(get_engine: Callable[..., StitchEngine], arch: str) -> None:
    engine = get_engine(arch, "cuda")
    assert engine.fused_stitch is not None
    result = run_gate(engine)
    assert result.passed, result
    torch_engine = StitchEngine(engine.model, cuda_graphs=False, fused_stitch=False)
    torch_result = run_gate(torch_engine)
    # Same buffers bit for bit, so the same logits.
    assert result.max_abs_logit_diff == pytest.approx(torch_result.max_abs_logit_diff, abs=1e-6)


@pytest.mark.gpu
@NEEDS_TRITON_CUDA
def test_fused_scales_chunk_keys_like_torch_under_a_context_temperature(
    get_engine: Callable[..., StitchEngine],
) -> None:
    engine = get_engine("qwen2", "cuda")
    blocks = _blocks(engine, (21, 40), seed=9)
    torch_buf, fused_buf, used = _stitch_both(engine, blocks, PositionMode.REORDERED, temperature=0.7)
    assert torch.equal(torch_buf, fused_buf)
    plain, _, _ = _stitch_both(engine, blocks, PositionMode.REORDERED)
    prefix = blocks[0].num_tokens
    assert torch.equal(fused_buf[:, :, :, :prefix], plain[:, :, :, :prefix])  # the prefix keeps its keys
    assert torch.equal(fused_buf[:, 1, :, :used], plain[:, 1, :, :used])  # values are never scaled
    ratio = fused_buf[:, 0, :, prefix:used].float().norm() / plain[:, 0, :, prefix:used].float().norm()
    assert abs(float(ratio) - 1 / 0.7) < 1e-2
