"""Every CUDA specific of the KV cache in one place: pinned memory, the copy streams and their events.

Other cache modules call these functions and never touch `torch.cuda` themselves (LMCache keeps its CUDA calls
together the same way), so the CPU-only paths stay obvious: on a CPU device every function here degrades to a
plain tensor operation or a no-op (no pinning, no streams, no events).

Copies run on dedicated streams so they overlap with whatever the compute stream is doing and with the next
disk read. Ordering is expressed with events: a consumer makes its current stream wait on a copy's event
(`wait_on`, or calling the block's `Arrival` just before reading it, so work on block 0 can start while later
blocks are still copying); nothing here calls a device-wide synchronize except `synchronize`, which exists for
benchmarks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

CopyStream = torch.cuda.Stream
CopyEvent = torch.cuda.Event


def uses_cuda(device: torch.device | str) -> bool:
    """True when `device` is a CUDA device and CUDA is usable in this process."""
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


def device_name(device: torch.device | str) -> str:
    """A human name of the device, for benchmark reports."""
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if uses_cuda(device) else device.type


def new_copy_stream(device: torch.device | str) -> CopyStream | None:
    """A dedicated stream for host<->device copies; None on a CPU device (copies are plain there)."""
    device = torch.device(device)
    return _stream(device) if uses_cuda(device) else None


def allocate_host(nbytes: int, pinned: bool) -> torch.Tensor:
    """A flat uint8 host tensor; page-locked when `pinned` (so H2D copies can be asynchronous DMA)."""
    if nbytes < 0:
        raise ValueError("cannot allocate a negative number of bytes")
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned and torch.cuda.is_available())


# torch.cuda's constructors carry no annotations; these two wrappers are the only untyped calls.
def _stream(device: torch.device) -> CopyStream:
    return torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]


def _event(timing: bool = False) -> CopyEvent:
    return torch.cuda.Event(enable_timing=timing)  # type: ignore[no-untyped-call]


def copy_to_device(
    host: torch.Tensor,
    device: torch.device,
    stream: CopyStream | None,
    then: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, CopyEvent | None]:
    """Start copying a host tensor to `device`; returns the new tensor and the event that marks its arrival.

    The copy is queued on `stream` (non-blocking, so DMA when `host` is pinned). The caller must not touch
    the source memory again before the event completed (`wait_host`) and must make its compute stream wait
    on the event (`wait_on`) before reading the result. On a CPU device the result is an independent clone
    (never a view of `host`, whose memory the host pool may reuse) and the event is None.

    `then`, when given, turns the copied tensor into the result on the copy stream, before the event (the
    dequantisation of an 8-bit block: the copy moves the 8-bit bytes, and consumers still wait on one event).
    """
    if stream is None or not uses_cuda(device):
        target = torch.empty(host.shape, dtype=host.dtype, device=device)
        target.copy_(host)
        return (target if then is None else then(target)), None
    consumer = torch.cuda.current_stream(device)
    with torch.cuda.stream(stream):
        target = host.to(device, non_blocking=True)
        if then is not None:
            target = then(target)  # the raw copy is only read on this stream, which frees it in order
        event = _event()
        event.record(stream)
    # `target` was allocated on the copy stream; tell the caching allocator the consumer uses it too, so its
    # memory is not handed out again while consumer kernels still read it.
    target.record_stream(consumer)
    return target, event


def copy_layers_to_device(
    hosts: Sequence[torch.Tensor], device: torch.device, groups: Sequence[tuple[int, int]], stream: CopyStream
) -> tuple[list[torch.Tensor], list[CopyEvent]]:
    """Start copying host blocks `[layers, ...]` to `device` layer group by layer group: layers of group 0 of
    every block, an event, group 1 of every block, an event, and so on; returns the new tensors and one event per
    group. The stream runs in order, so group g's event also marks every earlier group's arrival.

    A consumer that waits for group g's event may read layers up to that group's end of every block while later
    groups still copy (the pipelined stitch and prefill). The host memory may be reused once the last event
    completed. CUDA only (the caller checks `uses_cuda` and holds a copy stream).
    """
    consumer = torch.cuda.current_stream(device)
    events: list[CopyEvent] = []
    with torch.cuda.stream(stream):
        targets = [torch.empty(host.shape, dtype=host.dtype, device=device) for host in hosts]
        for first, end in groups:
            for host, target in zip(hosts, targets, strict=True):
                target[first:end].copy_(host[first:end], non_blocking=True)
            event = _event()
            event.record(stream)
            events.append(event)
    for target in targets:
        target.record_stream(consumer)  # allocated on the copy stream, read on the consumer's (as above)
    return targets, events


def copy_to_host(
    source: torch.Tensor,
    host: torch.Tensor,
    stream: CopyStream | None,
    blocking: bool = False,
    after: CopyEvent | None = None,
) -> CopyEvent | None:
    """Copy a device tensor into preallocated host memory on `stream`, once its producer has finished.

    The producer is the work marked by `after` (an event from `record_event`, for a copy issued from another
    thread) or else everything queued so far on the calling thread's current stream. Non-blocking by default:
    the returned event marks completion and the host memory must not be read before it completed
    (`wait_host`). With `blocking`, the call returns once the bytes are on the host (it waits for this stream
    only, not the device). On a CPU device this is a plain copy and returns None.
    """
    if stream is None or not uses_cuda(source.device):
        host.copy_(source)
        return None
    if after is not None:
        stream.wait_event(after)
    else:
        stream.wait_stream(torch.cuda.current_stream(source.device))
    with torch.cuda.stream(stream):
        # A blocking copy into pageable memory; a non-blocking one only into pinned memory, where it is DMA.
        host.copy_(source, non_blocking=not blocking and host.is_pinned())
        event = _event()
        event.record(stream)
    # The source may be dropped by its owner before this copy ran; keep its memory reserved until it has.
    source.record_stream(stream)
    return event


def record_event(device: torch.device) -> CopyEvent | None:
    """An event marking the work queued so far on the current stream of `device`; None on a CPU device."""
    if not uses_cuda(device):
        return None
    event = _event()
    event.record(torch.cuda.current_stream(device))
    return event


def wait_on(event: CopyEvent | None, device: torch.device) -> None:
    """Make the current stream of `device` wait for `event` (on the device, without blocking the host)."""
    if event is not None and uses_cuda(device):
        torch.cuda.current_stream(device).wait_event(event)


@dataclass(frozen=True)
class Arrival:
    """The event a block's copy lands on, and its device. Calling it makes the current stream of that device
    wait for the copy (on the device; the host does not block): a consumer calls it just before it reads the
    block, which is how the stitcher overlaps the copies still in flight. Engine code sees a plain callable.
    """

    event: CopyEvent
    device: torch.device

    def __call__(self) -> None:
        wait_on(self.event, self.device)


@dataclass(frozen=True)
class LayeredArrival(Arrival):
    """The arrival of a block copied layer group by layer group (`copy_layers_to_device`): calling it waits for
    the whole block (`event` is the last group's), `layers(start, end)` gives the `Arrival` of the group holding
    layer end - 1, which in stream order also covers every earlier layer. `arrivals` are shared by the blocks
    copied together, so a stitch sees one wait per layer group, not one per block (engine: `LayeredReady`).
    """

    groups: tuple[tuple[int, int], ...]
    arrivals: tuple[Arrival, ...]

    def layers(self, start: int, end: int) -> Arrival:
        if not 0 <= start < end:
            raise ValueError(f"bad layer range {start}..{end}")
        for (_, last), arrived in zip(self.groups, self.arrivals, strict=True):
            if end <= last:
                return arrived
        return self.arrivals[-1]


def layered_arrivals(
    events: Sequence[CopyEvent], groups: Sequence[tuple[int, int]], device: torch.device, count: int
) -> list[LayeredArrival]:
    """One `LayeredArrival` per block of a `copy_layers_to_device` call of `count` blocks, sharing the groups'
    arrivals."""
    target = torch.device(device)
    arrivals = tuple(Arrival(event, target) for event in events)
    return [LayeredArrival(events[-1], target, tuple(groups), arrivals) for _ in range(count)]


def arrival(event: CopyEvent | None, device: torch.device) -> Arrival | None:
    """The `Arrival` of a copy, or None when there is nothing to wait for (no copy, or a CPU device)."""
    return None if event is None else Arrival(event, torch.device(device))


def wait_host(event: CopyEvent | None) -> None:
    """Block the calling thread until `event` completed (before host memory a copy reads is reused)."""
    if event is not None:
        event.synchronize()


def is_done(event: CopyEvent | None) -> bool:
    """True when `event` completed (or there is none)."""
    return event is None or bool(event.query())  # type: ignore[no-untyped-call]


def synchronize(device: torch.device) -> None:
    """Wait for all work on `device`; for benchmarks and timers only, never on the serving path."""
    if uses_cuda(device):
        torch.cuda.synchronize(device)


class CopyClock:
    """Sums how long a series of copies took: CUDA timing events around each copy on its stream, or wall
    time around each (synchronous) copy on a CPU device. Read `elapsed_ms` after queueing the last copy; it
    may be read late (after the copies were consumed) so that timing them never holds up their consumer.
    """

    def __init__(self, stream: CopyStream | None) -> None:
        self._stream = stream
        self._spans: list[tuple[CopyEvent, CopyEvent]] = []
        self._wall_ms = 0.0
        self._total_ms: float | None = None

    @contextmanager
    def timing(self) -> Iterator[None]:
        """Time the copies queued inside the block."""
        if self._stream is None:
            start = time.perf_counter()
            yield
            self._wall_ms += (time.perf_counter() - start) * 1e3
            return
        begin, end = _event(timing=True), _event(timing=True)
        begin.record(self._stream)
        yield
        end.record(self._stream)
        self._spans.append((begin, end))

    def elapsed_ms(self) -> float:
        """Total copy time; waits (host-side, on the last copy's event only) until the copies finished.

        The first call fixes the total: copies timed after it are not counted.
        """
        if self._total_ms is None:
            if self._spans:
                self._spans[-1][1].synchronize()
            self._total_ms = self._wall_ms + sum(float(begin.elapsed_time(end)) for begin, end in self._spans)
        return self._total_ms
