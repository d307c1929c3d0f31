"""The engine's step profile (`KVSTITCH_STEP_PROFILE_PATH`): it waits for a step with enough answers decoding,
profiles the next `steps` steps only, writes its table once, and then the loop drops it; on the CPU the table
lists ops (on a GPU, the device kernels)."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from service.engine.engine import StitchEngine
from service.engine.gate import synthetic_ids
from service.facade.types import DoneEvent
from service.kvcache.store import KVStore
from service.metrics import Metrics
from service.retrieval.collection import RetrievedChunk
from service.serving.answer_session import AnswerSession
from service.serving.runtime import open_engine_loop
from service.serving.step_profile import (
    Occupancy,
    ProfileRow,
    StepProfile,
    StepProfileConfig,
    occupancy,
    step_table,
)
from service.settings import Settings
from service.usecases.answer import Answerer, Question, Retrieval
from tests.test_engine_shared_fetch import answer, retrieved, shared_scheduler
from tests.test_engine_shared_scheduler import LENGTHS, block_sizes, nan_arena

CPU = torch.device("cpu")


def test_only_the_steps_after_a_big_enough_batch_are_profiled(tmp_path: Path) -> None:
    path = tmp_path / "out" / "steps.md"
    profile = StepProfile(StepProfileConfig(path, after_s=0.0, min_batch=2, steps=3), CPU)
    a = torch.ones(64, 64)

    def step(op: Callable[[], object], batch: int) -> bool:
        profile.before_step()
        op()
        return profile.after_step(batch)

    assert not step(lambda: torch.linalg.svd(a), 1)  # too small a batch: does not arm the profile
    assert not step(lambda: torch.linalg.svd(a), 2)  # arms it; this step itself was not profiled
    assert [step(lambda: a @ a, 4) for _ in range(3)] == [False, False, True]
    table = path.read_text()
    assert table.startswith("3 steps, 4.0 rows a step")
    assert re.search(r"\| aten::mm \| 3 \|", table), table
    assert "svd" not in table
    assert not path.with_name("steps.md.part").exists()


def test_a_profile_that_cannot_be_written_is_logged_and_dropped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "a file"
    blocker.write_text("")
    profile = StepProfile(StepProfileConfig(blocker / "steps.md", steps=1), CPU)
    profile.after_step(1)
    profile.before_step()
    with caplog.at_level(logging.ERROR):
        assert profile.after_step(1)
    assert "step profile not written" in caplog.text


def test_the_table_gives_each_rows_share_and_time_a_step() -> None:
    rows = [ProfileRow("kernel|a", 20, 3000.0), ProfileRow("b", 10, 1000.0)]
    table = step_table(rows, steps=10, batch_rows=320, wall_s=0.05, on_device=False)
    lines = table.splitlines()
    assert lines[0] == "10 steps, 32.0 rows a step, 5.00 ms a step (wall), 0.40 ms a step in CPU ops"
    assert lines[4] == "| kernel/a | 20 | 3.00 | 0.300 | 75.0% |"
    assert lines[5] == "| b | 10 | 1.00 | 0.100 | 25.0% |"


def test_occupancy_merges_overlapping_spans_and_counts_the_pauses_between_them() -> None:
    """Kernels of a replayed graph follow each other within microseconds; a pause over 50 µs is the device
    waiting for the host."""
    spans = [(0.0, 100.0), (50.0, 120.0), (130.0, 200.0), (400.0, 500.0), (480.0, 490.0), (700.0, 1000.0)]
    got = occupancy(spans[::-1])  # any order
    assert got == Occupancy(busy_us=120.0 + 70.0 + 100.0 + 300.0, span_us=1000.0, gaps=2, gap_us=200.0 + 200.0)
    assert occupancy([]) == Occupancy(0.0, 0.0, 0, 0.0)


def test_the_table_says_how_busy_the_device_was() -> None:
    rows = [ProfileRow("segment_partials_kernel", 10, 900.0)]
    busy = Occupancy(busy_us=9_000.0, span_us=10_000.0, gaps=4, gap_us=800.0)
    lines = step_table(rows, steps=5, batch_rows=500, wall_s=0.01, on_device=True, busy=busy).splitlines()
    assert lines[2] == "device busy 90.0% of the 10.0 ms from the first kernel to the last; 4 pauses over 50 µs, " + (
        "0.80 ms in all (0.160 ms a step)"
    )


def test_on_a_gpu_the_table_sums_the_kernels_by_kind_first() -> None:
    """Kernel names as torch's profiler gave them for a served step on an H200."""
    rows = [
        ProfileRow("segment_partials_kernel", 196, 5500.0),
        ProfileRow("nvjet_sm90_tst_144x128_64x6_2x1_v_bz_TNN", 19, 1300.0),
        ProfileRow("request_partials_kernel", 9, 2600.0),
        ProfileRow("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>", 24, 150.0),
        ProfileRow("segment_merge_kernel", 37, 500.0),
        ProfileRow("memcpy128", 19, 100.0),
        ProfileRow("void at::native::vectorized_layer_norm_kernel<c10::BFloat16, float, true>", 56, 350.0),
    ]
    lines = step_table(rows, steps=1, batch_rows=112, wall_s=0.012, on_device=True).splitlines()
    assert lines[0].endswith("10.50 ms a step in device kernels")
    assert lines[2:10] == [
        "| kind | ms a step | share |",
        "|---|---|---|",
        "| attention: running answers (segment partials) | 5.500 | 52.4% |",
        "| attention: riders' questions (request partials) | 2.600 | 24.8% |",
        "| GEMMs (weights) | 1.450 | 13.8% |",
        "| attention: merges | 0.500 | 4.8% |",
        "| elementwise, norms and the rest | 0.350 | 3.3% |",
        "| copies | 0.100 | 1.0% |",
    ]
    assert lines[11] == "| kernel | calls | ms | ms a step | share |"
    assert lines[13] == "| segment_partials_kernel | 196 | 5.50 | 5.500 | 52.4% |"


def test_the_engine_loop_profiles_its_own_steps_once(
    get_engine: Callable[[str, str], StitchEngine], qwen2_kv_store: KVStore, tmp_path: Path
) -> None:
    """An answer through the engine loop that the settings gave a profile: the table of its first steps is
    written, the answer is the one the loop gives without it, and the loop then holds no profile."""
    engine = get_engine("qwen2", "cpu")
    corpus = synthetic_ids(engine, LENGTHS, seed=21)
    chunks = [retrieved(engine, corpus[i], i) for i in range(3)]
    answers = [answered_through_a_loop(engine, qwen2_kv_store, chunks, path) for path in (tmp_path / "steps.md", None)]
    table = (tmp_path / "steps.md").read_text()
    assert table.startswith("2 steps, 1.0 rows a step")
    assert "aten::" in table
    assert answers[0].answer == answers[1].answer


def answered_through_a_loop(
    engine: StitchEngine, store: KVStore, chunks: list[RetrievedChunk], profile_path: Path | None
) -> DoneEvent:
    settings = Settings(step_profile_path=profile_path, step_profile_steps=2)
    loop = open_engine_loop(settings, engine)
    scheduler, _ = shared_scheduler(engine, store, nan_arena(engine, sum(block_sizes(engine))))
    loop.serve_answers(scheduler)
    answerer = Answerer(engine, store, lambda *_: [[]])

    def session_of(question: Question, retrieval: Retrieval) -> AnswerSession:
        return AnswerSession(loop, answerer, Metrics(), question, retrieval, loop.admit(), time.perf_counter())

    try:
        done = answer(session_of, engine, chunks, seed=1)
        assert loop.call(lambda: loop.step_profile) is None  # dropped after the step the answer ended in
    finally:
        loop.close()
    return done
