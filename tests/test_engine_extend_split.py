"""The batched prefill's split-KV attention (`attention.extend_split`) on the CPU: its key ranges, per-token indices
and log-sum-exp merge, checked against the loop attention with flash-attention's varlen kernel (CUDA only)
replaced by a reference of its semantics, in both log-sum-exp layouts flash builds return. On CUDA the real
kernel runs it: the last test here, the start-up probe (`batch_decode.probe_extend`) and the GPU tests of
test_engine_batch.py."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from service.engine import attention
from service.engine.batch_decode import ExtendRows, _extend_loop

HEADS, KV_HEADS, DIM, POOL = 4, 2, 8, 400


def reference_flash(layout: str) -> Any:
    """flash varlen's contract as `attention._flash` uses it: sequence b has queries cu_q[b]..cu_q[b+1] and keys
    from cu_k[b] (used_k[b] of them, else up to cu_k[b+1]); causal aligns to the bottom right; an empty key
    range gives a zero output and a +inf log-sum-exp. lse: [H, total_q] ("flat") or [B, H, max_q] ("padded")."""

    def flash(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_q: torch.Tensor,
        cu_k: torch.Tensor,
        max_q: int,
        max_k: int,
        causal: bool,
        scale: float,
        used_k: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        sequences = cu_q.shape[0] - 1
        out = torch.zeros_like(q)
        flat = torch.full((q.shape[1], q.shape[0]), math.inf)
        padded = torch.full((sequences, q.shape[1], max_q), math.inf)
        for b in range(sequences):
            q0, q1 = int(cu_q[b]), int(cu_q[b + 1])
            k0 = int(cu_k[b])
            n_k = int(used_k[b]) if used_k is not None else int(cu_k[b + 1]) - k0
            assert q1 - q0 <= max_q and n_k <= max_k
            if q1 == q0 or n_k == 0:
                continue
            keys = k[k0 : k0 + n_k].repeat_interleave(HEADS // KV_HEADS, dim=1)  # [n_k, H, D]
            scores = torch.einsum("thd,khd->htk", q[q0:q1].float(), keys.float()) * scale
            if causal:
                t = torch.arange(q1 - q0).unsqueeze(1)
                visible = torch.arange(n_k).unsqueeze(0) <= t + n_k - (q1 - q0)
                scores = scores.masked_fill(~visible, -math.inf)
            lse = torch.logsumexp(scores, dim=-1)  # [H, T]
            values = v[k0 : k0 + n_k].repeat_interleave(HEADS // KV_HEADS, dim=1).float()
            out[q0:q1] = torch.einsum("htk,khd->thd", torch.softmax(scores, dim=-1), values).to(q.dtype)
            flat[:, q0:q1] = lse
            padded[b, :, : q1 - q0] = lse
        return out, flat if layout == "flat" else padded

    return flash


# (slab start, live slots before, new tokens): contexts longer and shorter than the splits, an empty one
# (the graphs' padding row), and a row with one new token (a running answer's, when questions share its step).
# A row with no new token (an empty bucket row) is the next test's.
REQUESTS = ((3, 40, 5), (100, 0, 7), (150, 90, 1), (260, 5, 3))


@pytest.mark.parametrize("layout", ["flat", "padded"])
@pytest.mark.parametrize("splits", [2, 8])
def test_split_context_ranges_merge_to_the_loop_attention(
    layout: str, splits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(attention, "_flash", reference_flash(layout))
    generator = torch.Generator().manual_seed(0)
    kv = torch.full((2, KV_HEADS, POOL, DIM), math.nan)  # a range reaching outside its slab shows as NaN
    for start, live, new in REQUESTS:
        kv[:, :, start : start + live + new] = torch.randn((2, KV_HEADS, live + new, DIM), generator=generator)
    rows = ExtendRows.build([([0] * new, 0, start, live) for start, live, new in REQUESTS], torch.device("cpu"))
    total = sum(new for *_, new in REQUESTS)
    q = torch.randn((total, HEADS, DIM), generator=generator)
    bounds = (rows.max_new, rows.max_used)

    got = attention.extend_split(rows.cu_q, rows.starts, rows.used, bounds, POOL, splits)(q, kv[0], kv[1], 0.3)
    want = _extend_loop(rows.spans)(q, kv[0], kv[1], 0.3)

    assert not torch.isnan(got).any()
    assert torch.allclose(got, want, atol=1e-5), float((got - want).abs().max())


def test_a_row_without_new_tokens_in_the_batch_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty bucket row (no queries, as `extend_layout` pads) between real rows leaves their outputs alone."""
    monkeypatch.setattr(attention, "_flash", reference_flash("padded"))
    generator = torch.Generator().manual_seed(1)
    kv = torch.randn((2, KV_HEADS, POOL, DIM), generator=generator)
    q = torch.randn((6, HEADS, DIM), generator=generator)
    starts, used = torch.tensor([0, 200, 100]), torch.tensor([50, 1, 30])
    with_empty = attention.extend_split(torch.tensor([0, 4, 4, 6]), starts, used, (4, 50), POOL, 4)
    without = attention.extend_split(torch.tensor([0, 4, 6]), starts[[0, 2]], used[[0, 2]], (4, 50), POOL, 4)
    assert torch.equal(with_empty(q, kv[0], kv[1], 0.3), without(q, kv[0], kv[1], 0.3))


def test_splits_shrink_as_the_new_tokens_grow() -> None:
    assert [attention.extend_splits(t) for t in (1, 64, 256, 512, 1024, 2048, 4096)] == [8, 8, 8, 4, 1, 1, 1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
@pytest.mark.parametrize("splits", [4, 8])
def test_gpu_split_context_ranges_through_flash_match_the_loop(splits: int) -> None:
    """The real kernel on CUDA, bf16, Qwen2-7B's head shape (28 query heads over 4 KV heads of 128): the split
    attention against the loop's, long and short contexts, an empty one, NaN everywhere outside the slabs."""
    heads, kv_heads, dim, pool, device = 28, 4, 128, 12_000, torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)
    requests = ((0, 8_000, 51), (8_100, 0, 7), (8_200, 3_000, 1), (11_300, 5, 60))
    kv = torch.full((2, kv_heads, pool, dim), math.nan, dtype=torch.bfloat16, device=device)
    for start, live, new in requests:
        filled = torch.randn((2, kv_heads, live + new, dim), generator=generator, device=device)
        kv[:, :, start : start + live + new] = filled.to(torch.bfloat16)
    rows = ExtendRows.build([([0] * new, 0, start, live) for start, live, new in requests], device)
    total = sum(new for *_, new in requests)
    wide = torch.randn((total, heads + kv_heads, dim), generator=generator, device=device).to(torch.bfloat16)
    q = wide[:, :heads]  # a strided slice, as the forward passes it
    bounds = (rows.max_new, rows.max_used)

    got = attention.extend_split(rows.cu_q, rows.starts, rows.used, bounds, pool, splits)(q, kv[0], kv[1], dim**-0.5)
    want = _extend_loop(rows.spans)(q, kv[0], kv[1], dim**-0.5)

    assert not torch.isnan(got).any()
    assert float((got.float() - want.float()).abs().max()) <= 2e-2  # bf16 outputs of size ~1: a few ulps
