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
import subprocess
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

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


class PySpy:
    """`py-spy record` on `pid` for `duration_s`, started at once; `samples` waits for it and parses the stacks."""

    def __init__(self, executable: str, pid: int, duration_s: float, out: Path, rate: int = 100) -> None:
        self.out = out
        command = [executable, "record", "--pid", str(pid), "--duration", str(max(1, round(duration_s)))]
        command += ["--rate", str(rate), "--nonblocking", "--threads", "--format", "raw", "--output", str(out)]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def samples(self, timeout_s: float) -> dict[str, ThreadSamples]:
        _, errors = self.process.communicate(timeout=timeout_s)
        if self.process.returncode != 0:
            raise RuntimeError(f"py-spy failed: {errors.decode(errors='replace')[-2000:]}")
        return parse_collapsed(self.out.read_text(encoding="utf-8"))


def find_py_spy(given: str | None) -> str | None:
    return given or shutil.which("py-spy")


def parse_collapsed(text: str) -> dict[str, ThreadSamples]:
    """py-spy's raw output (`thread (tid): name;frame;...;frame count` per line) by thread group."""
    threads: dict[str, ThreadSamples] = {}
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        thread, *frames = stack.split(";")
        if not frames or not count.isdigit() or frames[-1].startswith(WAITS):
            continue
        name = thread_group(thread.split("): ", 1)[-1])
        samples = threads.setdefault(name, ThreadSamples())
        samples.samples += int(count)
        samples.own[frames[-1]] += int(count)
        for frame in set(frames):
            samples.including[frame] += int(count)
    return threads


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
