"""The fused log-sum-exp merge of a split prefill's partials (lse_merge.py) against torch's merge."""

from __future__ import annotations

import pytest
import torch

from service.engine import attention, lse_merge


def _partials(
    splits: int, tokens: int, heads: int, dim: int, device: str, empty: float = 0.3
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """flash-shaped partials: context outputs [splits * tokens, H, D] and own [tokens, H, D] in bf16, their fp32
    log-sum-exps [H, queries]; a fraction `empty` of the context (query, head) ranges is empty (+inf, zero output)."""
    generator = torch.Generator(device=device).manual_seed(splits * 1000 + tokens)
    context_out = torch.randn((splits * tokens, heads, dim), generator=generator, device=device)
    own_out = torch.randn((tokens, heads, dim), generator=generator, device=device)
    context_lse = torch.randn((heads, splits * tokens), generator=generator, device=device) * 4
    own_lse = torch.randn((heads, tokens), generator=generator, device=device) * 4
    hollow = torch.rand((heads, splits * tokens), generator=generator, device=device) < empty
    context_lse[hollow] = float("inf")
    context_out[hollow.t()] = 0.0
    return context_out.bfloat16(), context_lse, own_out.bfloat16(), own_lse


def _torch_merge(
    context_out: torch.Tensor, context_lse: torch.Tensor, own_out: torch.Tensor, own_lse: torch.Tensor, splits: int
) -> torch.Tensor:
    tokens, heads, dim = own_out.shape
    lse = torch.cat(
        (
            attention._lse_rows(context_lse, splits, tokens, heads),
            attention._lse_rows(own_lse, 1, tokens, heads),
        )
    )
    outs = torch.cat((context_out.view(splits, tokens, heads, dim), own_out.view(1, tokens, heads, dim)))
    return attention._merge(outs, lse)


def test_the_torch_merge_weighs_each_part_by_its_exp_lse_and_empty_ranges_nothing() -> None:
    """The reference the kernel is held to, checked by hand on one query and head: parts with lse 0 and log 3
    weigh 1 : 3; an empty range (+inf) weighs nothing."""
    context_out = torch.tensor([[[1.0, 0.0]], [[7.0, 7.0]]])  # 2 ranges x 1 token
    context_lse = torch.tensor([[0.0, float("inf")]])
    own_out, own_lse = torch.tensor([[[0.0, 2.0]]]), torch.tensor([[torch.log(torch.tensor(3.0)).item()]])
    merged = _torch_merge(context_out, context_lse, own_out, own_lse, 2)
    assert torch.allclose(merged, torch.tensor([[[0.25, 1.5]]]))


def test_the_fused_merge_does_not_apply_on_the_cpu_or_when_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    parts = _partials(2, 3, 4, 8, "cpu")
    assert not lse_merge.fused_merge_applies(*parts, 2)
    monkeypatch.setattr(lse_merge, "ENABLED", False)
    assert not lse_merge.fused_merge_applies(*parts, 2)


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize(
    ("splits", "tokens", "heads", "dim"),
    [(8, 122, 28, 128), (8, 1, 28, 128), (4, 37, 32, 128), (2, 5, 7, 80), (1, 3, 12, 64)],
)
def test_gpu_fused_merge_equals_the_torch_merge(splits: int, tokens: int, heads: int, dim: int) -> None:
    """Qwen2-7B's head shape with one question and one decode row's worth of tokens, Llama's 32 heads, an odd
    head count and a head dim under a power of two: the kernel's bf16 output within one rounding of torch's."""
    parts = _partials(splits, tokens, heads, dim, "cuda")
    assert lse_merge.fused_merge_applies(*parts, splits)
    got = lse_merge.fused_merge(*parts, splits)
    want = _torch_merge(*parts, splits)
    assert got.dtype == want.dtype == torch.bfloat16
    assert not torch.isnan(got).any()
    # Both sum the parts in the same order in fp32; exp's rounding differs, so a bf16 result may differ by an ulp.
    ulp = want.float().abs().clamp_min(1e-2) * 2**-7
    assert bool(((got.float() - want.float()).abs() <= ulp).all()), float((got.float() - want.float()).abs().max())


@pytest.mark.gpu
@GPU
def test_gpu_a_query_whose_context_ranges_are_all_empty_is_its_own_part() -> None:
    """A question at the start of an empty context: every range reports +inf; the merge returns the own output."""
    context_out, context_lse, own_out, own_lse = _partials(8, 4, 28, 128, "cuda", empty=1.0)
    got = lse_merge.fused_merge(context_out, context_lse, own_out, own_lse, 8)
    assert torch.equal(got, own_out)


@pytest.mark.gpu
@GPU
def test_gpu_split_prefill_attention_uses_the_fused_merge(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the split attention goes through the kernel (counted), and agrees with the torch merge's answer."""
    heads, kv_heads, dim, pool, device = 28, 4, 128, 4_096, torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(3)
    kv = torch.randn((2, kv_heads, pool, dim), generator=generator, device=device).to(torch.bfloat16)
    q = torch.randn((9, heads, dim), generator=generator, device=device).to(torch.bfloat16)
    cu_q, starts, used = (torch.tensor(x, device=device) for x in ([0, 6, 9], [0, 2_000], [1_500, 700]))
    attend = attention.extend_split(cu_q, starts, used, (6, 1_500), pool, 8)
    calls: list[int] = []
    original = lse_merge.fused_merge

    def counted(*args: torch.Tensor | int) -> torch.Tensor:
        calls.append(1)
        return original(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(attention, "fused_merge", counted)
    fused = attend(q, kv[0], kv[1], dim**-0.5)
    monkeypatch.setattr(lse_merge, "ENABLED", False)
    unfused = attend(q, kv[0], kv[1], dim**-0.5)
    assert len(calls) == 1
    assert float((fused.float() - unfused.float()).abs().max()) <= 2e-2
