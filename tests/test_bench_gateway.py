"""The gateway benchmark end to end on the CPU: the real gateway over the canned engine, clients in a second process
(its rates are the machine's; here the values that are not)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest.bench_gateway import main
from loadtest.stack_sampler import cpu_ms_by_group, parse_collapsed, thread_group
from service.devtools.ports import free_port

pytestmark = pytest.mark.slow

TOKENS = 8


def test_every_answer_through_the_gateway_is_the_canned_answer_whole(
    tiny_model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    argv = ["--model", str(tiny_model_dirs["qwen2"]), "--out", str(out), "--data-dir", str(tmp_path / "data")]
    argv += ["--port", str(free_port()), "--engine-port", str(free_port()), "--tokens", str(TOKENS)]
    argv += ["--concurrency", "1", "4", "--duration", "2", "--warmup-s", "0.5", "--max-requests", "40"]
    argv += ["--topics", "6", "--sentences", "4", "--top-k", "4"]

    assert main(argv) == 0

    report = json.loads((out / "report.json").read_text())
    assert report["chunks"] >= 6
    assert [level["concurrency"] for level in report["levels"]] == [1, 4]
    for level in report["levels"]:
        assert level["answers"] > 0 and level["errors"] == level["refused"] == 0
        assert level["complete"] == level["answers"]  # every answer's text is the TOKENS canned tokens, in order
        assert level["tokens_per_s"] == pytest.approx(level["answers_per_s"] * TOKENS, rel=0.01)
        assert 1 <= level["token_events_per_answer"] <= TOKENS
        cpu = level["cpu_ms_per_answer"]
        assert cpu["processes"]["gateway"] > 0 and "gateway-loop" in cpu["gateway_threads"]
        assert {"canned-engine", "clients", "kvstitch-embed"} <= set(cpu["processes"])
    assert report["table"].startswith("| clients | answers |")


def test_py_spy_stacks_are_counted_per_thread_group_without_waits() -> None:
    text = "\n".join(
        [
            "thread (11): gateway-loop;run (a.py:1);send (b.py:2) 3",
            "thread (11): gateway-loop;run (a.py:1);EpollSelector.select (selectors.py:468) 50",
            "thread (12): AnyIO worker thread;run (a.py:1);retrieve (c.py:3) 2",
            "thread (13): ThreadPoolExecutor-0_3;work (d.py:4) 1",
            "thread (14): ThreadPoolExecutor-0_4;work (d.py:4) 2",
            "thread (15);work (e.py:5) 4",  # no name: the process never imported threading
        ]
    )

    threads = parse_collapsed(text)

    loop = threads["gateway-loop"]
    assert (loop.samples, loop.own["send (b.py:2)"], loop.including["run (a.py:1)"]) == (3, 3, 3)
    assert threads["AnyIO worker thread"].samples == 2 and threads["ThreadPoolExecutor"].samples == 3
    assert threads["ThreadPoolExecutor"].thread_ids == {13, 14} and loop.thread_ids == {11}
    assert (threads["unnamed"].samples, threads["unnamed"].thread_ids) == (4, {15})
    # CPU per group from /proc by the OS ids sampled (the idle thread 16 is no group's).
    cpu = cpu_ms_by_group(threads, {11: 0.2, 13: 0.1, 14: 0.3, 16: 5.0}, answers=100)
    assert cpu == pytest.approx(
        {"gateway-loop": 2.0, "AnyIO worker thread": 0.0, "ThreadPoolExecutor": 4.0, "unnamed": 0.0}
    )
    assert thread_group("Thread-2 (run)") == "Thread" and thread_group("retrieval") == "retrieval"
