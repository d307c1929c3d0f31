"""Where a load test's CPU went, per process and per thread, read from /proc (Linux).

A snapshot (`cpu_snapshot`) reads utime + stime of each watched process, its threads that ended included, and of each
of its live threads; two snapshots around a timed run give (`cpu_use`), per process and per thread group, CPU ms per
answer and cores busy: CPU seconds over the run's wall seconds. A process is watched by role (`gateway`, `embedder`,
`engine-0`, `clients`, ...) as one or more pids, so a child that was replaced mid-run counts from zero, and the
gateway's children found by scanning /proc (`children_of`) can be watched together.

Threads have Python names only in the process that takes the snapshots (the gateway's, in the harnesses): there they
are grouped (`GATEWAY_THREAD_GROUPS`: event loop, retrieval, request threads, engine, other). Every other process is
counted whole, with its busiest thread's cores: Python threads share one GIL, so a process whose Python threads add up
to about 1.0 core, or one thread near 1.0, is bound by it; a process far below while the run waits is not the wall.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtest.stack_sampler import thread_group

TICKS_PER_S = os.sysconf("SC_CLK_TCK")
PROC = Path("/proc")

# The gateway's threads by `thread_group` name (the name without its number): uvicorn's event loop (the harnesses
# serve on a thread of their own: `uvicorn` in serve_random and serve_fleet, `gateway-loop` in bench_gateway), the
# retrieval batcher (question embeddings and Qdrant searches, batched), anyio's worker threads (each request's
# retrieval wait, question preparation and routing), the embedded engine's scheduler (serve_random). Anything else,
# threads without a Python name (torch's, the Qdrant client's native ones) and threads that ended during the run:
# `other`.
GATEWAY_THREAD_GROUPS = {
    "uvicorn": "event_loop",
    "gateway-loop": "event_loop",
    "retrieval": "retrieval",
    "AnyIO worker thread": "request_threads",
    "engine": "engine",
}
OTHER = "other"
UNNAMED = "native"  # a live thread of this process that Python did not start
ENDED = "ended threads"  # CPU of threads that ended between the snapshots (the process's total keeps it)


def cpu_seconds(stat_path: Path) -> float:
    """utime + stime of a /proc stat file (a process's or a thread's)."""
    fields = stat_path.read_text(encoding="ascii").rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS_PER_S


def parent_pid(pid: int) -> int | None:
    try:
        fields = (PROC / str(pid) / "stat").read_text(encoding="ascii").rsplit(")", 1)[1].split()
    except (OSError, UnicodeDecodeError):
        return None
    return int(fields[1])


def children_of(pid: int) -> list[int]:
    """The live child processes of `pid`, by scanning /proc (the kernel's per-task children list is not always
    there)."""
    return sorted(
        int(entry.name) for entry in PROC.iterdir() if entry.name.isdigit() and parent_pid(int(entry.name)) == pid
    )


@dataclass(frozen=True)
class ProcessCpu:
    """One process's CPU seconds: all its threads (ended ones included), and each live thread by its OS id."""

    total_s: float
    threads_s: dict[int, float]


def process_cpu(pid: int) -> ProcessCpu | None:
    """`pid`'s CPU now; None when it is gone."""
    try:
        total = cpu_seconds(PROC / str(pid) / "stat")
        tasks = list((PROC / str(pid) / "task").iterdir())
    except OSError:
        return None
    threads = {}
    for task in tasks:
        try:
            threads[int(task.name)] = cpu_seconds(task / "stat")
        except OSError:  # ended since the listing
            continue
    return ProcessCpu(total, threads)


@dataclass(frozen=True)
class CpuSnapshot:
    """Watched processes by role, then by pid; this process's Python thread names by OS thread id."""

    at_s: float  # time.monotonic() when taken
    processes: dict[str, dict[int, ProcessCpu]]
    own_role: str | None  # the role whose pid is this process's (its threads have names)
    thread_names: dict[int, str]


def cpu_snapshot(roles: Mapping[str, int | Iterable[int] | None]) -> CpuSnapshot:
    """Each role's processes now (a role without a pid, or whose processes are gone, has none)."""
    processes: dict[str, dict[int, ProcessCpu]] = {}
    own_role = None
    for role, pids in roles.items():
        found = {}
        for pid in [pids] if isinstance(pids, int) else (pids or []):
            cpu = process_cpu(pid)
            if cpu is not None:
                found[pid] = cpu
            own_role = role if pid == os.getpid() else own_role
        processes[role] = found
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    return CpuSnapshot(time.monotonic(), processes, own_role, names)


@dataclass
class Watched:
    """What a load test accounts, by role, read anew at each snapshot (`roles`): this process (`gateway`), the
    question embedder's children (`embedder`, by the pids `embedder_pids` gives then: a replaced child counts from
    its start), the engine processes, the clients' process, and every other child of this process found in /proc
    (`other children`) but those in `ignored` (idle engines) and the samplers given; with gateway replicas, their
    processes summed (`gateway replicas`) and their children (`replica embedders`)."""

    embedder_pids: Callable[[], list[int]]
    clients_pid: int
    engines: dict[str, int] = field(default_factory=dict)
    ignored: set[int] = field(default_factory=set)
    replicas: Callable[[], list[int]] = list  # further gateway processes (serve_fleet --gateways), summed

    def roles(self, samplers: Iterable[int] = ()) -> dict[str, int | list[int] | None]:
        embedder = self.embedder_pids()
        replicas = self.replicas()
        known = {self.clients_pid, *embedder, *self.engines.values(), *self.ignored, *samplers, *replicas}
        others = [pid for pid in children_of(os.getpid()) if pid not in known]
        roles: dict[str, int | list[int] | None] = {"gateway": os.getpid(), "embedder": embedder, **self.engines}
        if replicas:
            roles["gateway replicas"] = replicas
            roles["replica embedders"] = [child for pid in replicas for child in children_of(pid)]
        return {**roles, "clients": self.clients_pid, "other children": others}


# ---- between two snapshots --------------------------------------------------------------------------------------


def thread_deltas(before: CpuSnapshot, after: CpuSnapshot, role: str) -> dict[int, float]:
    """CPU seconds of each of a role's threads alive at `after`, between the snapshots (a thread started in between
    counts from zero)."""
    earlier = {tid: s for cpu in before.processes.get(role, {}).values() for tid, s in cpu.threads_s.items()}
    return {
        tid: max(0.0, s - earlier.get(tid, 0.0))
        for cpu in after.processes.get(role, {}).values()
        for tid, s in cpu.threads_s.items()
    }


def process_delta(before: CpuSnapshot, after: CpuSnapshot, role: str) -> float | None:
    """A role's CPU seconds between the snapshots; None when none of its processes was alive at `after`. A process
    that started in between counts from zero; one that ended is lost."""
    now = after.processes.get(role, {})
    if not now:
        return None
    earlier = before.processes.get(role, {})
    return sum(max(0.0, cpu.total_s - (earlier[pid].total_s if pid in earlier else 0.0)) for pid, cpu in now.items())


def own_thread_seconds(before: CpuSnapshot, after: CpuSnapshot, key: Any) -> dict[str, float]:
    """This process's CPU seconds between the snapshots by `key(thread name)`: unnamed live threads under
    key(UNNAMED), threads that ended under key(ENDED) (the process's total less its live threads')."""
    role = after.own_role
    if role is None:
        return {}
    names = {**before.thread_names, **after.thread_names}
    totals: dict[str, float] = {}
    for tid, seconds in thread_deltas(before, after, role).items():
        name = key(names.get(tid, UNNAMED))
        totals[name] = totals.get(name, 0.0) + seconds
    ended = (process_delta(before, after, role) or 0.0) - sum(totals.values())
    totals[key(ENDED)] = totals.get(key(ENDED), 0.0) + max(0.0, ended)
    return totals


def gateway_group(name: str) -> str:
    """A gateway thread's group (`GATEWAY_THREAD_GROUPS`), `other` when none."""
    return GATEWAY_THREAD_GROUPS.get(thread_group(name), OTHER)


def busy(seconds: float, wall_s: float, answers: int) -> dict[str, float]:
    return {"ms_per_answer": round(seconds * 1e3 / max(answers, 1), 3), "cores": round(seconds / wall_s, 3)}


def cpu_use(before: CpuSnapshot, after: CpuSnapshot, answers: int) -> dict[str, Any]:
    """CPU between two snapshots, per answer and in cores busy: per role (with its busiest thread's cores), this
    process's threads by group (`GATEWAY_THREAD_GROUPS`, the groups adding up to its total) and by name (the
    number dropped, as py-spy's profile names them). A role with no process alive at `after` is None."""
    wall_s = max(after.at_s - before.at_s, 1e-9)
    processes: dict[str, dict[str, float] | None] = {}
    for role in after.processes:
        seconds = process_delta(before, after, role)
        if seconds is None:
            processes[role] = None
            continue
        busiest = max(thread_deltas(before, after, role).values(), default=0.0)
        processes[role] = {**busy(seconds, wall_s, answers), "busiest_thread_cores": round(busiest / wall_s, 3)}
    groups = own_thread_seconds(before, after, gateway_group)
    names = own_thread_seconds(before, after, thread_group)
    return {
        "wall_s": round(wall_s, 3),
        "answers": answers,
        "processes": processes,
        "thread_groups": {g: busy(s, wall_s, answers) for g, s in sorted(groups.items())},
        "threads": {n: busy(s, wall_s, answers) for n, s in sorted(names.items()) if s > 0},
    }


def cores(use: dict[str, Any] | None, role: str) -> str:
    """A role's cores busy as a table cell, its busiest thread's in brackets ('-' when not measured)."""
    process = (use or {}).get("processes", {}).get(role)
    if not process:
        return "-"
    return f"{process['cores']:.2f} ({process['busiest_thread_cores']:.2f})"


def group_cores(use: dict[str, Any] | None, group: str) -> str:
    found = (use or {}).get("thread_groups", {}).get(group)
    return "-" if found is None else f"{found['cores']:.2f}"
