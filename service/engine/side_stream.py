"""A second CUDA stream for questions prefilled at once beside the running decode step (`early_prefill_below`).

Overlapped, the loop keeps one decode step queued behind the running one, so a question admitted now rides in a
step that starts only when the queued one ends: it waits for about two steps before its prefill begins. Admitted
onto this stream instead (placements, prefix copy, the prefill graph, the first token's pick and copy), its work
starts at once on the device beside the running step, at a higher priority, and its first token is read as soon as
it is there.

What keeps the two streams apart:
- the main stream waits for the side stream's newest work (`join`) before anything of its own that may read it (the
  next decode step feeds the early requests' first tokens and reads their slabs), and the side stream's tensors it
  reads are recorded as used there, so the allocator does not hand their memory to new side work too soon;
- the side stream waits for the main stream's newest admission or prefill (`mark_main`, waited for on `enter`):
  both streams place chunks into the arena, copy prefixes and replay the prefill graphs, whose static inputs they
  share, and a copy still queued on the main stream must not land on a range the side stream reuses.
On the CPU there is one stream: the same calls run in order, and the bookkeeping is a no-op.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class SideStream:
    """Owned by the scheduler's runner (the engine thread): the side stream of `device` and the events that order
    it against the main (current) stream."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        # Priority -1 (higher than the default 0): the question's kernels get the SMs the running step frees first.
        self._stream = torch.cuda.Stream(device, priority=-1) if self._cuda else None  # type: ignore[no-untyped-call]
        self._main_mark: torch.cuda.Event | None = None  # the main stream's newest admission or prefill
        self._side_mark: torch.cuda.Event | None = None  # the side stream's newest work, not yet joined
        self._used: list[torch.Tensor] = []  # side tensors the main stream will read

    @contextlib.contextmanager
    def enter(self) -> Iterator[None]:
        """Run the block's device work on the side stream, after the main stream's marked work; its end is what
        the main stream's next `join` waits for."""
        if self._stream is None:
            yield
            return
        if self._main_mark is not None:
            self._stream.wait_event(self._main_mark)
            self._main_mark = None
        with torch.cuda.stream(self._stream):
            try:
                yield
            finally:  # what was queued before a failure is still work the main stream must not overtake
                self._side_mark = self._record()

    def mark_main(self) -> None:
        """The main stream just queued an admission or a prefill: side work entered after this waits for it."""
        if self._cuda:
            self._main_mark = self._record()

    def used_on_main(self, tensor: torch.Tensor) -> None:
        """`tensor`, made on the side stream, will be read on the main stream after the next `join`."""
        if self._cuda:
            self._used.append(tensor)

    def join(self) -> None:
        """The main stream waits for every side work entered so far (a no-op when there is none since the last)."""
        if self._side_mark is None:
            return
        main = torch.cuda.current_stream()
        main.wait_event(self._side_mark)
        for tensor in self._used:
            tensor.record_stream(main)
        self._side_mark, self._used = None, []

    def describe(self) -> str:
        """Where the streams stand (a stalled step's log line): whether each one's queued work is done, whether the
        marks between them have passed, and whether the calling thread's current stream is the main one."""
        if self._stream is None:
            return "one stream"
        current = torch.cuda.current_stream()
        done = {
            "main done": current.query(),
            "side done": self._stream.query(),
            "current is side": current == self._stream,
            "main mark passed": None if self._main_mark is None else self._main_mark.query(),  # type: ignore[no-untyped-call]
            "side mark passed": None if self._side_mark is None else self._side_mark.query(),  # type: ignore[no-untyped-call]
            "tensors to hand over": len(self._used),
        }
        return ", ".join(f"{name} {value}" for name, value in done.items())

    @staticmethod
    def _record() -> torch.cuda.Event:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record()
        return event
