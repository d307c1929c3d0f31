"""CUDA-graph decode: one captured decode step per KV capacity bucket, replayed with the token copied in.

Eager decode at 8K context on an H200 is bound by the CPU launching ~1,500 small kernels per token (22 ms of
CPU for 6 ms of GPU work). A CUDA graph records those launches once and replays them with one call. A graph
fixes every pointer and shape, so the captured step (`LeanForward.decode_static`) reads the token, its position
and its slot from static device tensors, writes K/V into a buffer the graph owns, and attends over that
buffer's whole capacity with the slots past the current length kept out on the device: no `.item()`, no Python
branch on tensor values, no allocation whose size depends on the length.

A request's own buffer (stitched context + question) is copied into the graph's buffer once before its first
decode step (470 MB at 8K context: ~0.2 ms device-to-device), so stitching and prefill stay as they are.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Any

import torch
import torch.nn.functional as F

from service.engine.forward import LeanForward, StaticAttend
from service.engine.kv_buffer import KVBuffer
from service.engine.model import ModelSpec

log = logging.getLogger(__name__)

FLASH_VARLEN = "flash_varlen"
SDPA_MASK = "sdpa_mask"
ATTENTION_BACKENDS = (FLASH_VARLEN, SDPA_MASK)
MIN_BUCKET = 1024
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


# ---- attention over a full-capacity buffer ---------------------------------------------------------------


def _sdpa_masked(mask: torch.Tensor) -> StaticAttend:
    """SDPA with an additive mask [1, 1, 1, C] (0 for live slots, -inf past the length).

    The query heads of one KV group share their keys, so they go in as that group's G "query tokens":
    q [1, Hkv, G, D] against k, v [1, Hkv, C, D] reads each key once and needs no GQA expansion.
    """

    def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
        heads, kv_heads, dim = q.shape[1], keys.shape[0], q.shape[-1]
        grouped = q.reshape(1, kv_heads, heads // kv_heads, dim)
        out = F.scaled_dot_product_attention(grouped, keys.unsqueeze(0), values.unsqueeze(0), mask, scale=scale)
        return out.reshape(1, 1, heads, dim)

    return attend


def _flash_varlen(cu_q: torch.Tensor, cu_k: torch.Tensor, used: torch.Tensor, capacity: int) -> StaticAttend:
    """flash-attention's variable-length kernel with `seqused_k`: only the live keys are read at all.

    `torch.ops.aten._flash_attention_forward` is a private op; `resolve_attention` checks it against the SDPA
    path on the device before a graph uses it, and falls back when it is missing or disagrees.
    """

    def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
        heads, dim = q.shape[1], q.shape[-1]
        out = torch.ops.aten._flash_attention_forward(
            q.reshape(1, heads, dim),
            keys.transpose(0, 1),
            values.transpose(0, 1),
            cu_q,
            cu_k,
            1,
            capacity,
            0.0,
            False,
            False,
            scale=scale,
            seqused_k=used,
        )[0]
        result: torch.Tensor = out.reshape(1, 1, heads, dim)
        return result

    return attend


class _LengthInputs:
    """Device tensors that tell the attention how many slots are live, derived from the slot inside the graph."""

    def __init__(self, capacity: int, device: torch.device, dtype: torch.dtype) -> None:
        self.capacity = capacity
        self.dtype = dtype
        self.arange = torch.arange(capacity, device=device)
        self.cu_q = torch.tensor([0, 1], dtype=torch.int32, device=device)
        self.cu_k = torch.tensor([0, capacity], dtype=torch.int32, device=device)

    def attend_for(self, backend: str, slot: torch.Tensor) -> StaticAttend:
        """Build the attention for a step writing at `slot` [1]; slots 0..slot are live."""
        if backend == FLASH_VARLEN:
            used = (slot + 1).to(torch.int32)
            return _flash_varlen(self.cu_q, self.cu_k, used, self.capacity)
        live = self.arange <= slot
        mask = torch.zeros(self.capacity, dtype=self.dtype, device=slot.device).masked_fill(~live, float("-inf"))
        return _sdpa_masked(mask.view(1, 1, 1, -1))


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
def _probe_flash(spec: ModelSpec, capacity: int = 512, live: int = 300) -> float:
    """Largest |flash-varlen - masked SDPA| on random data whose dead tail holds huge values."""
    generator = torch.Generator(device=spec.device).manual_seed(0)
    dev, d = spec.device, spec.head_dim
    q = torch.randn((1, spec.num_heads, 1, d), generator=generator, device=dev).to(spec.dtype)
    kv = torch.randn((2, spec.num_kv_heads, capacity, d), generator=generator, device=dev).to(spec.dtype)
    kv[:, :, live:] = 1e4
    inputs = _LengthInputs(capacity, dev, spec.dtype)
    slot = torch.tensor([live - 1], device=dev)
    scale = d**-0.5
    flash = inputs.attend_for(FLASH_VARLEN, slot)(q, kv[0], kv[1], scale)
    sdpa = inputs.attend_for(SDPA_MASK, slot)(q, kv[0], kv[1], scale)
    return float((flash.float() - sdpa.float()).abs().max())


# ---- one captured step ----------------------------------------------------------------------------------


class DecodeGraph:
    """A captured decode step over a KV buffer of fixed `capacity`, owned by the graph.

    Use: `load(request_buffer)` once, then `step(token)` per output token (fp32 logits [vocab], static: read
    before the next step) and `greedy_token()` for the argmax computed inside the graph.
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
        self.buffer = KVBuffer(spec, capacity)
        # Masked SDPA multiplies dead slots' values by a zero weight: they must be finite (0 * NaN is NaN), and
        # fresh memory may hold NaN bit patterns. Later tenants only ever leave finite model outputs there.
        self.buffer.data.zero_()
        device = spec.device
        # Static inputs: replay reads them where capture found them, so they are filled in place, never rebound.
        self._ids = torch.zeros((1, 1), dtype=torch.long, device=device)
        self._position = torch.zeros(1, dtype=torch.long, device=device)
        self._slot = torch.zeros(1, dtype=torch.long, device=device)
        self._lengths = _LengthInputs(capacity, device, spec.dtype)
        self._graph = torch.cuda.CUDAGraph()
        start = time.perf_counter()
        self._logits, self._next = self._capture(pool)
        self.capture_ms = (time.perf_counter() - start) * 1e3

    def _run(self) -> tuple[torch.Tensor, torch.Tensor]:
        attend = self._lengths.attend_for(self.attention, self._slot)
        logits = self._forward.decode_static(self.buffer.data, self._ids, self._position, self._slot, attend)
        return logits, torch.argmax(logits)

    def _capture(self, pool: Any) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.spec.device
        # Warm-up on a side stream first (cuBLAS handles and workspaces, lazy kernel loading must not happen
        # inside the capture). Writes land at slot 0 of the graph's own buffer, which `load` overwrites.
        side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(2):
                self._run()
        torch.cuda.current_stream(device).wait_stream(side)
        with torch.inference_mode(), torch.cuda.graph(self._graph, pool=pool):
            outputs = self._run()
        torch.cuda.synchronize(device)
        return outputs

    def load(self, source: KVBuffer) -> None:
        """Take over a request's buffer: copy its live tokens and length into the graph's buffer."""
        if source.capacity > self.capacity:
            raise ValueError(f"a buffer of capacity {source.capacity} does not fit a graph of {self.capacity}")
        n = source.length
        with torch.inference_mode():
            self.buffer.data[:, :, :, :n].copy_(source.data[:, :, :, :n])
        self.buffer.truncate(0, 0)
        self.buffer.commit(n, source.next_position)

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
    graph is leased gives None, and that stream decodes eagerly: never wrong, only slower.
    """

    def __init__(self, forward: LeanForward, attention: str = "auto", max_graphs: int = 4) -> None:
        self._forward = forward
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

    def warm(self, tokens: int) -> DecodeGraph:
        """Capture (or find) the graph for `tokens` slots ahead of traffic, e.g. at server start-up."""
        graph = self.lease(tokens)
        if graph is None:
            raise RuntimeError("that bucket's graph is in use")
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
    "DecodeGraph",
    "DecodeGraphs",
    "bucket_capacity",
    "graphs_enabled",
    "resolve_attention",
]
