"""Per-request sampling inside a batch: each row by its own settings and generator, on the logits' device."""

from __future__ import annotations

import pytest
import torch

from service.engine.sampling import Sampler, SamplingParams, pick_rows

SETTINGS = (
    SamplingParams(),  # greedy
    SamplingParams(temperature=0.8, top_p=0.9, seed=1),
    SamplingParams(temperature=1.3, top_k=5, seed=2),
    SamplingParams(temperature=1.0, top_p=0.5, top_k=40, seed=3),
    SamplingParams(temperature=0.5, seed=4),
)


def _logits(device: str, rows: int, vocab: int = 64, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn((rows, vocab), generator=generator) * 2).to(device)


def test_each_row_picks_alone_what_it_picks_in_the_batch(device: str) -> None:
    dev = torch.device(device)
    batched = [Sampler(p, dev) for p in SETTINGS]
    alone = [Sampler(p, dev) for p in SETTINGS]
    picked: list[list[int]] = []
    for step in range(30):
        logits = _logits(device, len(SETTINGS), seed=step)
        together = pick_rows(logits, batched)
        assert together == [s.pick(logits[row]) for row, s in enumerate(alone)], f"step {step}"
        picked.append(together)
    columns = list(zip(*picked, strict=True))
    assert len(set(columns[1])) > 3  # the sampled rows do sample


def test_a_seeded_row_ignores_its_neighbours(device: str) -> None:
    """The same request beside different company (and batch sizes) draws the same tokens."""
    dev = torch.device(device)
    params = SamplingParams(temperature=1.0, top_k=30, seed=9)
    runs = []
    for neighbours in (0, 1, 4):
        samplers = [Sampler(params, dev)] + [Sampler(SETTINGS[1 + n % 4], dev) for n in range(neighbours)]
        runs.append(
            [
                pick_rows(_logits(device, 1 + neighbours, seed=s)[:1].expand(1 + neighbours, -1), samplers)[0]
                for s in range(20)
            ]
        )
    assert runs[0] == runs[1] == runs[2]


def test_the_race_samples_the_softmax(device: str) -> None:
    """Frequencies over many draws match softmax(logits / T) within a few standard errors."""
    dev = torch.device(device)
    logits = torch.tensor([0.0, 1.0, 2.0, 0.5, -1.0], device=dev)
    sampler = Sampler(SamplingParams(temperature=0.7, seed=11), dev)
    draws = 20000
    counts = torch.zeros(5)
    for _ in range(draws // 500):
        picks = pick_rows(logits.expand(500, -1), [sampler] * 500)
        counts += torch.bincount(torch.tensor(picks), minlength=5).float()
    expected = torch.softmax(logits.cpu() / 0.7, dim=-1)
    stderr = (expected * (1 - expected) / draws).sqrt()
    assert bool(((counts / draws - expected).abs() <= 5 * stderr + 1e-4).all()), counts / draws


def test_top_k_and_top_p_cut_as_the_single_sampler_did(device: str) -> None:
    dev = torch.device(device)
    logits = torch.tensor([[0.1, 2.0, 1.9, -1.0]] * 3, device=dev)
    samplers = [
        Sampler(SamplingParams(temperature=1.5, top_k=1, seed=3), dev),
        Sampler(SamplingParams(temperature=1.0, top_p=0.4, seed=3), dev),
        Sampler(SamplingParams(temperature=1.0, top_k=2, seed=5), dev),
    ]
    seen: list[set[int]] = [set(), set(), set()]
    for _ in range(200):
        for row, token in enumerate(pick_rows(logits, samplers)):
            seen[row].add(token)
    assert seen == [{1}, {1}, {1, 2}]


def test_rows_and_samplers_must_match() -> None:
    with pytest.raises(ValueError, match="one row per sampler"):
        pick_rows(torch.zeros(2, 4), [Sampler(SamplingParams(), torch.device("cpu"))])
