"""The batched question prefill (`BatchDecoder.extend`) captured in CUDA graphs, one per (row bucket, token bucket).

Eagerly, the questions admitted together cost the same ~1,500 kernel launches as a decode step, issued from the
engine thread that shares the GIL with the event loop and retrieval, so under load the launches, not the GPU
work of a few ms, set the time. A graph replays them with one call.

A graph fixes shapes and pointers, so each is captured for `rows` requests (a bucket of `BATCH_BUCKETS`) and
`tokens` new tokens in all (a bucket of `TOKEN_BUCKETS`). The real requests come first; the rows up to the
bucket are empty (no queries); one padding row after them takes the tokens up to the bucket, at positions
0.. in a scratch slab the graphs own, so padding writes and reads only that slab. Flash varlen reads each row's
query range from `cu_q` and its live keys from `seqused_k`, so its max_seqlen_q/k only need to be upper bounds
(the token bucket and the model's context): no capacity bucket is needed, unlike the decode step's gather.
Only the flash varlen extend can be captured (the loop slices by host lengths).

`extend_layout` builds the flat static inputs on the host; the CPU tests run it eagerly through the loop
attention, and the GPU test compares each graph's logits with the eager extend.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from service.engine.attention import FLASH_VARLEN
from service.engine.batch_decode import BatchDecoder, ExtendRows, extend_lists
from service.engine.batch_graph import BATCH_BUCKETS, batch_bucket
from service.engine.cuda_graph import _capture
from service.engine.device_copy import copy_into

log = logging.getLogger(__name__)

# Total new tokens of one batched prefill a graph is captured for. A group with more is prefilled in several
# replays (requests split between them, each whole). The gateway benchmark's questions are ~150-250 tokens with
# the prompt's tail, so 8 of them fill 2,048. The padding slab holds the largest bucket: 4,096 slots are 235 MB
# of a Qwen2-7B pool's 16 GiB; a small pool gets smaller buckets (`ExtendGraphs`).
TOKEN_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096)
# The padding slab may take at most this share of the pool.
SCRATCH_SHARE = 0.25

# (new ids, first position, slab start, live slots before) per request, as `ExtendRows.build` takes them.
ExtendRequest = tuple[Sequence[int], int, int, int]
Span = tuple[int, int, int]  # (slab start, live slots after, new tokens) per row


def token_bucket(tokens: int, buckets: Sequence[int] = TOKEN_BUCKETS) -> int | None:
    """The smallest captured token count holding `tokens`, or None when none does."""
    if tokens <= 0:
        raise ValueError("a batched prefill needs at least one token")
    return next((b for b in sorted(buckets) if b >= tokens), None)


def buckets_for(pool_slots: int, buckets: Sequence[int] = TOKEN_BUCKETS) -> tuple[int, ...]:
    """The token buckets a pool of `pool_slots` can spare a padding slab for (`SCRATCH_SHARE` of it at most)."""
    return tuple(b for b in buckets if b <= pool_slots * SCRATCH_SHARE)


def extend_layout(
    requests: Sequence[ExtendRequest], rows: int, tokens: int, scratch: int
) -> tuple[list[int], tuple[Span, ...]]:
    """The flat static inputs of `requests` padded to `rows` rows (+ the padding row) and `tokens` tokens:
    [ids | positions | slots] (`tokens` each), [starts | used | last] (`rows + 1` each), cu_q (`rows + 2`),
    as `ExtendRows.from_flat` reads them; and each row's host span (for the loop attention)."""
    new = sum(len(ids) for ids, *_ in requests)
    if not requests or len(requests) > rows or new > tokens or any(not ids for ids, *_ in requests):
        raise ValueError(f"{len(requests)} requests of {new} tokens do not fit {rows} rows of {tokens} tokens")
    ids, positions, slots, cu, spans = extend_lists(requests)
    spans += [(scratch, 1, 0)] * (rows - len(requests))  # empty rows: no queries, one harmless scratch key
    cu += [new] * (rows - len(requests))
    pad = tokens - new
    ids += [0] * pad
    positions += range(pad)
    slots += range(scratch, scratch + pad)
    spans.append((scratch, max(pad, 1), pad))
    cu.append(tokens)
    last = [max(c - 1, 0) for c in cu[1:]]  # an empty row's "last token" is any valid index; its logits are dropped
    flat = ids + positions + slots + [s for s, _, _ in spans] + [u for _, u, _ in spans] + last + cu
    return flat, tuple(spans)


def layout_width(rows: int, tokens: int) -> int:
    """Entries of `extend_layout`'s flat inputs for `rows` rows (+ the padding row) and `tokens` tokens."""
    return 3 * tokens + 3 * (rows + 1) + rows + 2


def split_by_tokens(requests: Sequence[ExtendRequest], limit: int) -> list[list[ExtendRequest]]:
    """`requests` in order, cut into runs of at most `limit` new tokens and `max(BATCH_BUCKETS)` requests (a
    request longer than `limit` makes a run of its own)."""
    parts: list[list[ExtendRequest]] = [[]]
    held = 0
    for request in requests:
        n = len(request[0])
        if parts[-1] and (held + n > limit or len(parts[-1]) == max(BATCH_BUCKETS)):
            parts.append([])
            held = 0
        parts[-1].append(request)
        held += n
    return parts


class ExtendInputs:
    """A captured extend's static inputs: `extend_layout`'s flat tensor for `rows` rows (+ the padding row) and
    `tokens` tokens, filled by one asynchronous host-to-device copy per replay (`copy_into`)."""

    def __init__(self, rows: int, tokens: int, scratch: int, device: torch.device) -> None:
        self.rows, self.tokens, self._scratch = rows, tokens, scratch
        self._device = torch.zeros(layout_width(rows, tokens), dtype=torch.long, device=device)
        self.fill([([0], 0, scratch, 0)])

    def static_rows(self) -> ExtendRows:
        """The rows over the static inputs (built inside a capture: no host spans)."""
        return ExtendRows.from_flat(self._device, self.rows + 1, self.tokens)

    def fill(self, requests: Sequence[ExtendRequest]) -> None:
        self.load(extend_layout(requests, self.rows, self.tokens, self._scratch)[0])

    def load(self, flat: Sequence[int]) -> None:
        """Queue `flat` (an `extend_layout` of this size) into the static inputs."""
        copy_into(self._device, torch.tensor(flat, dtype=torch.long))


class ExtendGraph:
    """One captured batched prefill of up to `rows` requests and `tokens` new tokens."""

    def __init__(self, decoder: BatchDecoder, rows: int, tokens: int, scratch: int, pool: Any) -> None:
        spec = decoder.forward.spec
        self.rows, self.tokens = rows, tokens
        self._inputs = ExtendInputs(rows, tokens, scratch, spec.device)
        static = self._inputs.static_rows()
        bounds = (tokens, spec.max_context)
        self._graph = torch.cuda.CUDAGraph()
        start = time.perf_counter()
        self._logits: torch.Tensor = _capture(self._graph, lambda: decoder.extend(static, bounds), spec.device, pool)
        self.capture_ms = (time.perf_counter() - start) * 1e3

    def replay(self, requests: Sequence[ExtendRequest]) -> torch.Tensor:
        """fp32 logits [len(requests), vocab] of each request's last token; static (read before the next replay)."""
        self._inputs.fill(requests)
        self._graph.replay()
        return self._logits[: len(requests)]


class ExtendGraphs:
    """Batched-prefill graphs by (row bucket, token bucket), captured on first use or by `warm`."""

    @staticmethod
    def fit(pool_slots: int) -> bool:
        """Whether a pool of `pool_slots` can spare a padding slab for the smallest bucket."""
        return bool(buckets_for(pool_slots))

    def __init__(self, decoder: BatchDecoder) -> None:
        spec = decoder.forward.spec
        if spec.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        if decoder.extend_backend != FLASH_VARLEN:
            raise ValueError("only the flash varlen batched prefill can be captured")
        self.decoder = decoder
        self.buckets = buckets_for(decoder.pool.slots)
        if not self.buckets:
            raise ValueError(f"a pool of {decoder.pool.slots} slots is too small for batched-prefill graphs")
        # The padding row's slab, held as long as the graphs live: room for a whole bucket of padding.
        self._scratch = decoder.pool.allocate(max(self.buckets))
        self._pool = torch.cuda.graph_pool_handle()
        self._graphs: dict[tuple[int, int], ExtendGraph] = {}

    @property
    def scratch_slots(self) -> int:
        return self._scratch.size

    def extend(self, requests: Sequence[ExtendRequest]) -> torch.Tensor:
        """Every request's new tokens after its live slots, in as few replays as the largest bucket allows (a
        request longer than it alone runs eagerly); logits [len(requests), vocab]."""
        parts = split_by_tokens(requests, max(self.buckets))
        if len(parts) == 1:
            return self._extend_part(parts[0])
        # Each part copied: the next part's replay may reuse this graph's output memory (the graphs share a pool).
        return torch.cat([self._extend_part(part).clone() for part in parts])

    def _extend_part(self, requests: Sequence[ExtendRequest]) -> torch.Tensor:
        rows = batch_bucket(len(requests))
        tokens = token_bucket(sum(len(ids) for ids, *_ in requests), self.buckets)
        if rows is None or tokens is None:
            return self.decoder.extend(ExtendRows.build(requests, self.decoder.forward.spec.device))
        return self._graph(rows, tokens).replay(requests)

    def _graph(self, rows: int, tokens: int) -> ExtendGraph:
        graph = self._graphs.get((rows, tokens))
        if graph is None:
            graph = ExtendGraph(self.decoder, rows, tokens, self._scratch.start, self._pool)
            self._graphs[(rows, tokens)] = graph
            log.info("captured the %d-row, %d-token batched prefill in %.0f ms", rows, tokens, graph.capture_ms)
        return graph

    def warm(self) -> None:
        """Capture every bucket now (server start), so no capture happens while answers are served: the
        questions admitted together take the larger row buckets, a step's naive chunks the smaller ones."""
        for rows in BATCH_BUCKETS:
            for tokens in self.buckets:
                if tokens >= rows:
                    self._graph(rows, tokens)

    def close(self) -> None:
        """Give the scratch slab back to the pool (the graphs must not replay afterwards)."""
        self._graphs.clear()
        self.decoder.pool.free(self._scratch)
