"""Self-distillation's teacher: the starting model, answering and scoring under full attention (the naive path).

Fine-tuning on labelled QA teaches the labels' style along with the reading (a model tuned on short synthetic
answers answers shortly everywhere, and its naive accuracy on real passages fell). Self-distillation needs no
labels: the starting model with full causal attention at plain positions is the teacher, the model trained under
the served mask the student, and the student learns the teacher's next-token distributions (KL(teacher ||
student)) along the teacher's own greedy answers. What it learns is to read stitched context the way the same
model reads a full prompt; the answers' style is the model's own, so there is no style to learn. The samples
trained under full attention (`full_attention_share`) then start at KL 0 and keep the naive path where it was.

The teacher's answers are generated once, before training, in padded batches (left-padded for decoding).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from transformers import GenerationConfig

from service.engine.prompt import PromptIds


class FrozenTeacher:
    """The model as it was before training, scoring under full causal attention at positions 0..N-1.

    Full fine-tuning keeps a frozen copy in the compute dtype; LoRA uses the trained model itself with its
    adapters switched off (`off`, peft's `disable_adapter`), so no second copy of the weights is held.
    """

    def __init__(
        self, hf: Any, compute: torch.dtype, off: Callable[[], AbstractContextManager[Any]] | None = None
    ) -> None:
        self.hf = hf
        self.compute = compute
        self.off = off or contextlib.nullcontext

    @classmethod
    def frozen_copy(cls, hf: Any, compute: torch.dtype) -> FrozenTeacher:
        teacher = copy.deepcopy(hf).to(compute).eval()
        teacher.requires_grad_(False)
        return cls(teacher, compute)

    @property
    def device(self) -> torch.device:
        return next(self.hf.parameters()).device  # type: ignore[no-any-return]

    @torch.no_grad()
    def log_probs(self, input_ids: torch.Tensor, places: torch.Tensor) -> torch.Tensor:
        """fp32 log-probabilities at the flat `places` of the [D * (L - 1)] next-token predictions.

        No mask: the rows are padded on the right, so under the causal mask no real token sees a pad, and SDPA
        keeps its fused causal kernel."""
        device = input_ids.device
        with self.off(), torch.autocast(device.type, dtype=self.compute, enabled=self.compute != torch.float32):
            hidden = self.hf.model(input_ids=input_ids, use_cache=False).last_hidden_state[:, :-1]
            picked = hidden.reshape(-1, hidden.shape[-1]).index_select(0, places)
            logits = self.hf.lm_head(picked).float()
        return torch.log_softmax(logits, dim=-1)

    @torch.no_grad()
    def answers(
        self, prompts: Sequence[PromptIds], stops: set[int], max_new_tokens: int, batch_size: int, pad_id: int
    ) -> list[tuple[int, ...]]:
        """The teacher's greedy answer to each prompt (naive prefill), up to and with its first stop token, or
        `max_new_tokens` long when it does not stop. Prompts are batched by length, left-padded."""
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i].joined()))
        found: dict[int, tuple[int, ...]] = {}
        config = GenerationConfig(
            max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=sorted(stops), pad_token_id=pad_id
        )
        was_training = self.hf.training
        self.hf.eval()
        for start in range(0, len(order), batch_size):
            chosen = order[start : start + batch_size]
            ids, mask = left_padded([prompts[i].joined() for i in chosen], pad_id, self.device)
            with self.off(), torch.autocast(self.device.type, self.compute, enabled=self.compute != torch.float32):
                out = self.hf.generate(input_ids=ids, attention_mask=mask, generation_config=config)
            for index, row in zip(chosen, out[:, ids.shape[1] :].tolist(), strict=True):
                found[index] = until_stop(row, stops)
        self.hf.train(was_training)
        return [found[i] for i in range(len(prompts))]


def left_padded(rows: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) [B, L] with every row ending at the last column (generation appends there)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for row, tokens in enumerate(rows):
        ids[row, width - len(tokens) :] = torch.tensor(list(tokens))
        mask[row, width - len(tokens) :] = 1
    return ids.to(device), mask.to(device)


def until_stop(tokens: Sequence[int], stops: set[int]) -> tuple[int, ...]:
    """The tokens up to and with the first stop token (what follows is the batch's padding), all if none."""
    for index, token in enumerate(tokens):
        if token in stops:
            return tuple(tokens[: index + 1])
    return tuple(tokens)


def stop_ids(tokenizer: Any, hf: Any) -> set[int]:
    """The ids that end an answer, as the engine stops on them: the tokenizer's EOS and the generation config's
    (a chat model's end of turn, `<|im_end|>`, `<|eot_id|>`)."""
    ids: set[int] = set()
    for source in (tokenizer.eos_token_id, getattr(hf.generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list):
            ids.update(int(i) for i in source)
    return ids
