"""Where each thread of a process spends its busy time, from py-spy's samples (an optional tool, not a dependency).

`PySpy` runs `py-spy record --nonblocking --threads --format raw` on a process for a while: py-spy reads the stacks
from outside, without pausing the process or taking its GIL, and leaves out threads the OS shows idle, so a sample
is a thread on a CPU (or waiting for the GIL) at an arbitrary point. A sampler inside the process would only see
the other threads where they release the GIL, mostly in system calls. `sample_table` turns the collapsed stacks into
each thread group's top functions, by own time and including callees, in µs per answer: a function's share of its
thread's samples times that thread's CPU per answer (measured from /proc by the caller).
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

THREAD = re.compile(r"thread \((\d+)\)(?:: (.*))?$")  # `thread (OS id): name`; no name where Python has none
UNNAMED = "unnamed"
NO_PY_SPY = "no profile: py-spy was not found (pip install py-spy, or pass --py-spy PATH)"
NUMBERED = re.compile(r"[-_ ]?[\d_]+( \(.*\))?$")  # `ThreadPoolExecutor-0_3`, `Thread-2 (run)`
# Innermost frames of a waiting thread, should py-spy not see it idle (it reads the OS's thread state, which some
# containers hide): the event loop's poll, lock, condition and queue waits, a child process's pipe.
WAITS = ("Condition.wait (", "EpollSelector.select (", "Connection._recv (", "Thread._wait_for_tstate_lock (")


def thread_group(name: str) -> str:
    """A thread's name without its number; `gateway-loop` stays itself."""
    return NUMBERED.sub("", name) or name


@dataclass
class ThreadSamples:
    samples: int = 0
    own: Counter[str] = field(default_factory=Counter)
    including: Counter[str] = field(default_factory=Counter)
    thread_ids: set[int] = field(default_factory=set)  # the OS ids py-spy saw under this group's name


class PySpy:
    """`py-spy record` on `pid`, started at once, for `duration_s` (None: until `stop`); `samples` waits for it and
    parses the stacks."""

    def __init__(self, executable: str, pid: int, duration_s: float | None, out: Path, rate: int = 100) -> None:
        self.out = out
        command = [executable, "record", "--pid", str(pid)]
        command += ["--duration", str(max(1, round(duration_s)))] if duration_s is not None else []
        command += ["--rate", str(rate), "--nonblocking", "--threads", "--format", "raw", "--output", str(out)]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def stop(self) -> None:
        """End the recording now (py-spy writes what it sampled on SIGINT, as on Ctrl-C)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)

    def samples(self, timeout_s: float) -> dict[str, ThreadSamples]:
        _, errors = self.process.communicate(timeout=timeout_s)
        if self.process.returncode != 0:
            raise RuntimeError(f"py-spy failed: {errors.decode(errors='replace')[-2000:]}")
        return parse_collapsed(self.out.read_text(encoding="utf-8"))


def find_py_spy(given: str | None) -> str | None:
    """`given`, else py-spy on PATH, beside this Python, or in a `bin` folder of an import path entry (where
    `pip install --target DIR` puts it: the GPU machine's carried wheels)."""
    if given is not None:
        return given
    found = shutil.which("py-spy")
    if found is not None:
        return found
    for folder in [Path(sys.executable).parent, *(Path(entry) / "bin" for entry in sys.path if entry)]:
        candidate = folder / "py-spy"
        if candidate.is_file():
            return str(candidate)
    return None


def parse_collapsed(text: str) -> dict[str, ThreadSamples]:
    """py-spy's raw output (`thread (tid): name;frame;...;frame count` per line) by thread group."""
    threads: dict[str, ThreadSamples] = {}
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        thread, *frames = stack.split(";")
        if not frames or not count.isdigit() or frames[-1].startswith(WAITS):
            continue
        found = THREAD.match(thread)
        name = (found.group(2) or UNNAMED) if found else thread
        samples = threads.setdefault(thread_group(name), ThreadSamples())
        samples.samples += int(count)
        if found:
            samples.thread_ids.add(int(found.group(1)))
        samples.own[frames[-1]] += int(count)
        for frame in set(frames):
            samples.including[frame] += int(count)
    return threads


def cpu_ms_by_group(
    threads: dict[str, ThreadSamples], thread_seconds: Mapping[int, float], answers: int
) -> dict[str, float]:
    """Each sampled thread group's CPU ms per answer: its threads' CPU seconds (by OS id, from /proc, over the same
    run) per answer. For a process whose threads have no names outside it (an engine's)."""
    return {
        name: sum(thread_seconds.get(tid, 0.0) for tid in found.thread_ids) * 1e3 / max(answers, 1)
        for name, found in threads.items()
    }


def sample_table(threads: dict[str, ThreadSamples], cpu_ms_per_answer: dict[str, float], top: int) -> str:
    """Per thread group with at least 50 µs of CPU per answer, busiest first: its top functions in µs per answer."""
    lines = []
    for name, cpu_ms in sorted(cpu_ms_per_answer.items(), key=lambda item: item[1], reverse=True):
        found = threads.get(name)
        if found is None or found.samples == 0 or cpu_ms < 0.05:
            continue
        lines += [f"== thread {name}: {cpu_ms * 1e3:,.0f} µs CPU per answer, {found.samples} samples", ""]
        for title, counter in (("own time", found.own), ("including callees", found.including)):
            lines.append(f"top {top} by {title}: µs/answer | share | function")
            for frame, n in counter.most_common(top):
                share = n / found.samples
                lines.append(f"{share * cpu_ms * 1e3:9.1f} | {share:6.1%} | {frame}")
            lines.append("")
    return "\n".join(lines)


class Profiles:
    """py-spy on several processes (by role) over one timed run: started at once, stopped by `report`, which
    tabulates each process's threads with their CPU from /proc over the same run."""

    def __init__(self, executable: str, pids: Mapping[str, int], out_dir: Path, rate: int = 100) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        self.pids = dict(pids)
        self.spies = {role: PySpy(executable, pid, None, out_dir / f"{role}.txt", rate) for role, pid in pids.items()}

    @property
    def sampler_pids(self) -> list[int]:
        """The py-spy processes' own ids (children of this process that are not the measured run's)."""
        return [spy.process.pid for spy in self.spies.values()]

    def stop(self) -> None:
        """End every recording (a run that failed: nothing is read)."""
        for spy in self.spies.values():
            spy.stop()

    def report(
        self, thread_seconds: Mapping[str, Mapping[int, float]], answers: int, top: int, timeout_s: float = 60.0
    ) -> str:
        """Stop every sampler, then per process its thread groups' top functions in µs per answer (`sample_table`);
        a sampler that failed is named with py-spy's error instead."""
        self.stop()
        sections = []
        for role, spy in self.spies.items():
            title = f"=== {role} (pid {self.pids[role]}), {answers} answers"
            try:
                threads = spy.samples(timeout_s)
            except (RuntimeError, subprocess.TimeoutExpired) as err:
                spy.process.kill()
                sections.append(f"{title}: no profile ({err})\n")
                continue
            cpu_ms = cpu_ms_by_group(threads, thread_seconds.get(role, {}), answers)
            sections.append(f"{title}\n\n{sample_table(threads, cpu_ms, top)}")
        return "\n".join(sections)


def start_profiles(executable: str | None, pids: Mapping[str, int], out_dir: Path, wanted: bool) -> Profiles | None:
    """`Profiles` of `pids` when `wanted` and py-spy was found; else None (the caller reports `NO_PY_SPY`)."""
    if not wanted or executable is None:
        return None
    return Profiles(executable, pids, out_dir)
