"""A profile of the engine's own steps while it serves: which device kernels (or, on the CPU, which ops) a run of
steps spent its time in, written once as a table (`KVSTITCH_STEP_PROFILE_PATH`, a benchmark aid).

A step under load is a decode step with the arriving questions riding in it, replayed from CUDA graphs; its mix of
kernels (the GEMMs, the chunk partials of the running answers, the riders' attention, the merges) depends on the
load, so a benchmark of the kernels alone does not show where a served step's time goes. This profiles the real
steps: it starts at the first step after `after_s` once a step ran with at least `min_batch` rows, runs for
`steps` steps, and writes the table (how busy the device was, then on a GPU the kernels summed by kind). torch's
profiler (CUPTI) records the kernels a CUDA graph replay runs, by name, without the op that launched them (seen on
an H200).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

TABLE_ROWS = 40
NAME_WIDTH = 100


@dataclass(frozen=True)
class StepProfileConfig:
    path: Path
    after_s: float = 0.0
    min_batch: int = 1
    steps: int = 200


class StepProfile:
    """Called by the engine thread around each scheduler step: `before_step()`, then `after_step(batch)` with the
    step's batch size; `after_step` returns True once the table is written (the loop then drops the profile)."""

    def __init__(self, config: StepProfileConfig, device: torch.device) -> None:
        self.config = config
        self._device = device
        self._not_before = time.perf_counter() + config.after_s
        self._armed = False  # a step ran with min_batch rows after after_s: the next one starts the profile
        self._profiler: Any = None
        self._steps = 0
        self._rows = 0
        self._began = 0.0

    def before_step(self) -> None:
        if self._armed and self._profiler is None:
            self._profiler = torch.profiler.profile(activities=self._activities())
            self._profiler.__enter__()
            self._began = time.perf_counter()

    def after_step(self, batch: int) -> bool:
        if self._profiler is None:
            self._armed = time.perf_counter() >= self._not_before and batch >= self.config.min_batch
            return False
        self._steps += 1
        self._rows += batch
        if self._steps < self.config.steps:
            return False
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        wall_s = time.perf_counter() - self._began
        self._profiler.__exit__(None, None, None)
        self._write(wall_s)
        return True

    def _activities(self) -> list[Any]:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self._device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        return activities

    def _write(self, wall_s: float) -> None:
        on_device = self._device.type == "cuda"
        rows = profile_rows(self._profiler.key_averages(), on_device)
        spans = [
            (float(e.time_range.start), float(e.time_range.end))
            for e in self._profiler.events()
            if not on_device or _is_kernel(e)
        ]
        text = step_table(rows, self._steps, self._rows, wall_s, on_device, occupancy(spans))
        path = self.config.path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            temporary = path.with_name(path.name + ".part")
            temporary.write_text(text)
            temporary.replace(path)
        except OSError as err:  # a benchmark aid: a bad path is reported, serving goes on
            log.error("step profile not written to %s: %s", path, err)
            return
        log.info("step profile of %d steps written to %s", self._steps, path)


# Kinds of device kernels by name, first match wins: what a step's time is spent on at a glance (the table below
# it names every kernel). cuBLAS's Hopper GEMMs are `nvjet_*`, its split-K reductions `splitKreduce`.
KERNEL_KINDS = (
    ("attention: running answers (segment partials)", ("segment_partials",)),
    ("attention: riders' questions (request partials)", ("request_partials",)),
    ("attention: merges", ("merge_kernel",)),
    ("attention: other", ("attn", "flash", "slot_")),
    ("GEMMs (weights)", ("nvjet", "gemm", "cublas", "cutlass", "splitkreduce", "xmma")),
    ("copies", ("memcpy", "copy_kernel", "index_copy", "memset")),
)
OTHER_KIND = "elementwise, norms and the rest"


@dataclass(frozen=True)
class ProfileRow:
    name: str
    calls: int
    self_us: float  # the device's time in this kernel (on the CPU: the op's own CPU time)


def profile_rows(averages: Any, on_device: bool) -> list[ProfileRow]:
    """The kernels (on the CPU: the ops) by their own time, largest first; on a GPU only device kernels count."""
    rows = []
    for event in averages:
        own = float(event.self_device_time_total if on_device else event.self_cpu_time_total)
        if own > 0 and (not on_device or _is_kernel(event)):
            rows.append(ProfileRow(str(event.key), int(event.count), own))
    return sorted(rows, key=lambda row: -row.self_us)


def _is_kernel(event: Any) -> bool:
    return str(getattr(event, "device_type", "")).endswith("CUDA")


# A pause between kernels longer than this is a gap the device waited for the host through (a replayed graph's own
# kernels follow each other within a few microseconds).
GAP_US = 50.0


@dataclass(frozen=True)
class Occupancy:
    """How busy the device (on the CPU: the ops) was from the first kernel to the last: time inside any kernel,
    the span, and the pauses over GAP_US between them."""

    busy_us: float
    span_us: float
    gaps: int
    gap_us: float


def occupancy(spans: list[tuple[float, float]]) -> Occupancy:
    """The union of (start, end) spans (µs) against their overall span; the pauses over GAP_US between them."""
    if not spans:
        return Occupancy(0.0, 0.0, 0, 0.0)
    ordered = sorted(spans)
    busy = gap_us = 0.0
    gaps = 0
    start, end = ordered[0]
    for begin, finish in ordered[1:]:
        if begin > end:
            busy += end - start
            if begin - end > GAP_US:
                gaps += 1
                gap_us += begin - end
            start, end = begin, finish
        else:
            end = max(end, finish)
    busy += end - start
    return Occupancy(busy, end - ordered[0][0], gaps, gap_us)


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, marks in KERNEL_KINDS if any(m in lowered for m in marks)), OTHER_KIND)


def step_table(
    rows: list[ProfileRow],
    steps: int,
    batch_rows: int,
    wall_s: float,
    on_device: bool,
    busy: Occupancy | None = None,
) -> str:
    """The profile as Markdown: a summary line, how busy the device was (`busy`), on a GPU the time by kind of
    kernel, then the costliest rows with their share and time a step."""
    total_us = sum(row.self_us for row in rows)
    per_step = max(steps, 1)
    where = "device kernels" if on_device else "CPU ops"
    lines = [
        f"{steps} steps, {batch_rows / per_step:.1f} rows a step, {wall_s * 1e3 / per_step:.2f} ms a step "
        f"(wall), {total_us / 1e3 / per_step:.2f} ms a step in {where}",
        "",
    ]
    if busy is not None and busy.span_us > 0:
        lines += [
            f"{'device' if on_device else 'ops'} busy {busy.busy_us / busy.span_us:.1%} of the "
            f"{busy.span_us / 1e3:.1f} ms from the first {'kernel' if on_device else 'op'} to the last; "
            f"{busy.gaps} pauses over {GAP_US:.0f} µs, {busy.gap_us / 1e3:.2f} ms in all "
            f"({busy.gap_us / 1e3 / per_step:.3f} ms a step)",
            "",
        ]
    if on_device:
        lines += _kinds_table(rows, per_step, total_us)
    lines += [
        "| kernel | calls | ms | ms a step | share |",
        "|---|---|---|---|---|",
    ]
    for row in rows[:TABLE_ROWS]:
        name = row.name.replace("|", "/")[:NAME_WIDTH]
        share = row.self_us / total_us if total_us else 0.0
        lines.append(
            f"| {name} | {row.calls} | {row.self_us / 1e3:.2f} | {row.self_us / 1e3 / max(steps, 1):.3f} | "
            f"{share:.1%} |"
        )
    return "\n".join(lines) + "\n"


def _kinds_table(rows: list[ProfileRow], per_step: int, total_us: float) -> list[str]:
    spent: dict[str, float] = {}
    for row in rows:
        kind = kernel_kind(row.name)
        spent[kind] = spent.get(kind, 0.0) + row.self_us
    lines = ["| kind | ms a step | share |", "|---|---|---|"]
    for kind, us in sorted(spent.items(), key=lambda item: -item[1]):
        share = us / total_us if total_us else 0.0
        lines.append(f"| {kind} | {us / 1e3 / per_step:.3f} | {share:.1%} |")
    return [*lines, ""]
