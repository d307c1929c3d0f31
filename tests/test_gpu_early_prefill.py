"""Early prefills on CUDA (`pytest -m gpu tests/test_gpu_early_prefill.py`): questions joining running answers
are admitted and prefilled on the side stream, beside the running step, through the prefill graphs. Every token and
text is that of the same early prefills run on the one stream (the same kernels in the same order: bf16, exact), so
nothing the two streams share is read before it is written. (Against the riding run, whose steps have other GEMM
shapes, bf16 tokens may part at a near tie: only the counts are compared.)"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from service.engine.engine import StitchEngine
from service.engine.scheduler import Scheduler
from tests.test_engine_shared_mixed_graph import NEEDS_GPU, sums_in_one_order
from tests.test_engine_shared_scheduler import (
    ASKS,
    Run,
    assert_nothing_pinned,
    block_sizes,
    join_one_by_one,
    nan_arena,
    nan_pool,
)


@pytest.mark.gpu
@NEEDS_GPU
@pytest.mark.parametrize("arch", ("llama", "qwen2"))
def test_early_prefills_on_the_side_stream_decode_the_riding_runs_tokens(
    get_engine: Callable[[str, str], StitchEngine], arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = get_engine(arch, "cuda")
    sums_in_one_order(monkeypatch)

    def run(early_below: int, one_stream: bool = False) -> tuple[list[tuple[list[int], str, str]], int, int, bool]:
        arena = nan_arena(engine, sum(block_sizes(engine)))
        scheduler = Scheduler(
            engine,
            nan_pool(engine, 4000),
            8,
            overlap=True,
            cuda_graphs=True,
            arena=arena,
            prefill_with_decode=True,
            early_prefill_below=early_below,
        )
        side = scheduler.runner.side
        if one_stream and side is not None:  # the side stream's work on the main stream, in program order
            side._stream, side._cuda = None, False
        requests = Run(engine, ASKS)
        join_one_by_one(scheduler, requests.requests)
        assert scheduler.shared is not None
        scheduler.shared.close()
        assert_nothing_pinned(scheduler)
        on_side = side is not None and side._stream is not None
        return requests.outcomes(), scheduler.prefilled_early, scheduler.prefilled_with_decode, on_side

    riding, early_none, rode, _ = run(0)
    in_order, _, _, in_order_on_side = run(8, one_stream=True)
    early, prefilled_early, rode_early, on_side = run(8)
    assert (early_none, rode) == (0, 3) and (prefilled_early, rode_early) == (3, 0)
    assert on_side and not in_order_on_side
    assert early == in_order
    assert [len(tokens) for tokens, _, _ in early] == [len(tokens) for tokens, _, _ in riding]
