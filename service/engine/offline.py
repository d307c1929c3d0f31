"""Generating in-process through the server's scheduler: one path from request to tokens for everything that
generates outside the server (`kvstitch eval`, the quality demo, the benchmark tables, the tests).

`OfflineScheduler.run(requests)` adds every request to one `Scheduler` built as the server builds it
(`scheduler_config.build_scheduler`) over a `KVPool` with room for all of them at once, steps it until each has
ended, and returns their results in order. The scheduler (its pool and its captured graphs) is kept for the next
run while that run's requests fit its pool, so a loop of single requests (an eval) captures its graphs once.
`generate` is the one-request form: a prompt in, a `GenerationResult` out, text deltas through `on_text`;
`answer_request` builds its request, for callers that run several at once.

`shared=True` runs the scheduler in shared-chunk mode (`KVSTITCH_SHARED_CHUNKS=on`, `shared_chunks.py`) over a
chunk arena sized for the run's chunks, so turbo answers read them from the arena as a server with the setting on
serves them. The arena's placement (its base, the chunks' precomputed positions) and the segment attention's
context temperature are the engine's at the scheduler's build, so a run after either changed (an eval switches
them per variant) builds a new scheduler.
"""

from __future__ import annotations

from collections.abc import Sequence

from service.engine.batch_request import BatchRequest, TextSink
from service.engine.chunk_arena import ChunkArena
from service.engine.engine import GenerationMode, GenerationResult, StitchEngine
from service.engine.kv_layout import KVBlock
from service.engine.kv_pool import KVPool, Poison
from service.engine.prompt import PromptIds
from service.engine.recompute_spec import NO_RECOMPUTE, RecomputeSpec, parse_recompute
from service.engine.sampling import SamplingParams
from service.engine.scheduler import Scheduler
from service.engine.scheduler_config import BatchingOptions, build_scheduler, release, scratch_slots
from service.engine.stitch import BlockReady, PositionMode


class OfflineScheduler:
    """The server's scheduler, run to the end of each batch of requests on the caller's thread (which then owns
    the engine, as the engine loop does in a server).

    `poison`: what freed slabs (and evicted arena ranges) are filled with (NaN in the tests, so a read of a slot a
    request did not write shows); `options`: the batching settings (the server's defaults unless given);
    `shared`: turbo answers read their chunks from a shared chunk arena (the shared-chunk mode)."""

    def __init__(
        self,
        engine: StitchEngine,
        options: BatchingOptions | None = None,
        poison: Poison | str = Poison.ZERO,
        shared: bool = False,
    ) -> None:
        self.engine = engine
        self.options = options or BatchingOptions()
        self.poison = Poison(poison)
        self.shared = shared
        self.scheduler: Scheduler | None = None

    def run(self, requests: Sequence[BatchRequest]) -> list[GenerationResult]:
        """Every request added at once and stepped until each ended; their results, in order. Raises the first
        request's error (after every request ended), ValueError when one can never run."""
        chunks = sum(len(b) for r in requests if r.mode is GenerationMode.TURBO for b in r.prompt.blocks)
        scheduler = self.scheduler_for(sum(r.tokens_needed for r in requests), chunks)
        try:
            for request in requests:
                scheduler.add(request)
            scheduler.run_until_idle()
        except BaseException as err:  # a refused request or a failed step: end what is left, for the next run
            scheduler.fail_all(err if isinstance(err, Exception) else RuntimeError("interrupted"))
            raise
        for request in requests:
            if request.error is not None:
                raise request.error
        return [r.result for r in requests]

    def scheduler_for(self, tokens: int, chunk_tokens: int = 0) -> Scheduler:
        """The kept scheduler when its pool has `tokens` free slots in one range (and, shared, its arena room for
        `chunk_tokens` at the engine's present placement), else a new one whose pool (and arena) holds them (a power
        of two, so a few growing runs do not each build one)."""
        if self.scheduler is not None and self.scheduler.pool.largest_free >= tokens and self._arena_fits(chunk_tokens):
            return self.scheduler
        self.close()
        slots = _power_of_two(tokens) + scratch_slots(self.engine)
        pool = KVPool(self.engine.spec, slots * self.engine.spec.kv_bytes_per_token(), self.poison)
        arena = self._arena(chunk_tokens) if self.shared else None
        self.scheduler = build_scheduler(self.engine, pool, self.options, arena=arena)
        return self.scheduler

    def _arena(self, chunk_tokens: int) -> ChunkArena:
        engine = self.engine
        budget = _power_of_two(chunk_tokens) * engine.spec.kv_bytes_per_token()
        return ChunkArena(engine.spec, engine.forward.rotary, budget, base=engine.chunk_start, poison=self.poison)

    def _arena_fits(self, chunk_tokens: int) -> bool:
        """Not shared, or the kept arena holds `chunk_tokens` at once, at the engine's chunk placement, context
        temperature and scale (fixed when its scheduler was built)."""
        if not self.shared:
            return True
        shared = self.scheduler.shared if self.scheduler is not None else None
        if shared is None:
            return False
        engine = self.engine
        return (
            shared.arena.slots >= chunk_tokens
            and shared.arena.base == engine.chunk_start
            and shared.decoder.context.temperature == engine.context_temperature
            and shared.decoder.context.scale == engine.context_scale
        )

    def close(self) -> None:
        """Give the scheduler's graphs and pool memory back (a later run builds a new one)."""
        scheduler, self.scheduler = self.scheduler, None
        if scheduler is None:
            return
        release(scheduler)


def _power_of_two(tokens: int) -> int:
    """The power of two at or above `tokens` (2 at least)."""
    return 1 << max(tokens - 1, 1).bit_length()


def generate(
    engine: StitchEngine,
    prompt: PromptIds,
    sampling: SamplingParams,
    mode: GenerationMode | str = GenerationMode.TURBO,
    positions: PositionMode | str = PositionMode.REORDERED,
    chunk_kv: Sequence[KVBlock] | None = None,
    chunk_ready: Sequence[BlockReady | None] | None = None,
    recompute: RecomputeSpec | str = NO_RECOMPUTE,
    on_text: TextSink | None = None,
    runner: OfflineScheduler | None = None,
) -> GenerationResult:
    """One request through the server's scheduler, alone; its result (text deltas through `on_text` as they come).

    Turbo without `chunk_kv` precomputes the chunks at admission; `chunk_ready` goes with `chunk_kv` (blocks
    still landing on the device). `runner`: a kept `OfflineScheduler` (its graphs reused), else a new one, closed
    after."""
    request = answer_request(prompt, sampling, mode, positions, chunk_kv, chunk_ready, recompute, on_text)
    if runner is not None:
        return runner.run([request])[0]
    alone = OfflineScheduler(engine)
    try:
        return alone.run([request])[0]
    finally:
        alone.close()


def answer_request(
    prompt: PromptIds,
    sampling: SamplingParams,
    mode: GenerationMode | str = GenerationMode.TURBO,
    positions: PositionMode | str = PositionMode.REORDERED,
    chunk_kv: Sequence[KVBlock] | None = None,
    chunk_ready: Sequence[BlockReady | None] | None = None,
    recompute: RecomputeSpec | str = NO_RECOMPUTE,
    on_text: TextSink | None = None,
    keep_first_logits: bool = False,
) -> BatchRequest:
    """The request `generate` runs (a recompute spec given as text parsed), for callers that run several at once
    through `OfflineScheduler.run`; `keep_first_logits`: its first token's logits kept (`first_logits`)."""
    spec = parse_recompute(recompute) if isinstance(recompute, str) else recompute
    return BatchRequest(
        prompt,
        sampling,
        mode,
        positions,
        chunk_kv,
        chunk_ready,
        on_text=on_text,
        recompute=spec,
        keep_first_logits=keep_first_logits,
    )
