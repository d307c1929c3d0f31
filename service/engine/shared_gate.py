"""The zero-copy path as the correctness gate runs it: a prompt's question fed through `SharedDecoder` over a chunk
arena, as the scheduler's shared mode feeds it (`shared_chunks.py`), with every question token's logits kept.

The question's first part goes in by one extend (the shared question prefill), the rest one token per decode step
(the shared decode step), so the gate holds both forwards to the reference. The arena and the pool are NaN-poisoned:
a read of any slot the path did not write turns the logits NaN, which fails the gate.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from service.engine.batch_decode import BatchDecoder, DecodeRows, ExtendRows
from service.engine.chunk_arena import ChunkArena
from service.engine.engine import StitchEngine
from service.engine.kv_layout import KVBlock
from service.engine.kv_pool import KVPool, Poison
from service.engine.segment_attention import ContextScaling
from service.engine.shared_decode import SharedDecoder, decode_batch, extend_batch, place_prefix, placements
from service.engine.stitch import PositionMode


def zero_copy_logits(
    engine: StitchEngine,
    chunk_kv: Sequence[KVBlock],
    question: Sequence[int],
    positions: PositionMode | str,
    split: int,
    kernels: bool | None = None,
) -> torch.Tensor:
    """fp32 logits [len(question) - split + 1, vocab] of question tokens split - 1 .. end: the first `split` tokens
    prefilled over the arena in one extend, each later one fed by a decode step. `kernels`: as `SharedDecoder`'s
    (None: the Triton kernels where they apply, else the torch reference)."""
    if not 1 <= split <= len(question):
        raise ValueError(f"split {split} outside 1..{len(question)}")
    spec = engine.spec
    per_token = spec.kv_bytes_per_token()
    prefix = engine.prefix_block
    tail = prefix.num_tokens + len(question)
    chunk_tokens = max(sum(b.num_tokens for b in chunk_kv), 1)
    arena = ChunkArena(spec, engine.forward.rotary, chunk_tokens * per_token, engine.chunk_start, Poison.NAN)
    pool = KVPool(spec, tail * per_token, Poison.NAN)
    try:
        plan = engine.plan(positions, [prefix, *chunk_kv])
        reads = [placements(plan, arena.acquire(chunk_kv, engine.kv_version))]
        slab = pool.allocate(tail)
        place_prefix(pool, slab, prefix, engine.forward.rotary)
        context = ContextScaling(temperature=engine.context_temperature)
        shared = SharedDecoder(BatchDecoder(engine.forward, pool), arena, context, kernels)
        ids = list(question)
        first = [(ids[:split], plan.question_start, slab.start, prefix.num_tokens)]
        logits = [shared.extend(ExtendRows.build(first, spec.device), extend_batch(first, reads))]
        position, used = plan.question_start + split, prefix.num_tokens + split
        for token in ids[split:]:
            used += 1
            span = [(slab.start, used)]
            rows = DecodeRows.build([token], [position], span, spec.device)
            logits.append(shared.step(rows, decode_batch([position], span, reads)))
            position += 1
        return torch.cat(logits).float()
    finally:
        arena.close()
        pool.release()
