"""The reference: one full forward of the HF model itself over the joined ids, with the independent mask.

Mask (TurboRAG fig. 2, Block-Attention fig. 1): the prefix is causal; each chunk block sees only itself,
causally; the tail (question and generated tokens) sees everything before it. Positions are the stitch plan's.
This path shares no attention or cache code with the engine, which is what makes it a gate.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from service.engine.model import LoadedModel
from service.engine.prompt import PromptIds
from service.engine.stitch import PositionMode

_TAIL = -1


def independent_mask(block_lengths: Sequence[int], tail_tokens: int) -> torch.Tensor:
    """Bool [N, N], True where a query (row) may attend to a key (column)."""
    segments = [torch.full((n,), i) for i, n in enumerate(block_lengths)]
    segments.append(torch.full((tail_tokens,), _TAIL))
    segment = torch.cat(segments)
    size = segment.numel()
    causal = torch.ones(size, size, dtype=torch.bool).tril()
    same_block = segment.unsqueeze(1) == segment.unsqueeze(0)
    tail_rows = (segment == _TAIL).unsqueeze(1)
    return causal & (same_block | tail_rows)


def reference_positions(mode: PositionMode | str, block_lengths: Sequence[int], tail_tokens: int) -> torch.Tensor:
    """Positions by definition, written independently of the stitcher's planner so the gate can catch it.

    reordered: 0..N-1 over the whole sequence. composite: the prefix (block 0) at 0..P-1, each chunk at its
    local 0..len-1, and the tail at its true index.
    """
    context = sum(block_lengths)
    tail = torch.arange(context, context + tail_tokens)
    if PositionMode(mode) is PositionMode.REORDERED:
        return torch.cat([torch.arange(context), tail])
    return torch.cat([*(torch.arange(n) for n in block_lengths), tail])


@torch.inference_mode()
def reference_logits(
    model: LoadedModel, ids: Sequence[int], positions: torch.Tensor, allowed: torch.Tensor
) -> torch.Tensor:
    """fp32 logits [N, vocab] of the HF model's own forward under an explicit mask and positions."""
    device, dtype = model.spec.device, model.spec.dtype
    additive = torch.zeros(allowed.shape, dtype=dtype)
    additive.masked_fill_(~allowed, torch.finfo(dtype).min)
    out = model.hf(
        input_ids=torch.tensor([list(ids)], device=device),
        attention_mask=additive[None, None].to(device),
        position_ids=positions.unsqueeze(0).to(device),
        use_cache=False,
    )
    logits: torch.Tensor = out.logits[0]
    return logits.float()


def prompt_reference_logits(
    model: LoadedModel, prompt: PromptIds, mode: PositionMode | str, generated: Sequence[int] = ()
) -> torch.Tensor:
    """Reference logits [N, vocab] over a prompt; `generated` tokens join the tail after the question."""
    lengths = [len(prompt.prefix), *(len(b) for b in prompt.blocks)]
    tail = len(prompt.question) + len(generated)
    ids = prompt.joined() + list(generated)
    return reference_logits(model, ids, reference_positions(mode, lengths, tail), independent_mask(lengths, tail))


def reference_greedy(model: LoadedModel, prompt: PromptIds, mode: PositionMode | str, steps: int) -> list[int]:
    """Greedy decoding by re-running the full reference forward for every new token (slow, exact)."""
    generated: list[int] = []
    for _ in range(steps):
        logits = prompt_reference_logits(model, prompt, mode, generated)
        generated.append(int(torch.argmax(logits[-1])))
    return generated
