"""Filling an admitted request's slab: the mechanics under the scheduler's admission policy.

The scheduler decides *when* (who is admitted, which questions go together, how many naive tokens a step takes);
this module does *how*: a request's chunks stitched into its slab, one request prefilled alone as `generate`
prefills (through a leased CUDA graph where one fits), and several requests' new tokens — questions after their
stitched contexts, or naive prompts' chunks — run as one batched forward (`BatchDecoder.extend`, replayed from
`ExtendGraphs` on CUDA).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from service.engine.attention import FLASH_VARLEN
from service.engine.batch_decode import BatchDecoder, ExtendRows
from service.engine.batch_request import BatchRequest
from service.engine.engine import GenerationMode, StitchEngine, Stopwatch, TurboPrefill, stage_setter
from service.engine.extend_graph import ExtendGraphs
from service.engine.kv_buffer import KVBuffer
from service.engine.kv_layout import KVBlock


class SlabPrefill:
    """Stitch and prefill into the slabs of `decoder`'s pool. `batched`: whether several requests' new tokens run
    as one forward (off when `batch_prefill_min` is 0, or where it does not pay); on CUDA with `cuda_graphs` that
    forward replays `extend_graphs`."""

    def __init__(self, engine: StitchEngine, decoder: BatchDecoder, cuda_graphs: bool, batch_prefill_min: int) -> None:
        self.engine = engine
        self.decoder = decoder
        self.batched = batch_prefill_min > 0 and self._batched_pays()
        capture = cuda_graphs and self.batched and ExtendGraphs.fit(decoder.pool.slots)
        self.extend_graphs = ExtendGraphs(decoder) if capture else None

    def _batched_pays(self) -> bool:
        """On the CPU the loop attention is the reference kernel, so one forward for all questions only saves
        work. On CUDA only with flash varlen (its start-up probe agreed): the loop there is one eager attention
        per request, slower than each question's own CUDA-graph prefill (measured, docs/benchmarks.md §10.5)."""
        return self.engine.spec.device.type == "cpu" or self.decoder.extend_backend == FLASH_VARLEN

    def warm(self) -> None:
        """Capture every batched-prefill graph now (server start)."""
        if self.extend_graphs is not None:
            self.extend_graphs.warm()

    def chunk_kv(self, request: BatchRequest) -> Sequence[KVBlock]:
        """The chunks' KV as fetched at admission, or computed here when none was given (offline use, tests)."""
        if request.chunk_kv is not None:
            return request.chunk_kv
        blocks = request.prompt.blocks
        return self.engine.precompute(blocks) if blocks else []

    def stitch_into_slab(self, request: BatchRequest) -> None:
        """The request's chunks stitched into its slab. On CUDA through a leased graph's buffer, where the fused
        stitch kernel runs (it needs a contiguous buffer; a slab is a strided view of the pool), then copied into
        the slab (device to device, live slots only)."""
        engine, prompt = self.engine, request.prompt
        chunk_kv = self.chunk_kv(request)
        room = len(prompt.question) + request.sampling.max_new_tokens
        graph = engine.lease_graph(prompt.context_tokens, len(prompt.question), 0)
        if graph is None:
            engine.stitch(chunk_kv, request.positions, room, request.chunk_ready, into=request.buffer)
            return
        try:
            staged, _ = engine.stitch(
                chunk_kv, request.positions, len(prompt.question), request.chunk_ready, graph.buffer
            )
            request.buffer.copy_from(staged)
        finally:
            engine.release_graph(graph)

    def extend(self, group: Sequence[BatchRequest], new_ids: Sequence[list[int]] | None = None) -> torch.Tensor:
        """Each request's new tokens (default: its question) after its live slots, one batched forward; logits
        [len(group), vocab] of each one's last new token."""
        device = self.engine.spec.device
        tokens = new_ids if new_ids is not None else [list(r.prompt.question) for r in group]
        entries = []
        for request, ids in zip(group, tokens, strict=True):
            buffer = request.buffer
            buffer.reserve(len(ids))
            assert request.slab is not None
            entries.append((ids, buffer.next_position, request.slab.start, buffer.length))
        if self.extend_graphs is not None:
            logits = self.extend_graphs.extend(entries)
        else:
            logits = self.decoder.extend(ExtendRows.build(entries, device))
        for request, ids in zip(group, tokens, strict=True):
            request.buffer.commit(len(ids), request.buffer.next_position + len(ids))
        return logits

    def chunk_alone(self, request: BatchRequest, ids: Sequence[int], first: int) -> torch.Tensor:
        """A chunk of a naive prompt (its tokens from position `first`) after its slab's live slots, on its own;
        logits of the last."""
        return self.engine.forward.extend(request.buffer, list(ids), torch.arange(first, first + len(ids)))

    def prefill_alone(self, request: BatchRequest, buffer: KVBuffer, watch: Stopwatch) -> torch.Tensor:
        """Fill the slab as `generate` fills its buffer (same stitch and prefill code); logits of the last token.
        Its stages are timed by `watch` (deferred in the overlapped scheduler: settled at its first token).

        With CUDA graphs a turbo request is stitched and prefilled in a leased graph's buffer (the question
        through its prefill graph, pipelined with the copies still landing) and its live KV then copied into
        the slab: a device-to-device copy of ~0.1 ms at 8K on an H200 against the ~3x slower eager prefill."""
        engine, timings, prompt = self.engine, request.result.timings, request.prompt
        if request.mode is GenerationMode.NAIVE:
            _, logits = engine.prefill_naive(prompt, request.sampling.max_new_tokens, into=buffer)
            watch.lap(stage_setter(timings, "prefill_ms"))
            return logits
        chunk_kv = self.chunk_kv(request)
        if request.chunk_kv is None:
            watch.lap(stage_setter(timings, "precompute_ms"))
        extra = request.sampling.max_new_tokens
        turbo = TurboPrefill(
            chunk_kv, prompt.question, request.positions, extra, request.chunk_ready, request.recompute
        )
        graph = engine.lease_graph(prompt.context_tokens, len(prompt.question), 0)
        if graph is None:
            return engine.prefill_turbo(turbo, watch, request.result, into=buffer)[1]
        try:
            staged, logits = engine.prefill_turbo(replace(turbo, extra_tokens=0), watch, request.result, graph)
            buffer.copy_from(staged)
        finally:
            engine.release_graph(graph)
        return logits
