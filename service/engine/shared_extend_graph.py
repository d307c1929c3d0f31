"""The shared-chunk question prefill (`SharedDecoder.extend`) captured in CUDA graphs, one per (row bucket, token
bucket, reads bucket).

Eager, the questions admitted together cost the host the same ~1,500 kernel launches as a decode step plus a
Triton launch per tile width and layer, all on the first token's critical path. A graph replays them in one
call. It fixes shapes, so it joins the two fixed-shape forms the project already has:

- the copy path's batched prefill (`extend_graph.py`): `rows` requests of `tokens` new tokens in all, the real
  requests first, the tokens up to the bucket taken by one padding request at positions 0.. in a scratch slab the
  graphs own (`extend_layout`, `ExtendInputs`), so padding writes and reads only that slab;
- the shared decode step (`shared_graph.py`): the call's segment plan padded to a `PlanCapacity` and copied into the
  captured plan (`CapturedPlan`). Here the padding request is one more request of the call, reading no chunk and
  attending causally to its own scratch keys (`padded_extend`), so the plan of a padded call is an ordinary plan.

The question prefill plans its attention by request (`shared_decode.PREFILL_BY_REQUEST`, read at capture): a
bucket's plan splits each request's chunk list `extend_splits` ways and `request_capacity` sizes it. With the flag
off the plan goes by chunk, and `extend_capacity` holds every call of the bucket: each token of a row reads its
row's chunks (at most `reads`, each cut into `pieces`), so `tokens x reads` query entries on chunks and one per
token for its tail. Tiles are bounded tighter than by pairs (a prefill's many tokens read each chunk in one group,
`block_m`-wide tiles).

Memory (bounded): buckets are `BATCH_BUCKETS` rows x `SHARED_TOKEN_BUCKETS` tokens x reads 4 .. `MAX_READS`, with
`tokens x reads` at most `MAX_ENTRIES`. Every graph leaves its logits in one buffer ([32, vocab] fp32: 19 MiB at
Qwen2's 152K vocabulary) and keeps only its plan (int64, under 1 MB) and static inputs. The captures' activations
share one pool, so they cost the largest captured bucket's once: at 16,384 query entries (512 tokens x 32 reads,
or 1,024 x 16) for Qwen2-7B, about 120 MB of partial outputs (pairs x heads x head_dim, bf16), 17 MB of rotation
tables and, at 1,024 tokens, ~120 MB of MLP activations; at the gateway benchmark's 128 x 16, an eighth of that.
The scratch slab holds the largest token bucket the pool spares (`SCRATCH_SHARE` of it at most): 1,024 slots,
56 MiB of a Qwen2-7B pool. Graphs are captured on first use (or by `warm`); a group outside every bucket runs
eagerly.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from service.engine import shared_decode
from service.engine.batch_decode import ExtendRows
from service.engine.batch_graph import BATCH_BUCKETS, batch_bucket
from service.engine.cuda_graph import _capture
from service.engine.extend_graph import (
    ExtendInputs,
    ExtendRequest,
    buckets_for,
    extend_layout,
    split_by_tokens,
    token_bucket,
)
from service.engine.segment_attention import SegmentArrays
from service.engine.segment_plan import _MIN_BLOCK_M, MAX_BLOCK_M, REQUEST_BLOCK_M, PlanCapacity, auto_splits
from service.engine.shared_decode import Reads, SharedDecoder, extend_batch
from service.engine.shared_graph import CapturedPlan, reads_bucket

log = logging.getLogger(__name__)

# Question tokens (all the group's, summed) a graph is captured for. The gateway benchmark's questions are ~90
# tokens with the template's: one fills 128, a group of eight 1,024. A group with more is prefilled in several
# replays, each request whole. Past 128 the steps are 128 tokens, not doublings: a replay computes its whole
# bucket, and under load groups of a few questions each arrive at every step, so power-of-two buckets spent up to
# half of each prefill's projections and MLPs on padding.
SHARED_TOKEN_BUCKETS = (16, 32, 64, 128, 256, 384, 512, 640, 768, 896, 1024)
# Reads per row a graph is captured for at most, and query entries (tokens x reads) at most: past them the padded
# plan's rotation tables and partial buffers grow past what one prefill is worth; such groups run eagerly.
MAX_READS = 32
MAX_ENTRIES = 512 * 32


@functools.cache
def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream every question-prefill graph of `device` is captured on, one a device. Early prefills replay
    these graphs on the side stream while a decode graph runs on the main one; captured on torch's one capture
    stream like the decode graphs, both would hold the same cuBLAS workspace (`_capture`). High priority: torch
    hands those out from another pool than the default priority's, so it is never torch's capture stream."""
    return torch.cuda.Stream(device, priority=-1)  # type: ignore[no-untyped-call]


def extend_pieces(tokens: int) -> int:
    """Pieces each chunk is cut into in a bucket of `tokens` question tokens: a few tokens leave most of the GPU
    idle unless chunks are cut (the eager plan chooses per call; a graph's plan cannot change shape)."""
    return 2 if tokens <= 16 else 1


def extend_splits(tokens: int, reads: int, group: int, kv_heads: int) -> int:
    """Splits of each request's chunk list in a by-request bucket of `tokens` question tokens: as the eager plan
    would split a group of that many tokens in one request (the fewest programs a bucket's group has)."""
    return auto_splits(kv_heads * -(-tokens * group // REQUEST_BLOCK_M), max(reads, 1))


def request_capacity(rows: int, tokens: int, reads: int, splits: int, group: int) -> PlanCapacity:
    """A by-request bucket's plan sizes: `rows` requests of `tokens` tokens in all, each reading at most `reads`
    chunks in `splits` splits. A request's rows take ceil(rows x group / REQUEST_BLOCK_M) tiles per split, so the
    requests at most rows + tokens x group / REQUEST_BLOCK_M; tails as `extend_capacity`'s."""
    return PlanCapacity(
        rows=tokens,
        entries=tokens * reads + tokens,
        pairs=tokens * splits + tokens,
        chunk_tiles=(rows + -(-tokens * group // REQUEST_BLOCK_M)) * splits,
        tail_tiles=_tail_tiles(rows, tokens, group),
        segments=max(rows * reads, 1),
    )


def extend_capacity(rows: int, tokens: int, reads: int, pieces: int, group: int) -> PlanCapacity:
    """The plan sizes of a bucket: `rows` requests (+ the padding one) of `tokens` tokens in all, each real one
    reading at most `reads` chunks cut into `pieces`, `group` query heads per KV head.

    Tiles, per width: a group of pairs (a chunk piece's readers, a request's tail) of at most `_MIN_BLOCK_M` ..
    `MAX_BLOCK_M` items takes one tile of its width; a larger one takes ceil(items / MAX_BLOCK_M) of the widest.
    So each width holds at most (groups + items / MAX_BLOCK_M) tiles: chunk pieces read <= rows x reads x pieces,
    their items <= tokens x reads x pieces x group; tails: rows + 1 groups of tokens x group items."""
    reading = tokens * reads
    chunk_pairs = reading * pieces
    chunk_tiles = rows * reads * pieces + -(-chunk_pairs * group // MAX_BLOCK_M)
    if group <= _MIN_BLOCK_M:  # then a group never takes more tiles than it has pairs
        chunk_tiles = min(chunk_tiles, chunk_pairs)
    return PlanCapacity(
        rows=tokens,
        entries=reading + tokens,
        pairs=chunk_pairs + tokens,
        chunk_tiles=chunk_tiles,
        tail_tiles=_tail_tiles(rows, tokens, group),
    )


def _tail_tiles(rows: int, tokens: int, group: int) -> int:
    """Tail tiles per width of a bucket (both plans' tails go by request): rows + 1 groups of tokens x group
    items (`extend_capacity`'s rule)."""
    if group > MAX_BLOCK_M:
        raise ValueError(f"{group} query heads per KV head exceed a tile of {MAX_BLOCK_M}")
    tail_tiles = rows + 1 + -(-tokens * group // MAX_BLOCK_M)
    return min(tail_tiles, tokens) if group <= _MIN_BLOCK_M else tail_tiles


def padded_extend(
    requests: Sequence[ExtendRequest], reads: Sequence[Reads], rows: int, tokens: int, scratch: int
) -> tuple[list[int], SegmentArrays]:
    """A graph's host inputs for `requests` (each reading its `reads`) padded to `rows` rows and `tokens` tokens:
    `extend_layout`'s flat static inputs, and the segment call of the same rows in the same order, the tokens up
    to `tokens` as one more request at positions 0.. in the scratch slab from `scratch`, reading no chunk."""
    if len(reads) != len(requests):
        raise ValueError(f"{len(reads)} reads for {len(requests)} requests")
    flat, _ = extend_layout(requests, rows, tokens, scratch)  # ValueError when they do not fit
    pad = tokens - sum(len(ids) for ids, *_ in requests)
    padding: list[ExtendRequest] = [([0] * pad, 0, scratch, 0)] if pad else []
    return flat, extend_batch([*requests, *padding], [*reads, *([Reads()] * len(padding))])


def split_group(
    requests: Sequence[ExtendRequest], reads: Sequence[Reads], limit: int
) -> list[tuple[list[ExtendRequest], list[Reads]]]:
    """`requests` and their reads in order, cut as `split_by_tokens` cuts them (at most `limit` tokens and the
    largest row bucket a part; a longer request alone)."""
    parts, first = [], 0
    for part in split_by_tokens(requests, limit):
        parts.append((part, list(reads[first : first + len(part)])))
        first += len(part)
    return parts


def split_for(
    requests: Sequence[ExtendRequest], reads: Sequence[Reads], buckets: Sequence[int]
) -> list[tuple[list[ExtendRequest], list[Reads]]]:
    """`split_group` at the largest token bucket whose graphs hold the group's reads (`MAX_ENTRIES`): a group
    reading many chunks is cut into smaller parts rather than run eagerly (none fits: one part, eager)."""
    reads_at_most = reads_bucket(max(map(len, reads), default=0))
    fitting = [b for b in buckets if b * reads_at_most <= MAX_ENTRIES]
    return split_group(requests, reads, max(fitting, default=max(buckets)))


def idle_extend(rows: int, tokens: int, scratch: int) -> SegmentArrays:
    """The call a graph is captured over: one token in the scratch slab, reading no chunk, and the padding."""
    return padded_extend([([0], 0, scratch, 0)], [Reads()], rows, tokens, scratch)[1]


class SharedExtendGraph:
    """One captured shared question prefill of up to `rows` requests, `tokens` question tokens and `reads` chunks
    a request."""

    def __init__(
        self, shared: SharedDecoder, rows: int, tokens: int, reads: int, scratch: int, pool: Any, out: torch.Tensor
    ) -> None:
        """`out`: [>= rows, vocab] fp32, where the replays leave their logits (one buffer for every graph)."""
        forward = shared.decoder.forward
        spec = forward.spec
        self.rows, self.tokens, self.reads, self._scratch = rows, tokens, reads, scratch
        group, by_request = spec.num_heads // spec.num_kv_heads, shared_decode.PREFILL_BY_REQUEST
        if by_request:
            pieces = extend_splits(tokens, reads, group, spec.num_kv_heads)
            capacity = request_capacity(rows, tokens, reads, pieces, group)
        else:
            pieces = extend_pieces(tokens)
            capacity = extend_capacity(rows, tokens, reads, pieces, group)
        self._inputs = ExtendInputs(rows, tokens, scratch, spec.device)
        self._plan = CapturedPlan(shared, capacity, pieces, idle_extend(rows, tokens, scratch), by_request)
        pool_data = shared.decoder.pool.data

        def extend() -> torch.Tensor:
            static = self._inputs.static_rows()
            hidden = forward.embed_static(static.ids.view(1, -1))
            layers = (0, len(forward.layers))
            hidden = forward.layers_static(
                pool_data, hidden, static.positions, static.slots, self._plan.attend(), layers
            )
            logits = out[:rows]
            logits.copy_(forward.head_rows(hidden.index_select(0, static.last[:rows])))
            return logits

        self._graph = torch.cuda.CUDAGraph()
        start = time.perf_counter()
        self._logits: torch.Tensor = _capture(self._graph, extend, spec.device, pool, capture_stream(spec.device))
        self.capture_ms = (time.perf_counter() - start) * 1e3

    def replay(self, requests: Sequence[ExtendRequest], reads: Sequence[Reads]) -> torch.Tensor:
        """fp32 logits [len(requests), vocab] of each request's last question token; static (read before the next
        replay). ValueError when the group does not fit the graph (nothing replayed)."""
        if max(map(len, reads), default=0) > self.reads:
            raise ValueError(f"a request reads more than the graph's {self.reads} chunks")
        flat, call = padded_extend(requests, reads, self.rows, self.tokens, self._scratch)
        plan = self._plan.build(call)
        self._inputs.load(flat)
        self._plan.load(plan)
        self._graph.replay()
        return self._logits[: len(requests)]


class SharedExtendGraphs:
    """Shared question-prefill graphs by (row bucket, token bucket, reads bucket), captured on first use."""

    @staticmethod
    def fit(pool_slots: int, group: int) -> bool:
        """Whether a pool of `pool_slots` can spare a padding slab for the smallest bucket, and a model of `group`
        query heads per KV head has plans `extend_capacity` can size."""
        return bool(buckets_for(pool_slots, SHARED_TOKEN_BUCKETS)) and group <= MAX_BLOCK_M

    def __init__(self, shared: SharedDecoder) -> None:
        pool = shared.decoder.pool
        if pool.spec.device.type != "cuda" or not shared.kernels:
            raise ValueError("shared-prefill graphs need the segment kernels on a CUDA device")
        self.shared = shared
        self.buckets = buckets_for(pool.slots, SHARED_TOKEN_BUCKETS)
        if not self.buckets:
            raise ValueError(f"a pool of {pool.slots} slots is too small for shared-prefill graphs")
        # The padding request's slab, held as long as the graphs live: room for a whole bucket of padding.
        self._scratch = pool.allocate(max(self.buckets))
        self._pool = torch.cuda.graph_pool_handle()
        self._graphs: dict[tuple[int, int, int], SharedExtendGraph] = {}
        # Every graph's logits land here: a graph's own output would stay allocated as long as it lives.
        spec = shared.decoder.forward.spec
        self._out = torch.empty((max(BATCH_BUCKETS), spec.vocab_size), dtype=torch.float32, device=spec.device)
        self.replays = 0  # groups (or parts of one) that ran through a graph, for tests and benchmarks

    def extend(self, requests: Sequence[ExtendRequest], reads: Sequence[Reads]) -> torch.Tensor:
        """Every request's question after its live slots, reading its `reads`, in as few replays as the largest
        bucket allows (a part outside every bucket runs eagerly); fp32 logits [len(requests), vocab]."""
        parts = split_for(requests, reads, self.buckets)
        if len(parts) == 1:
            return self._extend_part(*parts[0])
        # Each part copied: every graph leaves its logits in one buffer.
        return torch.cat([self._extend_part(*part).clone() for part in parts])

    def _extend_part(self, requests: Sequence[ExtendRequest], reads: Sequence[Reads]) -> torch.Tensor:
        graph = self._graph_for(requests, reads)
        if graph is not None:
            try:
                logits = graph.replay(requests, reads)
            except ValueError:  # a plan over the bucket's capacity: eager, this once
                pass
            else:
                self.replays += 1
                return logits
        rows = ExtendRows.build(requests, self.shared.decoder.forward.spec.device)
        return self.shared.extend(rows, extend_batch(requests, reads))

    def _graph_for(self, requests: Sequence[ExtendRequest], reads: Sequence[Reads]) -> SharedExtendGraph | None:
        bucket = graph_bucket(len(requests), sum(len(ids) for ids, *_ in requests), max(map(len, reads)), self.buckets)
        return None if bucket is None else self._graph(*bucket)

    def _graph(self, rows: int, tokens: int, reads: int) -> SharedExtendGraph:
        graph = self._graphs.get((rows, tokens, reads))
        if graph is None:
            graph = SharedExtendGraph(self.shared, rows, tokens, reads, self._scratch.start, self._pool, self._out)
            self._graphs[(rows, tokens, reads)] = graph
            log.info(
                "captured the shared question prefill: %d rows, %d tokens, %d reads, in %.0f ms",
                rows,
                tokens,
                reads,
                graph.capture_ms,
            )
        return graph

    def warm(self, reads: int, max_rows: int, max_tokens: int, min_question: int = 1) -> None:
        """Capture every bucket of up to `max_rows` rows and `max_tokens` question tokens (its bucket) for `reads`
        chunks a request now (server start), so the first questions do not pay for the capture; `min_question`:
        tokens a question has at least, so no bucket is captured that no group of that many rows can take."""
        top = token_bucket(max_tokens, self.buckets) or max(self.buckets)
        for rows in BATCH_BUCKETS:
            for tokens in self.buckets:
                bucket = graph_bucket(rows, tokens, reads, self.buckets)
                if rows <= max_rows and rows * min_question <= tokens <= top and bucket is not None:
                    self._graph(*bucket)

    def close(self) -> None:
        """Give the scratch slab back to the pool (the graphs must not replay afterwards)."""
        self._graphs.clear()
        self.shared.decoder.pool.free(self._scratch)


def graph_bucket(rows: int, tokens: int, reads: int, buckets: Sequence[int]) -> tuple[int, int, int] | None:
    """The (rows, tokens, reads) bucket of a group of `rows` requests, `tokens` question tokens and `reads` chunks
    at most a request, or None when it runs eagerly (outside the buckets, or past `MAX_READS` / `MAX_ENTRIES`)."""
    row_bucket = batch_bucket(rows)
    tokens_bucket = token_bucket(tokens, buckets)
    reads_at_most = reads_bucket(reads)
    if row_bucket is None or tokens_bucket is None or reads_at_most > MAX_READS:
        return None
    if tokens_bucket * reads_at_most > MAX_ENTRIES:
        return None
    return row_bucket, tokens_bucket, reads_at_most
