"""The offline path in shared-chunk mode (`OfflineScheduler(shared=True)`): turbo answers read their chunks from a
chunk arena, as a server with `KVSTITCH_SHARED_CHUNKS=on` serves them, and give the copy path's tokens (fp32 CPU,
NaN-poisoned pool and arena); a run after the engine's chunk placement or context temperature changed gets a
scheduler whose arena matches them."""

from __future__ import annotations

from collections.abc import Callable

from service.engine.batch_request import BatchRequest
from service.engine.engine import GenerationResult, StitchEngine
from service.engine.gate import synthetic_ids
from service.engine.kv_layout import ChunkContext
from service.engine.offline import OfflineScheduler
from service.engine.prompt import PromptIds
from service.engine.sampling import SamplingParams

SAMPLING = SamplingParams(max_new_tokens=7, ignore_eos=True)
# (chunk indices, mode, positions): chunk 0 read by three turbo answers at different offsets, a naive one beside.
ASKS = (((0, 1), "turbo", "reordered"), ((2, 0), "turbo", "composite"), ((0,), "turbo", "reordered"))
NAIVE = ((1, 2), "naive", "reordered")


def _requests(engine: StitchEngine, asks: tuple[tuple[tuple[int, ...], str, str], ...]) -> list[BatchRequest]:
    corpus = synthetic_ids(engine, (17, 11, 23), seed=31)
    requests = []
    for index, (reads, mode, positions) in enumerate(asks):
        question = synthetic_ids(engine, [6], seed=40 + index)[0]
        prompt: PromptIds = engine.template.prompt([corpus[c] for c in reads], question)
        requests.append(BatchRequest(prompt, SAMPLING, mode, positions))
    return requests


def _tokens(results: list[GenerationResult]) -> list[tuple[list[int], str]]:
    return [(r.token_ids, r.text) for r in results]


def _run(engine: StitchEngine, shared: bool) -> tuple[list[tuple[list[int], str]], OfflineScheduler]:
    runner = OfflineScheduler(engine, poison="nan", shared=shared)
    return _tokens(runner.run(_requests(engine, (*ASKS, NAIVE)))), runner


def test_shared_runs_give_the_copy_paths_tokens_through_the_arena(get_engine: Callable[..., StitchEngine]) -> None:
    engine = get_engine("llama", "cpu")
    want, copy = _run(engine, shared=False)
    got, runner = _run(engine, shared=True)
    assert copy.scheduler is not None and copy.scheduler.shared is None
    copy.close()
    assert got == want
    scheduler = runner.scheduler
    assert scheduler is not None and scheduler.shared is not None
    stats = scheduler.shared.stats()
    assert stats.answers == len(ASKS) and stats.chunks == 3 and stats.pinned_chunks == 0  # naive: copy path
    assert scheduler.shared.arena.base == engine.chunk_start
    runner.close()
    assert runner.scheduler is None


def test_a_changed_chunk_placement_or_temperature_builds_a_matching_arena(
    get_engine: Callable[..., StitchEngine],
) -> None:
    """The eval switches the engine's chunk context and context temperature per variant: each shared run then reads
    an arena placed at the engine's chunk start, through segment attention at its temperature, and gives the copy
    path's tokens under the same settings."""
    engine = get_engine("qwen2", "cpu")
    runner = OfflineScheduler(engine, poison="nan", shared=True)
    runner.run(_requests(engine, ASKS[:1]))
    first = runner.scheduler
    kept = runner.run(_requests(engine, ASKS[2:]))
    assert runner.scheduler is first and kept  # same placement: the scheduler (and arena) is kept
    before = engine.chunk_context, engine.context_temperature
    try:
        for context, temperature in ((ChunkContext.PREFIX, 1.0), (ChunkContext.PREFIX, 0.7)):
            engine.chunk_context, engine.context_temperature = context, temperature
            want = _tokens(OfflineScheduler(engine, poison="nan").run(_requests(engine, ASKS)))
            got = _tokens(runner.run(_requests(engine, ASKS)))
            scheduler = runner.scheduler
            assert scheduler is not None and scheduler is not first and scheduler.shared is not None
            assert scheduler.shared.arena.base == engine.chunk_start == len(engine.template.prefix) > 0
            assert scheduler.shared.decoder.context.temperature == temperature
            assert scheduler.shared.stats().answers == len(ASKS)
            assert got == want
            first = scheduler
    finally:
        engine.chunk_context, engine.context_temperature = before
        runner.close()
