"""CUDA graphs for the whole request: the question prefill and every decode step, over one graph-owned buffer.

Eager decode at 8K context on an H200 is bound by the CPU launching ~1,500 small kernels per token (22 ms of
CPU for 6 ms of GPU work), and the 128-token question prefill the same way (~38 ms of CPU for 18 ms of GPU). A
CUDA graph records those launches once and replays them with one call. A graph fixes every pointer and shape, so
the captured code (`LeanForward.forward_static`) reads its token ids, positions and slots from static device
tensors, writes K/V into a buffer the graph owns, and attends over that buffer's whole capacity with the slots
past the live length kept out on the device: no `.item()`, no Python branch on tensor values, no allocation
whose size depends on the length.

One `DecodeGraph` per capacity bucket owns a KV buffer, the captured decode step, and prefill graphs for
questions of bucketed lengths (`QUESTION_BUCKETS`), all over that one buffer: a request's chunks are stitched
straight into it, its question prefilled there and its answer decoded there, so its KV is placed once. A
question is padded at the end to its bucket; causal attention keeps real tokens blind to the padding, the
padded slots' K/V past the live length are never attended (flash's `seqused_k` / the mask follow the live
length) and the first decode steps overwrite them. A request whose stitched buffer was built elsewhere (the
naive mode) is copied in once by `load`.
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
import torch.nn.functional as F

from service.engine.forward import LeanForward, StaticAttend
from service.engine.kv_buffer import KVBuffer
from service.engine.model import ModelSpec

# Layer ranges [first, end) of a pipelined prefill's segments, in order, covering every layer once.
LayerGroups = tuple[tuple[int, int], ...]
# Called with a segment's layer range right before that segment replays, on the stream it replays on: the
# pipelined stitch waits there for those layers' copies and places them.
BeforeSegment = Callable[[tuple[int, int]], None]

log = logging.getLogger(__name__)

FLASH_VARLEN = "flash_varlen"
SDPA_MASK = "sdpa_mask"
ATTENTION_BACKENDS = (FLASH_VARLEN, SDPA_MASK)
MIN_BUCKET = 1024
# Question lengths (tokens of the prefilled suffix) a prefill graph is captured for; longer questions prefill
# eagerly into the graph's buffer. A 128-token question, the benchmarks' size, fills its bucket exactly.
QUESTION_BUCKETS = (32, 64, 128, 256, 512)
# A prefill's attention over the context is split into this many key ranges run side by side and merged by
# their log-sum-exp (flash-decoding's split-KV): one range per head is only 28 thread blocks for 128 queries on
# 132 SMs, and each walks the whole context alone (10 ms of a 16K prefill; see docs/benchmarks.md §8).
PREFILL_KV_SPLITS = 8
# Agreement between the two attention backends on the start-up probe: both are bf16 kernels with fp32
# softmax; measured differences are a few bf16 ulps of outputs of size ~1, a wrong length is off by ~0.1.
_PROBE_TOLERANCE = 2e-2


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


# ---- attention over a full-capacity buffer ---------------------------------------------------------------


def _sdpa_masked(mask: torch.Tensor) -> StaticAttend:
    """SDPA with an additive mask (0 for visible slots, -inf elsewhere) over the whole capacity C.

    The query heads of one KV group share their keys, so they go in as that group's G * T "query tokens":
    q [1, Hkv, G * T, D] against k, v [1, Hkv, C, D] reads each key once and needs no GQA expansion. `mask` is
    [1, 1, 1, C] for one query (broadcast) or [1, 1, G * T, C] (row g * T + t is query t's row).
    """

    def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
        tokens, heads, dim = q.shape
        kv_heads = keys.shape[0]
        group = heads // kv_heads
        grouped = q.reshape(tokens, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(1, kv_heads, -1, dim)
        out = F.scaled_dot_product_attention(grouped, keys.unsqueeze(0), values.unsqueeze(0), mask, scale=scale)
        return out.view(kv_heads, group, tokens, dim).permute(2, 0, 1, 3).reshape(tokens, heads, dim)

    return attend


def _flash_varlen(
    cu_q: torch.Tensor, cu_k: torch.Tensor, used: torch.Tensor, tokens: int, capacity: int
) -> StaticAttend:
    """flash-attention's variable-length kernel with `seqused_k`: only the live keys are read at all.

    With several queries it runs causal, which flash aligns to the bottom-right corner of the *used* keys:
    query t sees keys 0 .. used - tokens + t, i.e. the context and the question up to itself.
    `torch.ops.aten._flash_attention_forward` is a private op; `resolve_attention` checks it against the SDPA
    path on the device (one query and several) before a graph uses it, and falls back when it is missing or
    disagrees.
    """

    def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
        out: torch.Tensor = torch.ops.aten._flash_attention_forward(
            q,
            keys.transpose(0, 1),
            values.transpose(0, 1),
            cu_q,
            cu_k,
            tokens,
            capacity,
            0.0,
            tokens > 1,
            False,
            scale=scale,
            seqused_k=used,
        )[0]
        return out

    return attend


def _flash(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """flash varlen over keys/values [total_k, Hkv, D]; returns the output [total_q, H, D] and its fp32 log-sum-exp."""
    result = torch.ops.aten._flash_attention_forward(
        q, keys, values, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale
    )
    return result[0], result[1]


def _lse_rows(lse: torch.Tensor, parts: int, tokens: int, heads: int) -> torch.Tensor:
    """flash's log-sum-exp as [parts, tokens, heads], whichever layout this build returns: [heads, total_q]
    (newer flash-attention) or [batch, heads, max_q] (older). An empty key range reports +inf with a zero
    output; it must weigh nothing, so it becomes -inf."""
    flat = lse.dim() == 2
    rows = lse.view(heads, parts, tokens).permute(1, 2, 0) if flat else lse[:, :, :tokens].permute(0, 2, 1)
    return rows.masked_fill(rows == float("inf"), float("-inf"))


def _flash_split(
    cu_parts: torch.Tensor,
    cu_context: torch.Tensor,
    cu_q: torch.Tensor,
    cu_own: torch.Tensor,
    tokens: int,
    capacity: int,
    splits: int,
) -> StaticAttend:
    """A prefill's attention as `splits` non-causal context ranges plus the causal question-over-itself part,
    each a flash varlen "sequence" of the same call shape, merged by log-sum-exp in fp32.

    `cu_context` [splits + 1] holds the range boundaries over slots 0..start (the live context), `cu_own`
    [start, start + tokens] the question's own slots; both are computed inside the graph from the slots.
    """

    def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
        heads, dim = q.shape[1], q.shape[2]
        k, v = keys.transpose(0, 1), values.transpose(0, 1)
        repeated = q.unsqueeze(0).expand(splits, tokens, heads, dim).reshape(splits * tokens, heads, dim)
        context_out, context_lse = _flash(repeated, k, v, cu_parts, cu_context, tokens, capacity, False, scale)
        own_out, own_lse = _flash(q, k, v, cu_q, cu_own, tokens, tokens, True, scale)
        lse = torch.cat((_lse_rows(context_lse, splits, tokens, heads), _lse_rows(own_lse, 1, tokens, heads)))
        # The question's own part always has a key (itself), so the maximum is finite.
        weights = torch.exp(lse - lse.amax(dim=0, keepdim=True)).unsqueeze(-1)  # [parts, T, H, 1]
        outs = torch.cat((context_out.view(splits, tokens, heads, dim), own_out.view(1, tokens, heads, dim)))
        merged = (outs.float() * weights).sum(dim=0) / weights.sum(dim=0)
        return merged.to(q.dtype)

    return attend


class _LengthInputs:
    """Device tensors that tell the attention which slots are live, derived from the slots inside the graph."""

    def __init__(self, spec: ModelSpec, capacity: int, tokens: int = 1, kv_splits: int = 1) -> None:
        device = spec.device
        self.capacity = capacity
        self.tokens = tokens
        self.kv_splits = kv_splits if tokens > 1 else 1
        self.group = spec.num_heads // spec.num_kv_heads
        self.dtype = spec.dtype
        self.arange = torch.arange(capacity, device=device)
        self.cu_q = torch.tensor([0, tokens], dtype=torch.int32, device=device)
        self.cu_k = torch.tensor([0, capacity], dtype=torch.int32, device=device)
        self.splits = torch.arange(self.kv_splits + 1, device=device)
        self.cu_parts = (self.splits * tokens).to(torch.int32)

    def attend_for(self, backend: str, slots: torch.Tensor) -> StaticAttend:
        """The attention for `tokens` queries written at contiguous `slots` [T]: query t sees slots 0..slots[t]."""
        if backend == FLASH_VARLEN and self.kv_splits > 1:
            start = slots[:1]
            cu_context = torch.div(start * self.splits, self.kv_splits, rounding_mode="floor").to(torch.int32)
            cu_own = torch.cat((start, slots[-1:] + 1)).to(torch.int32)
            return _flash_split(
                self.cu_parts, cu_context, self.cu_q, cu_own, self.tokens, self.capacity, self.kv_splits
            )
        if backend == FLASH_VARLEN:
            used = (slots[-1:] + 1).to(torch.int32)
            return _flash_varlen(self.cu_q, self.cu_k, used, self.tokens, self.capacity)
        visible = self.arange.unsqueeze(0) <= slots.unsqueeze(1)  # [T, C]
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=slots.device).masked_fill(~visible, float("-inf"))
        if self.tokens == 1:
            return _sdpa_masked(mask.view(1, 1, 1, -1))
        # One mask per replay (not per layer), repeated for the G query heads of a group stacked as rows.
        return _sdpa_masked(mask.repeat(self.group, 1).unsqueeze(0).unsqueeze(0))


_SPLITS_PROBED: dict[tuple[str, torch.dtype, int, int, int], int] = {}


def prefill_kv_splits(spec: ModelSpec, attention: str) -> int:
    """Key-range splits a flash prefill graph uses: PREFILL_KV_SPLITS when the split path runs and agrees with
    masked SDPA on the probe (empty ranges included), else 1 (one causal flash call); probed once per shape."""
    if attention != FLASH_VARLEN:
        return 1
    key = (str(spec.device), spec.dtype, spec.num_heads, spec.num_kv_heads, spec.head_dim)
    if key not in _SPLITS_PROBED:
        try:
            diff = _probe_flash(spec, PREFILL_KV_SPLITS)
        except Exception as err:  # a refusing private op only means "one range"
            log.info("split-KV flash prefill unavailable (%s); one causal call", err)
            diff = float("inf")
        if not diff <= _PROBE_TOLERANCE:
            log.warning("split-KV flash prefill differs from SDPA by %.4f; one causal call", diff)
        _SPLITS_PROBED[key] = PREFILL_KV_SPLITS if diff <= _PROBE_TOLERANCE else 1
    return _SPLITS_PROBED[key]


def resolve_attention(spec: ModelSpec, requested: str = "auto") -> str:
    """The attention backend a graph uses: `requested`, or for "auto" flash-varlen when it runs and agrees
    with masked SDPA on a random probe (poisoned tail included), else masked SDPA."""
    if requested in ATTENTION_BACKENDS:
        return requested
    if requested != "auto":
        raise ValueError(f"attention backend must be auto or one of {', '.join(ATTENTION_BACKENDS)}")
    if spec.dtype not in (torch.float16, torch.bfloat16):
        return SDPA_MASK
    try:
        diff = _probe_flash(spec)
    except Exception as err:  # a missing or refusing private op only means "use SDPA"
        log.info("flash varlen decode attention unavailable (%s); using masked SDPA", err)
        return SDPA_MASK
    if not diff <= _PROBE_TOLERANCE:
        log.warning("flash varlen decode attention differs from SDPA by %.4f; using masked SDPA", diff)
        return SDPA_MASK
    return FLASH_VARLEN


@torch.inference_mode()
def _probe_flash(spec: ModelSpec, kv_splits: int = 1, capacity: int = 512) -> float:
    """Largest |flash-varlen - masked SDPA| on random data whose dead tail holds huge values, for one query (a
    decode step) and for several causal queries (a prefill, with `kv_splits` context ranges; a short context
    leaves some ranges empty); q is a strided slice as in `forward_static`."""
    generator = torch.Generator(device=spec.device).manual_seed(0)
    dev, d, heads = spec.device, spec.head_dim, spec.num_heads
    worst = 0.0
    for tokens, live in ((1, 300), (5, 300), (5, 8)):
        kv = torch.randn((2, spec.num_kv_heads, capacity, d), generator=generator, device=dev).to(spec.dtype)
        kv[:, :, live:] = 1e4
        wide = torch.randn((tokens, heads + spec.num_kv_heads, d), generator=generator, device=dev).to(spec.dtype)
        q = wide[:, :heads]
        inputs = _LengthInputs(spec, capacity, tokens, kv_splits)
        slots = torch.arange(live - tokens, live, device=dev)
        flash = inputs.attend_for(FLASH_VARLEN, slots)(q, kv[0], kv[1], d**-0.5)
        sdpa = inputs.attend_for(SDPA_MASK, slots)(q, kv[0], kv[1], d**-0.5)
        worst = max(worst, float((flash.float() - sdpa.float()).abs().max()))
    return worst


def _capture(graph: torch.cuda.CUDAGraph, run: Callable[[], Any], device: torch.device, pool: Any) -> Any:
    """Warm `run` up on a side stream (cuBLAS handles and workspaces, lazy kernel loading must not happen
    inside the capture), then capture it into `graph`; returns the captured run's outputs (static tensors)."""
    side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side), torch.inference_mode():
        for _ in range(2):
            run()
    torch.cuda.current_stream(device).wait_stream(side)
    with torch.inference_mode(), torch.cuda.graph(graph, pool=pool):
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
        self._lengths = _LengthInputs(spec, capacity, tokens, self.kv_splits)
        self._offsets = torch.arange(tokens, device=spec.device)
        # [ids..., start position, start slot, last real index]; pinned so the copy is asynchronous DMA.
        self._host = torch.zeros(tokens + 3, dtype=torch.long, pin_memory=True)
        self._inputs = torch.zeros(tokens + 3, dtype=torch.long, device=spec.device)
        self._copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
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
        # The previous replay's copy must have left the pinned staging buffer before it is overwritten.
        self._copied.synchronize()
        self._host[: len(question)] = torch.tensor(list(question), dtype=torch.long)
        self._host[len(question) : n] = 0  # padding: any valid id; its K/V land past the live length
        self._host[n], self._host[n + 1], self._host[n + 2] = position, slot, real - 1
        with torch.inference_mode():
            self._inputs.copy_(self._host, non_blocking=True)
        self._copied.record()

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


class DecodeGraph:
    """A KV buffer of fixed `capacity` owned by the graphs captured over it: one decode step, and a prefill
    graph per question bucket (captured on first use or by `DecodeGraphs.warm`).

    Use: stitch a request into `buffer` and `prefill(question)`, or `load(request_buffer)`; then `step(token)`
    per output token (fp32 logits [vocab], static: read before the next step) and `greedy_token()` for the argmax
    computed inside the graph.
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
        device = spec.device
        # Static inputs: replay reads them where capture found them, so they are filled in place, never rebound.
        self._ids = torch.zeros((1, 1), dtype=torch.long, device=device)
        self._position = torch.zeros(1, dtype=torch.long, device=device)
        self._slot = torch.zeros(1, dtype=torch.long, device=device)
        self._lengths = _LengthInputs(spec, capacity)
        self._graph = torch.cuda.CUDAGraph()
        self._prefills: dict[tuple[int, LayerGroups | None], PrefillGraph] = {}
        self.prefill_capture_ms: dict[int, float] = {}
        self.segmented_capture_ms: dict[int, float] = {}
        start = time.perf_counter()
        # Writes land at slot 0 of the graph's own buffer before any request owns it.
        outputs: tuple[torch.Tensor, torch.Tensor] = _capture(self._graph, self._run, device, self._pool)
        self._logits, self._next = outputs
        self.capture_ms = (time.perf_counter() - start) * 1e3

    def _run(self) -> tuple[torch.Tensor, torch.Tensor]:
        attend = self._lengths.attend_for(self.attention, self._slot)
        logits = self._forward.decode_static(self.buffer.data, self._ids, self._position, self._slot, attend)
        return logits, torch.argmax(logits)

    def load(self, source: KVBuffer) -> None:
        """Take over a request's buffer: copy its live tokens and length into the graph's buffer."""
        if source.capacity > self.capacity:
            raise ValueError(f"a buffer of capacity {source.capacity} does not fit a graph of {self.capacity}")
        n = source.length
        with torch.inference_mode():
            self.buffer.data[:, :, :, :n].copy_(source.data[:, :, :, :n])
        self.buffer.truncate(0, 0)
        self.buffer.commit(n, source.next_position)

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

    def step(self, token: int) -> torch.Tensor:
        """Decode `token` at the buffer's next slot and position; returns the static fp32 logits [vocab]."""
        slot = self.buffer.reserve(1)
        position = self.buffer.next_position
        with torch.inference_mode():
            self._ids.fill_(token)
            self._position.fill_(position)
            self._slot.fill_(slot)
        self._graph.replay()
        self.buffer.commit(1, position + 1)
        return self._logits

    def greedy_token(self) -> int:
        """The argmax of the last step's logits, computed inside the graph."""
        return int(self._next)


class DecodeGraphs:
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
        self._graphs: OrderedDict[int, DecodeGraph] = OrderedDict()
        self._leased: set[int] = set()
        self._lock = threading.Lock()
        self._pool: Any = None
        self.capture_ms: dict[int, float] = {}

    def capacity_for(self, tokens: int) -> int:
        return bucket_capacity(tokens, self._forward.spec.max_context)

    @property
    def prefill_capture_ms(self) -> dict[tuple[int, int], float]:
        """Capture time of every prefill graph kept, by (capacity, question bucket)."""
        with self._lock:
            graphs = list(self._graphs.items())
        return {(c, t): ms for c, g in graphs for t, ms in g.prefill_capture_ms.items()}

    def lease(self, tokens: int) -> DecodeGraph | None:
        """A free graph whose capacity holds `tokens` slots, captured now if its bucket has none."""
        capacity = self.capacity_for(tokens)
        with self._lock:
            if capacity in self._leased:
                return None
            graph = self._graphs.get(capacity) or self._capture(capacity)
            self._graphs.move_to_end(capacity)
            self._leased.add(capacity)
            return graph

    def release(self, graph: DecodeGraph) -> None:
        with self._lock:
            self._leased.discard(graph.capacity)

    def warm(self, tokens: int, questions: Sequence[int] = QUESTION_BUCKETS) -> DecodeGraph:
        """Capture (or find) the graphs for `tokens` slots ahead of traffic, e.g. at server start-up: the decode
        step and the prefill of every question bucket in `questions` that fits the capacity."""
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

    def _capture(self, capacity: int) -> DecodeGraph:
        if self._attention is None:
            self._attention = resolve_attention(self._forward.spec, self._requested)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()  # one memory pool for every bucket's activations
        while len(self._graphs) >= self.max_graphs:
            idle = next((c for c in self._graphs if c not in self._leased), None)
            if idle is None:
                break
            del self._graphs[idle]
        graph = DecodeGraph(self._forward, capacity, self._attention, self._pool)
        self._graphs[capacity] = graph
        self.capture_ms[capacity] = graph.capture_ms
        log.info("captured the decode graph for %d slots (%s) in %.0f ms", capacity, graph.attention, graph.capture_ms)
        return graph


def graphs_enabled(option: bool | None, device: torch.device) -> bool:
    """`cuda_graphs` engine option: None means on wherever the model is on CUDA."""
    if device.type != "cuda":
        return False
    return True if option is None else option


__all__ = [
    "ATTENTION_BACKENDS",
    "PREFILL_KV_SPLITS",
    "QUESTION_BUCKETS",
    "DecodeGraph",
    "DecodeGraphs",
    "LayerGroups",
    "PrefillGraph",
    "bucket_capacity",
    "graph_tokens",
    "graphs_enabled",
    "layer_groups",
    "prefill_kv_splits",
    "question_bucket",
    "resolve_attention",
]
