"""CUDA graphs for a request's question prefill, over one graph-owned buffer where its chunks are stitched.

An eager prefill is bound by the CPU launching ~1,500 small kernels, which takes several times as long as the GPU
work they start. A CUDA graph records those launches once and replays them with one call. A graph fixes every
pointer and shape, so the captured code (`LeanForward.forward_static`) reads its token ids, positions and slots
from static device tensors, writes K/V into a buffer the graph owns, and attends over that buffer's whole
capacity with the slots past the live length kept out on the device: no `.item()`, no Python branch on tensor
values, no allocation whose size depends on the length.

One `StitchGraph` per capacity bucket owns a KV buffer and prefill graphs for questions of bucketed lengths
(`QUESTION_BUCKETS`) over it: a request's chunks are stitched straight into it and its question prefilled
there; the scheduler then copies the live KV into the request's slab of the pool, where the batched decode
steps (`batch_graph.py`) run. A question is padded at the end to its bucket; causal attention keeps real tokens
blind to the padding, and only the live slots are copied out.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from service.engine.attention import (
    LengthInputs,
    prefill_kv_splits,
    resolve_attention,
)
from service.engine.device_copy import copy_into
from service.engine.forward import LeanForward
from service.engine.kv_buffer import KVBuffer

# Layer ranges [first, end) of a pipelined prefill's segments, in order, covering every layer once.
LayerGroups = tuple[tuple[int, int], ...]
# Called with a segment's layer range right before that segment replays, on the stream it replays on: the
# pipelined stitch waits there for those layers' copies and places them.
BeforeSegment = Callable[[tuple[int, int]], None]

log = logging.getLogger(__name__)

MIN_BUCKET = 1024
# Question lengths (tokens of the prefilled suffix) a prefill graph is captured for; longer questions prefill
# eagerly into the graph's buffer. A 128-token question, the benchmarks' size, fills its bucket exactly.
QUESTION_BUCKETS = (32, 64, 128, 256, 512)


def bucket_capacity(tokens: int, max_context: int, minimum: int = MIN_BUCKET) -> int:
    """Graph capacity serving a buffer of `tokens` slots: the next power of two from `minimum`, capped at the
    model's context. Powers of two keep a server at a handful of graphs (1K … 32K is six)."""
    if tokens > max_context:
        raise ValueError(f"{tokens} tokens exceed the model's context of {max_context}")
    capacity = minimum
    while capacity < tokens:
        capacity *= 2
    return min(capacity, max_context)


def question_bucket(tokens: int, buckets: Sequence[int] = QUESTION_BUCKETS) -> int | None:
    """The smallest prefill-graph length holding a question of `tokens` tokens, or None when none does."""
    if tokens <= 0:
        raise ValueError("a question needs at least one token")
    return next((b for b in sorted(buckets) if b >= tokens), None)


def graph_tokens(context: int, question: int, extra: int, max_context: int) -> int:
    """Slots a request's graph buffer must hold: context + question + answer budget, and at least context +
    the question padded to its bucket (the prefill graph writes K/V for the padding too) where that fits the
    model's context; where it does not, the question is prefilled eagerly in the graph's buffer."""
    needed = context + question + extra
    bucket = question_bucket(question)
    if bucket is not None and context + bucket <= max_context:
        needed = max(needed, context + bucket)
    return needed


def layer_groups(num_layers: int, groups: int) -> LayerGroups:
    """`num_layers` split into `groups` contiguous ranges (at most one per layer), the longer ones first."""
    if num_layers <= 0 or groups <= 0:
        raise ValueError("layer groups need at least one layer and one group")
    groups = min(groups, num_layers)
    size, extra = divmod(num_layers, groups)
    ranges, first = [], 0
    for g in range(groups):
        end = first + size + (1 if g < extra else 0)
        ranges.append((first, end))
        first = end
    return tuple(ranges)


def _capture(
    graph: torch.cuda.CUDAGraph,
    run: Callable[[], Any],
    device: torch.device,
    pool: Any,
    stream: torch.cuda.Stream | None = None,
) -> Any:
    """Warm `run` up on a side stream (cuBLAS handles and workspaces, lazy kernel loading must not happen
    inside the capture), then capture it into `graph`; returns the captured run's outputs (static tensors).

    `stream`: the stream to capture on (default: torch's one capture stream). A captured GEMM keeps the cuBLAS
    workspace of the stream it was captured on, so graphs that may replay at the same time as each other, on two
    streams, must be captured on two streams: on one workspace, two split-K GEMMs' reductions corrupt each other."""
    side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side), torch.inference_mode():
        for _ in range(2):
            run()
    torch.cuda.current_stream(device).wait_stream(side)
    # thread_local: other threads' CUDA work (the embedder on the retrieval thread, the KV copy stream) neither
    # breaks the capture nor gets captured; under the default global mode it invalidated it.
    with (
        torch.inference_mode(),
        torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"),
    ):
        outputs = run()
    torch.cuda.synchronize(device)
    return outputs


# ---- captured graphs ------------------------------------------------------------------------------------


class PrefillGraph:
    """A captured prefill of `tokens` question tokens (real ones first, padding after) over a graph's buffer.

    Static inputs live in one device tensor filled by one pinned host-to-device copy per replay: the padded ids,
    the first token's position and slot, and the index of the last real token, whose logits alone are computed
    (gathered inside the graph before the final norm and the LM head).

    With `layer_groups` the prefill is captured as one graph per layer range (segments), the hidden states passed
    from one to the next in a static tensor: `replay(..., before=...)` calls `before(layers)` ahead of each
    segment on the replaying stream, so work queued there (waiting for those layers' KV copies, stitching them)
    orders just that segment. The segments run the same kernels in the same order as the one-graph prefill, so the
    logits are the same bit for bit.
    """

    def __init__(
        self,
        forward: LeanForward,
        data: torch.Tensor,
        capacity: int,
        tokens: int,
        attention: str,
        pool: Any,
        kv_splits: int | None = None,
        layer_groups: LayerGroups | None = None,
    ) -> None:
        spec = forward.spec
        if tokens > capacity:
            raise ValueError(f"a prefill of {tokens} tokens does not fit a buffer of {capacity} slots")
        self.tokens = tokens
        self.capacity = capacity
        self._forward = forward
        self._attention = attention
        self._data = data
        # `kv_splits` None: the probed choice (benchmarks force 1 to measure what the split brings).
        self.kv_splits = prefill_kv_splits(spec, attention) if kv_splits is None else kv_splits
        self._lengths = LengthInputs(spec, capacity, tokens, self.kv_splits)
        self._offsets = torch.arange(tokens, device=spec.device)
        # [ids..., start position, start slot, last real index], filled by an asynchronous copy (`copy_into`).
        self._inputs = torch.zeros(tokens + 3, dtype=torch.long, device=spec.device)
        num_layers = len(forward.layers)
        self.layer_groups: LayerGroups = layer_groups or ((0, num_layers),)
        if [r for g in self.layer_groups for r in range(*g)] != list(range(num_layers)):
            raise ValueError(f"layer groups {self.layer_groups} must cover layers 0..{num_layers - 1} in order")
        self.segmented = layer_groups is not None
        self._graphs: list[torch.cuda.CUDAGraph] = []
        # Capture at the buffer's last slots: a bucket's graph may be captured while a request's context is
        # already in the buffer, and context + tokens <= capacity keeps the tail clear of it.
        self._fill([0] * tokens, capacity - tokens, capacity - tokens, tokens)
        start = time.perf_counter()
        hidden: torch.Tensor | None = None
        for g, layers in enumerate(self.layer_groups):
            graph = torch.cuda.CUDAGraph()
            last = g == len(self.layer_groups) - 1
            run = functools.partial(self._run, hidden, layers, last) if self.segmented else self._run_whole
            out: torch.Tensor = _capture(graph, run, spec.device, pool)
            self._graphs.append(graph)
            hidden = out  # a segment's static hidden states: the next segment's input
        assert hidden is not None
        self._logits: torch.Tensor = hidden
        self.capture_ms = (time.perf_counter() - start) * 1e3

    def _static(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        n = self.tokens
        ids = self._inputs[:n].view(1, n)
        positions = self._inputs[n] + self._offsets
        slots = self._inputs[n + 1] + self._offsets
        return ids, positions, slots, self._inputs[n + 2 :]

    def _run_whole(self) -> torch.Tensor:
        ids, positions, slots, last = self._static()
        attend = self._lengths.attend_for(self._attention, slots)
        return self._forward.forward_static(self._data, ids, positions, slots, attend, last)

    def _run(self, hidden: torch.Tensor | None, layers: tuple[int, int], last_segment: bool) -> torch.Tensor:
        """One segment: embed (the first), layers [first, end), norm and LM head (the last)."""
        ids, positions, slots, last = self._static()
        attend = self._lengths.attend_for(self._attention, slots)
        states = self._forward.embed_static(ids) if hidden is None else hidden
        states = self._forward.layers_static(self._data, states, positions, slots, attend, layers)
        return self._forward.head_static(states, last) if last_segment else states

    def _fill(self, question: Sequence[int], position: int, slot: int, real: int) -> None:
        n = self.tokens
        host = torch.zeros(n + 3, dtype=torch.long)  # padding: token 0, any valid id; its K/V land past the live length
        host[: len(question)] = torch.tensor(list(question), dtype=torch.long)
        host[n], host[n + 1], host[n + 2] = position, slot, real - 1
        copy_into(self._inputs, host)

    def replay(
        self, question: Sequence[int], position: int, slot: int, before: BeforeSegment | None = None
    ) -> torch.Tensor:
        """Prefill `question` (at most `tokens` ids) at `position`.. and slots `slot`..; returns the static fp32
        logits [vocab] of its last token (overwritten by the next replay of any graph sharing the memory pool).
        `before(layers)` runs ahead of each segment (once, with every layer, for a one-graph prefill)."""
        if not 0 < len(question) <= self.tokens:
            raise ValueError(f"a question of {len(question)} tokens does not fit a prefill graph of {self.tokens}")
        if slot + self.tokens > self.capacity:
            raise ValueError(f"slots {slot}..{slot + self.tokens} exceed the buffer's {self.capacity}")
        self._fill(question, position, slot, len(question))
        for graph, layers in zip(self._graphs, self.layer_groups, strict=True):
            if before is not None:
                before(layers)
            graph.replay()
        return self._logits


class StitchGraph:
    """A KV buffer of fixed `capacity` and the prefill graphs captured over it, one per question bucket (captured on
    first use or by `StitchGraphs.warm`): a request's chunks are stitched into `buffer` (the fused stitch kernel
    needs a contiguous buffer, which a pool slab is not) and its question prefilled there through a graph; the
    live KV is then copied into the request's slab, where the batched steps decode it.
    """

    def __init__(
        self,
        forward: LeanForward,
        capacity: int,
        attention: str = "auto",
        pool: Any = None,
    ) -> None:
        spec = forward.spec
        if spec.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        self.spec = spec
        self.capacity = capacity
        self.attention = resolve_attention(spec, attention)
        self._forward = forward
        self._pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        self.buffer = KVBuffer(spec, capacity)
        # Masked SDPA multiplies dead slots' values by a zero weight: they must be finite (0 * NaN is NaN), and
        # fresh memory may hold NaN bit patterns. Later tenants only ever leave finite model outputs there.
        self.buffer.data.zero_()
        self._prefills: dict[tuple[int, LayerGroups | None], PrefillGraph] = {}
        self.prefill_capture_ms: dict[int, float] = {}
        self.segmented_capture_ms: dict[int, float] = {}

    def prefill_graph(self, tokens: int, groups: LayerGroups | None = None) -> PrefillGraph:
        """The prefill graph for questions of up to `tokens` tokens (a bucket), captured now if missing; with
        `groups`, the one captured as a segment per layer group (the pipelined prefill)."""
        graph = self._prefills.get((tokens, groups))
        if graph is None:
            graph = PrefillGraph(
                self._forward, self.buffer.data, self.capacity, tokens, self.attention, self._pool, layer_groups=groups
            )
            self._prefills[(tokens, groups)] = graph
            (self.segmented_capture_ms if groups else self.prefill_capture_ms)[tokens] = graph.capture_ms
            log.info(
                "captured the %d-token prefill graph (%d segments) over %d slots in %.0f ms",
                tokens,
                len(graph.layer_groups),
                self.capacity,
                graph.capture_ms,
            )
        return graph

    def fits_prefill(self, context: int, question: int) -> bool:
        """True when `prefill` would run a graph for a question of `question` tokens after `context` live ones."""
        bucket = question_bucket(question)
        return bucket is not None and context + bucket <= self.capacity

    def prefill(
        self, question: Sequence[int], before: BeforeSegment | None = None, groups: LayerGroups | None = None
    ) -> torch.Tensor | None:
        """Prefill `question` after the buffer's live tokens through its bucket's graph; returns the static
        logits of its last token, or None (nothing done) when no bucket holds it or the padding has no room.

        With `groups` the bucket's segmented graph runs, `before(layers)` ahead of each segment (see
        `PrefillGraph`): the pipelined stitch places each layer group there, so the context's length must be
        committed to the buffer before this is called although its KV is still being placed."""
        bucket = question_bucket(len(question))
        if bucket is None or self.buffer.length + bucket > self.capacity:
            return None
        graph = self.prefill_graph(bucket, groups)
        slot, position = self.buffer.length, self.buffer.next_position
        logits = graph.replay(question, position, slot, before)
        # Live length = context + real question; the padding's K/V beyond it are overwritten by decode steps.
        self.buffer.commit(len(question), position + len(question))
        return logits


class StitchGraphs:
    """Graphs cached by capacity bucket, leased to one stream at a time; at most `max_graphs` are kept.

    Each graph holds a KV buffer of its capacity (940 MB at 16K for a 7B model), hence the cap. A bucket whose
    graph is leased gives None, and that stream runs eagerly: never wrong, only slower.
    """

    def __init__(
        self,
        forward: LeanForward,
        attention: str = "auto",
        max_graphs: int = 4,
        pipeline_groups: LayerGroups | None = None,
    ) -> None:
        self._forward = forward
        # Layer groups of the pipelined prefill (the engine's), warmed beside the one-graph prefill; None: none.
        self.pipeline_groups = pipeline_groups
        self._requested = attention
        self._attention: str | None = None
        self.max_graphs = max_graphs
        self._graphs: OrderedDict[int, StitchGraph] = OrderedDict()
        self._leased: set[int] = set()
        self._lock = threading.Lock()
        self._pool: Any = None

    def capacity_for(self, tokens: int) -> int:
        return bucket_capacity(tokens, self._forward.spec.max_context)

    @property
    def prefill_capture_ms(self) -> dict[tuple[int, int], float]:
        """Capture time of every prefill graph kept, by (capacity, question bucket)."""
        with self._lock:
            graphs = list(self._graphs.items())
        return {(c, t): ms for c, g in graphs for t, ms in g.prefill_capture_ms.items()}

    def lease(self, tokens: int) -> StitchGraph | None:
        """A free graph whose capacity holds `tokens` slots, captured now if its bucket has none."""
        capacity = self.capacity_for(tokens)
        with self._lock:
            if capacity in self._leased:
                return None
            graph = self._graphs.get(capacity) or self._capture(capacity)
            self._graphs.move_to_end(capacity)
            self._leased.add(capacity)
            return graph

    def release(self, graph: StitchGraph) -> None:
        with self._lock:
            self._leased.discard(graph.capacity)

    def warm(self, tokens: int, questions: Sequence[int] = QUESTION_BUCKETS) -> StitchGraph:
        """Capture (or find) the graphs for `tokens` slots ahead of traffic, e.g. at server start-up: the prefill
        of every question bucket in `questions` that fits the capacity."""
        graph = self.lease(tokens)
        if graph is None:
            raise RuntimeError("that bucket's graph is in use")
        try:
            for bucket in questions:
                if bucket <= graph.capacity:
                    graph.prefill_graph(bucket)
                    if self.pipeline_groups is not None:
                        graph.prefill_graph(bucket, self.pipeline_groups)
        finally:
            self.release(graph)
        return graph

    def _capture(self, capacity: int) -> StitchGraph:
        if self._attention is None:
            self._attention = resolve_attention(self._forward.spec, self._requested)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()  # one memory pool for every bucket's activations
        while len(self._graphs) >= self.max_graphs:
            idle = next((c for c in self._graphs if c not in self._leased), None)
            if idle is None:
                break
            del self._graphs[idle]
        graph = StitchGraph(self._forward, capacity, self._attention, self._pool)
        self._graphs[capacity] = graph
        log.info("a stitch buffer of %d slots (%s attention)", capacity, graph.attention)
        return graph


def graphs_enabled(option: bool | None, device: torch.device) -> bool:
    """`cuda_graphs` engine option: None means on wherever the model is on CUDA."""
    if device.type != "cuda":
        return False
    return True if option is None else option


__all__ = [
    "QUESTION_BUCKETS",
    "LayerGroups",
    "PrefillGraph",
    "StitchGraph",
    "StitchGraphs",
    "bucket_capacity",
    "graph_tokens",
    "graphs_enabled",
    "layer_groups",
    "question_bucket",
]
