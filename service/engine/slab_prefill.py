"""Filling an admitted request's slab: the mechanics under the scheduler's admission policy.

The scheduler decides *when* (who is admitted, which questions go together, how many naive tokens a step takes); this
module does *how*: a request's chunks stitched into its slab, one request prefilled alone by the engine's
single-sequence steps (through a leased CUDA graph where one fits), and several requests' new tokens — questions after
their stitched contexts, or naive prompts' chunks — run as one batched forward (`BatchDecoder.extend`, replayed from
`ExtendGraphs` on CUDA), and questions ride in a decode step's forward (`BatchDecoder.mixed`, `MixedGraphs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from service.engine.attention import FLASH_VARLEN
from service.engine.batch_decode import BatchDecoder, DecodeRows, ExtendRows, StepFeed
from service.engine.batch_request import BatchRequest
from service.engine.engine import GenerationMode, StitchEngine, Stopwatch, TurboPrefill, stage_setter
from service.engine.extend_graph import ExtendGraphs, ExtendRequest
from service.engine.kv_buffer import KVBuffer
from service.engine.kv_layout import KVBlock
from service.engine.mixed_graph import DecodeInputs, MixedGraphs


class SlabPrefill:
    """Stitch and prefill into the slabs of `decoder`'s pool. `batched`: whether several requests' new tokens run
    as one forward (off when `batch_prefill_min` is 0, or where it does not pay); on CUDA with `cuda_graphs` that
    forward replays `extend_graphs`."""

    def __init__(
        self,
        engine: StitchEngine,
        decoder: BatchDecoder,
        cuda_graphs: bool,
        batch_prefill_min: int,
        mixed_picks: int = 0,
    ) -> None:
        """`mixed_picks` > 0: questions may be piggybacked on decode steps (`mixed`), whose graphs may be fed
        from that many unread picks."""
        self.engine = engine
        self.decoder = decoder
        self.batched = batch_prefill_min > 0 and self._batched_pays()
        capture = cuda_graphs and self.batched and ExtendGraphs.fit(decoder.pool.slots)
        self.extend_graphs = ExtendGraphs(decoder) if capture else None
        mixed = capture and mixed_picks > 0 and decoder.attention == FLASH_VARLEN
        self.mixed_graphs = MixedGraphs(decoder, mixed_picks) if mixed else None

    def _batched_pays(self) -> bool:
        """On the CPU the loop attention is the reference kernel, so one forward for all questions only saves
        work. On CUDA only with flash varlen (its start-up probe agreed): the loop there is one eager attention
        per request, slower than each question's own CUDA-graph prefill."""
        return self.engine.spec.device.type == "cpu" or self.decoder.extend_backend == FLASH_VARLEN

    def warm(self) -> None:
        """Capture every batched-prefill graph now (server start)."""
        if self.extend_graphs is not None:
            self.extend_graphs.warm()

    def warm_mixed(self, tokens: int) -> None:
        """Capture every mixed-step graph for decode rows up to `tokens` live slots now (server start)."""
        if self.mixed_graphs is not None:
            self.mixed_graphs.warm(tokens)

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
        tokens = new_ids if new_ids is not None else [list(r.prompt.question) for r in group]
        entries = reserve_new_tokens(group, tokens)
        if self.extend_graphs is not None:
            logits = self.extend_graphs.extend(entries)
        else:
            logits = self.decoder.extend(ExtendRows.build(entries, self.engine.spec.device))
        commit_new_tokens(group, tokens)
        return logits

    def mixes(self, batch: int, questions: Sequence[BatchRequest]) -> bool:
        """Whether `questions` can ride in a decode step of `batch` rows (`mixed`): always eagerly; with graphs,
        where a captured shape holds them (more or longer questions are prefilled apart)."""
        if self.mixed_graphs is None:
            return self.extend_graphs is None
        return self.mixed_graphs.fits(batch, [len(r.prompt.question) for r in questions])

    def mixed(self, decode: DecodeInputs, feed: StepFeed | None, questions: Sequence[BatchRequest]) -> torch.Tensor:
        """A decode step (its rows' ids, positions and spans; `feed`: rows whose id is an unread pick on the
        device) with `questions` prefilled in its forward (`BatchDecoder.mixed`); logits [B + Q, vocab]: the
        decode rows', then each question's last token's. The decode rows' slots are the caller's to reserve."""
        tokens = [list(r.prompt.question) for r in questions]
        entries = reserve_new_tokens(questions, tokens)
        if self.mixed_graphs is not None:
            logits = self.mixed_graphs.step(decode, feed, entries)
        else:
            device = self.engine.spec.device
            ids, positions, spans, _ = decode
            rows = DecodeRows.build(ids, positions, spans, device, feed)
            logits = self.decoder.mixed(rows, ExtendRows.build(entries, device))
        commit_new_tokens(questions, tokens)
        return logits

    def chunk_alone(self, request: BatchRequest, ids: Sequence[int], first: int) -> torch.Tensor:
        """A chunk of a naive prompt (its tokens from position `first`) after its slab's live slots, on its own;
        logits of the last."""
        return self.engine.forward.extend(request.buffer, list(ids), torch.arange(first, first + len(ids)))

    def prefill_alone(self, request: BatchRequest, buffer: KVBuffer, watch: Stopwatch) -> torch.Tensor:
        """Fill the slab with the engine's own stitch and prefill (`prefill_naive`, `prefill_turbo`); logits of the
        last token. Its stages are timed by `watch` (deferred in the overlapped scheduler: settled at its first token).

        With CUDA graphs a turbo request is stitched and prefilled in a leased graph's buffer (the question
        through its prefill graph, pipelined with the copies still landing) and its live KV then copied into
        the slab: a device-to-device copy of ~0.1 ms at 8K on an H200 against the ~3x slower eager prefill."""
        engine, timings, prompt = self.engine, request.result.timings, request.prompt
        if request.mode is GenerationMode.NAIVE:
            _, logits = engine.prefill_naive(prompt, request.sampling.max_new_tokens, into=buffer)
            watch.lap(stage_setter(timings, "prefill_ms"))
            return logits
        if engine.recomputes_in_full(prompt, request.recompute):
            # The whole context recomputed, the faster way: its time is the recompute's (the question rides in it).
            _, logits = engine.prefill_naive(prompt, request.sampling.max_new_tokens, into=buffer)
            request.result.recomputed_tokens = sum(len(b) for b in prompt.blocks)
            watch.lap(stage_setter(timings, "recompute_ms"))
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


def reserve_new_tokens(group: Sequence[BatchRequest], tokens: Sequence[list[int]]) -> list[ExtendRequest]:
    """Room for each request's new tokens after its live slots: the extend's (ids, first position, slab start,
    live slots before) per request."""
    entries: list[ExtendRequest] = []
    for request, ids in zip(group, tokens, strict=True):
        buffer = request.buffer
        buffer.reserve(len(ids))
        assert request.slab is not None
        entries.append((ids, buffer.next_position, request.slab.start, buffer.length))
    return entries


def commit_new_tokens(group: Sequence[BatchRequest], tokens: Sequence[list[int]]) -> None:
    """The new tokens reserved by `reserve_new_tokens` written: live, and the next position past them."""
    for request, ids in zip(group, tokens, strict=True):
        request.buffer.commit(len(ids), request.buffer.next_position + len(ids))
