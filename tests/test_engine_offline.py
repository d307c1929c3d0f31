"""The offline path: requests run to the end through the server's scheduler, one at a time or several at once, on a
scheduler kept between runs while they fit its pool; a refused request leaves nothing behind."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from service.engine.batch_request import BatchRequest
from service.engine.engine import StitchEngine
from service.engine.gate import synthetic_ids
from service.engine.kv_pool import KVPool
from service.engine.offline import OfflineScheduler, generate
from service.engine.prompt import PromptIds
from service.engine.sampling import SamplingParams
from service.engine.scheduler_config import BatchingOptions, build_scheduler

SAMPLING = SamplingParams(max_new_tokens=6, ignore_eos=True)


def _prompt(engine: StitchEngine, seed: int, lengths: tuple[int, ...] = (14, 9)) -> PromptIds:
    return engine.template.prompt(synthetic_ids(engine, lengths, seed=seed), synthetic_ids(engine, [5], seed=seed)[0])


def test_a_batch_gives_each_request_its_tokens_alone_and_the_scheduler_is_kept(
    get_engine: Callable[..., StitchEngine],
) -> None:
    engine = get_engine("qwen2", "cpu")
    prompts = [_prompt(engine, seed) for seed in (1, 2, 3)]
    alone = [generate(engine, p, SAMPLING) for p in prompts]
    runner = OfflineScheduler(engine, poison="nan")
    deltas: list[str] = []
    requests = [BatchRequest(p, SAMPLING, on_text=deltas.append if i == 0 else None) for i, p in enumerate(prompts)]

    together = runner.run(requests)
    kept = runner.scheduler
    again = runner.run([BatchRequest(prompts[1], SAMPLING)])

    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert all(len(r.token_ids) == 6 and r.finish_reason == "length" for r in together)
    assert "".join(deltas) == together[0].text == alone[0].text
    assert runner.scheduler is kept and again[0].token_ids == alone[1].token_ids
    assert kept is not None and kept.pool.used_slots == 0 and not kept.has_work()
    runner.close()
    assert runner.scheduler is None


def test_a_larger_run_gets_a_larger_pool(get_engine: Callable[..., StitchEngine]) -> None:
    engine = get_engine("llama", "cpu")
    runner = OfflineScheduler(engine)
    small = BatchRequest(_prompt(engine, 4), SAMPLING)
    runner.run([small])
    first = runner.scheduler
    assert first is not None and first.pool.slots >= small.tokens_needed
    large = [BatchRequest(_prompt(engine, seed, (60, 50, 40)), SAMPLING) for seed in (5, 6)]
    runner.run(large)
    assert runner.scheduler is not first and first.pool.slots == 0  # the old pool was released
    assert runner.scheduler is not None and runner.scheduler.pool.slots >= sum(r.tokens_needed for r in large)
    runner.close()


def test_a_refused_request_leaves_nothing_queued(get_engine: Callable[..., StitchEngine]) -> None:
    engine = get_engine("qwen2", "cpu")
    runner = OfflineScheduler(engine)
    fine = BatchRequest(_prompt(engine, 7), SAMPLING)
    foreign = BatchRequest(_prompt(engine, 8), SAMPLING, chunk_kv=[])  # blocks that are not the prompt's

    with pytest.raises(ValueError, match="do not hold the prompt's chunk ids"):
        runner.run([fine, foreign])

    assert fine.result.finish_reason == "error" and runner.scheduler is not None
    assert not runner.scheduler.has_work()
    assert runner.run([BatchRequest(_prompt(engine, 7), SAMPLING)])[0].finish_reason == "length"
    runner.close()


def test_the_server_and_the_offline_path_build_one_scheduler(get_engine: Callable[..., StitchEngine]) -> None:
    """Unset tri-state options follow the device (graphs, overlap and questions in decode steps on CUDA only); set
    ones win."""
    engine = get_engine("qwen2", "cpu")
    pool = KVPool(engine.spec, 512 * engine.spec.kv_bytes_per_token())
    default = build_scheduler(engine, pool, BatchingOptions())
    assert (default.graphs, default.overlap, default.prefill_with_decode) == (None, False, False)
    assert (default.max_batch, default.prefill_chunk, default.batch_prefill_min) == (32, 1024, 3)
    asked = build_scheduler(engine, pool, BatchingOptions(4, 0, 0, prefill_with_decode=True, overlap=True))
    assert (asked.overlap, asked.prefill_with_decode) == (True, True)
    assert (asked.max_batch, asked.prefill_chunk, asked.batch_prefill_min) == (4, 0, 0)
