"""Padded batches of training samples, each under its own mask and positions, and their losses in one forward.

A batch stacks samples of different lengths, padded on the right: ids with the pad id, positions 0, no loss.
Each sample keeps the [N, N] mask it was built with (the served independent mask, or full causal); the batch's
[B, 1, L, L] additive mask holds it in the top-left corner, and a pad row attends only to itself (a row with no
allowed key at all would be a softmax over nothing). Real rows never see a pad: every pad comes after the real
tokens, and both masks are causal. So each sample's logits in the batch are its logits alone, which is what
`tests/quality/test_quality_finetune_batch.py` checks against the one-sample forward.

Logits are computed only where there is a loss (the vocabulary projection of every prompt token would be most
of the work for a small model), as `pretrain.answer_loss` does. A sample's loss is the mean over its learnt
tokens, so a long answer does not outweigh a short one, and the step's loss the mean over its samples: the same
numbers as the one-sample loop, which divided each sample's mean by the step's sample count.

Two losses, per sample:
- cross-entropy on the target tokens (labelled QA: the reference answer and EOS);
- self-distillation: KL(teacher || student) on each target token's next-token distribution, the teacher being
  the starting model under full causal attention at plain positions (the naive path), the student the model
  being trained under the sample's mask. The targets are then the teacher's own greedy answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

IGNORE = -100  # label of tokens without loss (cross_entropy's ignore_index)


@dataclass(frozen=True)
class TrainingSample:
    """One sequence with its mask, positions and labels, all [N] (the mask [N, N], True: may attend).
    `distill`: learn the teacher's distributions at the labelled places rather than the labels themselves.
    `teacher_ids`: what the teacher reads when the sequence holds tokens the served prompt has not (copies of the
    prefix, all before the learnt tokens); None: the same ids."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    allowed: torch.Tensor
    labels: torch.Tensor
    distill: bool = False
    teacher_ids: torch.Tensor | None = None

    @property
    def teacher_input(self) -> torch.Tensor:
        return self.input_ids if self.teacher_ids is None else self.teacher_ids


@dataclass(frozen=True)
class PaddedBatch:
    input_ids: torch.Tensor  # [B, L], padded on the right
    positions: torch.Tensor  # [B, L]
    allowed: torch.Tensor  # [B, L, L] bool
    targets: torch.Tensor  # [B, L - 1]: the token each position predicts, IGNORE where there is no loss
    distill: torch.Tensor  # [B] bool
    teacher_ids: torch.Tensor  # [B, L'] what the teacher reads, padded on the right
    teacher_shift: torch.Tensor  # [B] how many more tokens a row has than its teacher's row (all before the loss)

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])


def collate(samples: Sequence[TrainingSample], pad_id: int) -> PaddedBatch:
    """The samples padded on the right to the longest, each mask in its corner of the batch mask."""
    width = max(len(s.input_ids) for s in samples)
    count = len(samples)
    ids = torch.full((count, width), pad_id, dtype=torch.long)
    positions = torch.zeros((count, width), dtype=torch.long)
    labels = torch.full((count, width), IGNORE, dtype=torch.long)
    allowed = torch.eye(width, dtype=torch.bool).repeat(count, 1, 1)
    for row, sample in enumerate(samples):
        size = len(sample.input_ids)
        ids[row, :size] = sample.input_ids
        positions[row, :size] = sample.positions
        labels[row, :size] = sample.labels
        allowed[row, :size, :size] = sample.allowed
    distill = torch.tensor([s.distill for s in samples], dtype=torch.bool)
    teacher_width = max(len(s.teacher_input) for s in samples)
    teacher_ids = torch.full((count, teacher_width), pad_id, dtype=torch.long)
    for row, sample in enumerate(samples):
        teacher_ids[row, : len(sample.teacher_input)] = sample.teacher_input
    shift = torch.tensor([len(s.input_ids) - len(s.teacher_input) for s in samples], dtype=torch.long)
    return PaddedBatch(ids, positions, allowed, labels[:, 1:], distill, teacher_ids, shift)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, 1, L, L] in `dtype`: 0 where a query may attend, the dtype's minimum elsewhere (SDPA wants the
    queries' dtype)."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask.unsqueeze(1)


class Teacher(Protocol):
    def log_probs(self, input_ids: torch.Tensor, places: torch.Tensor) -> torch.Tensor:
        """fp32 log-probabilities [T, vocab] of the full-attention forward over `input_ids` [D, L], at the flat
        indices `places` of its [D * (L - 1)] next-token predictions."""
        ...


@dataclass(frozen=True)
class LossPlaces:
    """Where a batch's losses fall, worked out on the host: the device never waits to learn an index."""

    flat: torch.Tensor  # [T] indices of the learnt tokens into the [B * (L - 1)] predictions, row-major
    rows: torch.Tensor  # [T] the sample of each
    labels: torch.Tensor  # [T] the target token of each
    labelled: torch.Tensor  # indices into T of the cross-entropy tokens
    distilled: torch.Tensor  # indices into T of the KL tokens
    teacher_flat: torch.Tensor  # the KL tokens' indices into the distillation rows' [D * (L' - 1)] predictions
    counts: torch.Tensor  # [B] learnt tokens per sample (at least 1)


def loss_places(batch: PaddedBatch) -> LossPlaces:
    width = batch.targets.shape[1]
    where = batch.targets != IGNORE
    rows, cols = where.nonzero(as_tuple=True)
    distill = batch.distill[rows]
    teacher_row = torch.cumsum(batch.distill.long(), 0) - 1  # a distillation row's index among those rows
    teacher_width = batch.teacher_ids.shape[1] - 1
    teacher_cols = cols - batch.teacher_shift[rows]
    return LossPlaces(
        flat=rows * width + cols,
        rows=rows,
        labels=batch.targets[where],
        labelled=(~distill).nonzero().flatten(),
        distilled=distill.nonzero().flatten(),
        teacher_flat=teacher_row[rows[distill]] * teacher_width + teacher_cols[distill],
        counts=where.sum(dim=1).clamp(min=1),
    )


def sample_losses(
    hf: Any,
    batch: PaddedBatch,
    device: torch.device,
    compute: torch.dtype,
    teacher: Teacher | None = None,
) -> torch.Tensor:
    """Each sample's mean loss over its learnt tokens, [B] fp32: cross-entropy, or KL to `teacher` for the
    samples marked `distill`. `hf` is the causal LM (`.model` the decoder, `.lm_head` the output projection)."""
    places = loss_places(batch)
    if len(places.distilled) and teacher is None:
        raise ValueError("a batch with distillation samples needs a teacher")
    with torch.autocast(device.type, dtype=compute, enabled=compute != torch.float32):
        hidden = hf.model(
            input_ids=batch.input_ids.to(device),
            attention_mask=additive_mask(batch.allowed.to(device), compute),
            position_ids=batch.positions.to(device),
            use_cache=False,
        ).last_hidden_state[:, :-1]
        picked = hidden.reshape(-1, hidden.shape[-1]).index_select(0, places.flat.to(device))
        logits = hf.lm_head(picked).float()
    losses = torch.zeros(len(places.rows), device=device)
    if len(places.labelled):
        labelled = places.labelled.to(device)
        cross = torch.nn.functional.cross_entropy(
            logits.index_select(0, labelled), places.labels.to(device).index_select(0, labelled), reduction="none"
        )
        losses = losses.index_copy(0, labelled, cross)
    if teacher is not None and len(places.distilled):
        distilled = places.distilled.to(device)
        teacher_lp = teacher.log_probs(batch.teacher_ids[batch.distill].to(device), places.teacher_flat.to(device))
        student_lp = torch.log_softmax(logits.index_select(0, distilled), dim=-1)
        kl = torch.nn.functional.kl_div(student_lp, teacher_lp, log_target=True, reduction="none").sum(-1)
        losses = losses.index_copy(0, distilled, kl)
    sums = torch.zeros(batch.size, device=device).index_add(0, places.rows.to(device), losses)
    return sums / places.counts.to(device)
