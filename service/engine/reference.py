"""The reference: one full forward of the HF model itself over the joined ids, with the independent mask.

Mask (TurboRAG fig. 2, Block-Attention fig. 1): the prefix is causal; each chunk block sees only itself,
causally (and the whole prefix before itself, where chunks are precomputed after it: APE's shared prefix); the
tail (question and generated tokens) sees everything before it. Positions are the stitch plan's.
This path shares no attention or cache code with the engine, which is what makes it a gate.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch

from service.engine.kv_layout import ChunkContext
from service.engine.model import LoadedModel
from service.engine.prompt import PromptIds
from service.engine.stitch import PositionMode

_TAIL = -1


def independent_mask(block_lengths: Sequence[int], tail_tokens: int, prefix_visible: bool = False) -> torch.Tensor:
    """Bool [N, N], True where a query (row) may attend to a key (column); `prefix_visible`: chunk rows see the
    prefix (block 0) too."""
    segments = [torch.full((n,), i) for i, n in enumerate(block_lengths)]
    segments.append(torch.full((tail_tokens,), _TAIL))
    segment = torch.cat(segments)
    size = segment.numel()
    causal = torch.ones(size, size, dtype=torch.bool).tril()
    same_block = segment.unsqueeze(1) == segment.unsqueeze(0)
    tail_rows = (segment == _TAIL).unsqueeze(1)
    allowed = same_block | tail_rows
    if prefix_visible:
        allowed |= (segment == 0).unsqueeze(0)
    return causal & allowed


def reference_positions(
    mode: PositionMode | str, block_lengths: Sequence[int], tail_tokens: int, chunk_start: int = 0
) -> torch.Tensor:
    """Positions by definition, written independently of the stitcher's planner so the gate can catch it.

    reordered: 0..N-1 over the whole sequence. composite: the prefix (block 0) at 0..P-1, each chunk at the
    positions it was precomputed at (chunk_start..chunk_start+len-1), and the tail at its true index.
    """
    context = sum(block_lengths)
    tail = torch.arange(context, context + tail_tokens)
    if PositionMode(mode) is PositionMode.REORDERED:
        return torch.cat([torch.arange(context), tail])
    prefix, *chunks = block_lengths
    return torch.cat([torch.arange(prefix), *(torch.arange(chunk_start, chunk_start + n) for n in chunks), tail])


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
    model: LoadedModel,
    prompt: PromptIds,
    mode: PositionMode | str,
    generated: Sequence[int] = (),
    context: ChunkContext | str = ChunkContext.ALONE,
) -> torch.Tensor:
    """Reference logits [N, vocab] over a prompt; `generated` tokens join the tail after the question;
    `context`: what each chunk was precomputed after (its mask row and, in `composite`, its positions)."""
    lengths = [len(prompt.prefix), *(len(b) for b in prompt.blocks)]
    tail = len(prompt.question) + len(generated)
    ids = prompt.joined() + list(generated)
    after_prefix = ChunkContext(context) is ChunkContext.PREFIX
    if after_prefix and PositionMode(mode) is PositionMode.REORDERED:
        return _moved_chunks_logits(model, prompt, generated)
    positions = reference_positions(mode, lengths, tail, len(prompt.prefix) if after_prefix else 0)
    return reference_logits(model, ids, positions, independent_mask(lengths, tail, after_prefix))


@torch.inference_mode()
def _moved_chunks_logits(model: LoadedModel, prompt: PromptIds, generated: Sequence[int]) -> torch.Tensor:
    """fp32 logits [tail, vocab] (the tail's rows only) for chunks precomputed after the prefix and read at
    reordered positions: no single forward has them (a chunk's K/V were computed at P.., its keys are read at its
    slot), so the reference is built from HF's own pieces. Each chunk's K/V come from an HF forward of prefix +
    chunk; its keys, rotated there to P + j, are rotated further by (slot - P) with HF's rotary embedding (RoPE
    angles add); the tail then runs through HF's forward over that cache."""
    hf, device = model.hf, model.spec.device
    prefix = list(prompt.prefix)
    cache = _hf_forward(hf, prefix, 0, None).past_key_values
    layers = [(layer.keys, layer.values) for layer in cache.layers]
    slot = len(prefix)
    for block in prompt.blocks:
        own = _hf_forward(hf, prefix + list(block), 0, None).past_key_values
        turn = _rotation(hf, slot - len(prefix), len(block), device)
        for index, layer in enumerate(own.layers):
            keys, values = layer.keys[:, :, len(prefix) :], layer.values[:, :, len(prefix) :]
            moved = _rotate(keys, *turn)
            layers[index] = (torch.cat([layers[index][0], moved], 2), torch.cat([layers[index][1], values], 2))
        slot += len(block)
    stitched = type(cache)()
    for index, (keys, values) in enumerate(layers):
        stitched.update(keys, values, index)
    tail = list(prompt.question) + list(generated)
    out = _hf_forward(hf, tail, slot, stitched)
    logits: torch.Tensor = out.logits[0]
    return logits.float()


def _hf_forward(hf: Any, ids: Sequence[int], start: int, cache: Any) -> Any:
    device = next(hf.parameters()).device
    positions = torch.arange(start, start + len(ids), device=device).unsqueeze(0)
    inputs = torch.tensor([list(ids)], device=device)
    # transformers renamed `past_key_values` to `cache` within 5.x; the installed one may have either.
    name = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    return hf(input_ids=inputs, position_ids=positions, use_cache=True, **{name: cache})


def _rotation(hf: Any, shift: int, count: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [1, count, D] of a rotation by `shift` positions, from the model's rotary embedding (without its
    attention scaling, which the keys already carry once)."""
    rotary = hf.model.rotary_emb
    probe = torch.zeros(1, dtype=torch.float32, device=device)
    cos, sin = rotary(probe, torch.full((1, count), shift, device=device))
    scaling = float(getattr(rotary, "attention_scaling", 1.0))
    return cos / scaling, sin / scaling


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [1, H, T, D] rotated by cos/sin [1, T, D], as HF's `apply_rotary_pos_emb` rotates (rotate_half form)."""
    half = x.shape[-1] // 2
    rotated_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos.unsqueeze(1) + rotated_half * sin.unsqueeze(1)).to(x.dtype)


def reference_greedy(
    model: LoadedModel,
    prompt: PromptIds,
    mode: PositionMode | str,
    steps: int,
    context: ChunkContext | str = ChunkContext.ALONE,
) -> list[int]:
    """Greedy decoding by re-running the full reference forward for every new token (slow, exact)."""
    generated: list[int] = []
    for _ in range(steps):
        logits = prompt_reference_logits(model, prompt, mode, generated, context)
        generated.append(int(torch.argmax(logits[-1])))
    return generated
