"""Stage timing: synchronous laps hand their time at once; deferred laps only exist on CUDA (events) and are
handed by `settle()`; a stage name must be a `Timings` field."""

from __future__ import annotations

import time

import pytest
import torch

from service.engine.engine import Stopwatch, Timings, stage_setter

HAS_CUDA = torch.cuda.is_available()


def test_a_synchronous_lap_sets_its_stage_at_once_and_stages_add_up() -> None:
    timings = Timings()
    watch = Stopwatch(torch.device("cpu"), deferred=True)  # deferred is CUDA-only: on the CPU it stays synchronous
    assert not watch.deferred
    time.sleep(0.01)
    watch.lap(stage_setter(timings, "stitch_ms"))
    watch.lap(stage_setter(timings, "prefill_ms"))
    assert timings.stitch_ms >= 9.0 and 0.0 <= timings.prefill_ms < timings.stitch_ms
    timings.precompute_ms, timings.recompute_ms = 1.5, 2.5
    assert timings.stages_ms == pytest.approx(timings.stitch_ms + timings.prefill_ms + 4.0)


def test_a_stage_setter_refuses_a_name_that_is_not_a_stage() -> None:
    with pytest.raises(AttributeError, match="stich_ms"):
        stage_setter(Timings(), "stich_ms")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device here")
def test_gpu_deferred_laps_wait_for_settle_and_refuse_lap_ms() -> None:
    timings = Timings()
    watch = Stopwatch(torch.device("cuda"), deferred=True)
    a = torch.randn(2048, 2048, device="cuda")
    for _ in range(20):
        a = a @ a.T / 2048
    watch.lap(stage_setter(timings, "prefill_ms"))
    assert timings.prefill_ms == 0.0  # nothing handed before settle()
    with pytest.raises(RuntimeError, match="settle"):
        watch.lap_ms()
    watch.settle()
    assert timings.prefill_ms > 0.0
