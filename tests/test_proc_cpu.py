"""The /proc CPU accounting of the load tests (`loadtest.proc_cpu`) on a child process and threads that burn a known
amount of CPU: each burns until its own CPU clock has advanced by that much, so the amount holds however busy the
machine is."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from loadtest.proc_cpu import children_of, cpu_snapshot, cpu_use, thread_deltas
from loadtest.stack_sampler import Profiles, find_py_spy

CHILD_BURN_S = 0.4
THREAD_BURN_S = 0.3
ENDED_BURN_S = 0.2
TICK_S = 0.02  # /proc counts in clock ticks (10 ms), read twice
ANSWERS = 10

# Says ready, burns CHILD_BURN_S of its own CPU on each line it reads, says done; exits when its stdin closes.
CHILD = f"""
import sys, threading, time  # threading: py-spy names a thread only where the module is loaded
print("ready", flush=True)
for _ in sys.stdin:
    end = time.process_time() + {CHILD_BURN_S}
    while time.process_time() < end:
        pass
    print("done", flush=True)
"""


def burn_thread_cpu(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


@contextmanager
def burner_child() -> Iterator[subprocess.Popen[str]]:
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None
    try:
        assert child.stdout.readline().strip() == "ready"
        yield child
    finally:
        child.stdin.close()
        child.wait(timeout=10)


def burn_once(child: subprocess.Popen[str]) -> None:
    assert child.stdin is not None and child.stdout is not None
    child.stdin.write("go\n")
    child.stdin.flush()
    assert child.stdout.readline().strip() == "done"


def test_a_child_found_by_pid_is_charged_the_cpu_it_burned() -> None:
    with burner_child() as child:
        assert child.pid in children_of(os.getpid())
        roles = {"child": child.pid, "gone": None}
        before = cpu_snapshot(roles)
        burn_once(child)
        after = cpu_snapshot(roles)

    use = cpu_use(before, after, ANSWERS)

    burned = use["processes"]["child"]
    assert (
        CHILD_BURN_S * 1e3 / ANSWERS - TICK_S * 1e3 <= burned["ms_per_answer"] <= (CHILD_BURN_S + 0.1) * 1e3 / ANSWERS
    )
    # One thread did all of it, in no more wall time than the snapshots saw.
    assert 0 < burned["cores"] <= 1.05 and burned["busiest_thread_cores"] == pytest.approx(burned["cores"], abs=0.05)
    assert burned["cores"] == pytest.approx(burned["ms_per_answer"] * ANSWERS / 1e3 / use["wall_s"], rel=0.01)
    assert use["processes"]["gone"] is None


def test_a_child_that_started_between_the_snapshots_counts_from_zero() -> None:
    """As a question embedder's child replaced mid-run: its pid is new at the second snapshot."""
    with burner_child() as child:
        before = cpu_snapshot({"child": []})
        burn_once(child)
        after = cpu_snapshot({"child": [child.pid]})

    use = cpu_use(before, after, 1)

    # Its whole life: the burn and the interpreter's start-up.
    assert use["processes"]["child"]["ms_per_answer"] >= (CHILD_BURN_S - TICK_S) * 1e3


def test_this_processs_threads_are_grouped_by_name_and_the_groups_add_up_to_the_process() -> None:
    go, done, leave = threading.Event(), threading.Event(), threading.Event()

    def retrieval() -> None:  # alive through both snapshots
        go.wait()
        burn_thread_cpu(THREAD_BURN_S)
        done.set()
        leave.wait()

    worker = threading.Thread(target=retrieval, name="retrieval", daemon=True)
    worker.start()
    before = cpu_snapshot({"gateway": os.getpid()})
    go.set()
    assert done.wait(timeout=30)
    # A thread that starts and ends between the snapshots: its CPU is in the process's total only.
    ended = threading.Thread(target=burn_thread_cpu, args=(ENDED_BURN_S,), name="Thread-7 (burn)")
    ended.start()
    ended.join()
    wait_until_gone(ended.native_id)
    after = cpu_snapshot({"gateway": os.getpid()})
    leave.set()
    worker.join()

    use = cpu_use(before, after, ANSWERS)

    groups = use["thread_groups"]
    per_answer = THREAD_BURN_S * 1e3 / ANSWERS
    assert per_answer - TICK_S * 1e3 <= groups["retrieval"]["ms_per_answer"] <= per_answer + 0.05 * 1e3 / ANSWERS
    assert groups["other"]["ms_per_answer"] >= (ENDED_BURN_S - TICK_S) * 1e3 / ANSWERS
    assert use["threads"]["ended threads"]["ms_per_answer"] >= (ENDED_BURN_S - TICK_S) * 1e3 / ANSWERS
    total = use["processes"]["gateway"]["ms_per_answer"]
    assert sum(g["ms_per_answer"] for g in groups.values()) == pytest.approx(total, abs=0.01)
    assert use["processes"]["gateway"]["busiest_thread_cores"] >= groups["retrieval"]["cores"] - 0.01
    assert "event_loop" not in groups or groups["event_loop"]["cores"] == 0  # no thread of that name ran here
    assert thread_deltas(before, after, "gateway")[worker.native_id or -1] >= THREAD_BURN_S - TICK_S


def wait_until_gone(native_id: int | None, timeout_s: float = 10.0) -> None:
    """`join` returns once the Python thread is done; its OS thread may still be in /proc (with all its CPU) for a
    moment after, and would count as a live thread."""
    deadline = time.monotonic() + timeout_s
    while native_id is not None and Path(f"/proc/self/task/{native_id}").exists():
        assert time.monotonic() < deadline, f"thread {native_id} still in /proc"
        time.sleep(0.005)


@pytest.mark.skipif(find_py_spy(None) is None, reason="py-spy is not installed (an optional tool)")
def test_py_spy_profiles_a_process_and_its_threads_cpu_comes_from_proc(tmp_path: os.PathLike[str]) -> None:
    executable = find_py_spy(None)
    assert executable is not None
    with burner_child() as child:
        time.sleep(0.5)  # py-spy finds the interpreter once it has loaded
        spies = Profiles(executable, {"burner": child.pid}, Path(tmp_path))
        assert spies.sampler_pids and all(pid in children_of(os.getpid()) for pid in spies.sampler_pids)
        before = cpu_snapshot({"burner": child.pid})
        time.sleep(0.3)
        burn_once(child)
        after = cpu_snapshot({"burner": child.pid})
        text = spies.report({"burner": thread_deltas(before, after, "burner")}, ANSWERS, top=5)

    assert f"=== burner (pid {child.pid}), {ANSWERS} answers" in text
    # The main thread's CPU per answer from /proc (~40 ms), and the busy loop among its functions.
    header = next(line for line in text.splitlines() if line.startswith("== thread MainThread"))
    assert 30_000 <= int(header.split(": ")[1].split(" µs")[0].replace(",", "")) <= 60_000
    assert "<module> (<string>:" in text
