"""The decode step with questions piggybacked on it (`BatchDecoder.mixed`) captured in CUDA graphs.

A question admitted while answers run costs a pass over the weights of its own when it is prefilled apart (most
of a short question's prefill), then the next decode step reads them again. Piggybacked, its tokens ride in the
running answers' step: one pass over the weights for both, and the step grows by the question's attention and a
few more matmul rows.

A graph fixes shapes, so each is captured for `batch` decode rows (a `STEP_BUCKETS` bucket, padded as
`BatchGraph` pads: token 0 at position 0 into a scratch slot), `rows` questions (`MIXED_ROWS`) of `tokens` new
tokens in all (`MIXED_TOKENS`, padded as `ExtendGraph` pads: empty rows and one padding row in a scratch slab)
and the decode rows' capacity bucket (flash's max_seqlen_k, as the decode step's graphs). Its static inputs are
the decode step's five rows (ids, positions, slab starts, live lengths, feed index) then `extend_layout`'s flat
inputs, in one device tensor filled by one pinned copy per replay; decode rows whose last token is still unread
on the device (the overlapped step) take it from a static `feed` tensor, as the decode step's graphs do. Every
graph writes its logits into one static output, so 50-odd graphs hold one copy of them.

Capture needs flash varlen for both parts (the loop attention slices by host lengths). The GPU test compares
each replay with the eager mixed step; the CPU tests run the eager step through the loop attention.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from service.engine.attention import FLASH_VARLEN
from service.engine.batch_decode import BatchDecoder, DecodeRows, ExtendRows, StepFeed, fed_ids
from service.engine.batch_graph import STEP_BUCKETS, batch_bucket
from service.engine.cuda_graph import _capture, bucket_capacity
from service.engine.device_copy import copy_into
from service.engine.extend_graph import SCRATCH_SHARE, ExtendRequest, extend_layout, layout_width, token_bucket

log = logging.getLogger(__name__)

# Questions one mixed step takes, and their new tokens in all (the gateway's questions are ~50-250 tokens with
# the prompt's tail). More, or longer, are prefilled apart (the batched prefill's own graphs).
MIXED_ROWS = (1, 2, 4)
MIXED_TOKENS = (64, 128, 256)

# The decode rows' (ids, positions, spans, feed index or -1 per row), as `BatchGraph.replay` takes them.
DecodeInputs = tuple[Sequence[int], Sequence[int], Sequence[tuple[int, int]], Sequence[int] | None]


class MixedGraph:
    """One captured mixed step: `batch` decode rows up to `capacity` live slots, `rows` questions of `tokens`."""

    def __init__(
        self,
        decoder: BatchDecoder,
        shape: tuple[int, int, int, int],
        scratch: int,
        pool: Any,
        static: tuple[torch.Tensor, torch.Tensor],
    ) -> None:
        """`shape`: (batch, rows, tokens, capacity); `scratch`: the first of the graphs' scratch slots (the
        question padding's, then one for the decode padding); `static`: the feed and the logits output."""
        spec = decoder.forward.spec
        self.batch, self.rows, self.tokens, self.capacity = shape
        self._scratch = scratch
        width = 5 * self.batch + layout_width(self.rows, self.tokens)
        self._inputs = torch.zeros(width, dtype=torch.long, device=spec.device)
        self._fill(([], [], [], None), [([0], 0, scratch, 0)])
        feed, out = static
        self._out = out
        bounds = (self.tokens, spec.max_context)

        def step() -> None:
            head = self._inputs[: 5 * self.batch].view(5, self.batch)
            decode = DecodeRows(fed_ids(head[0], head[4], feed), head[1], head[2], head[3], ())
            extend = ExtendRows.from_flat(self._inputs[5 * self.batch :], self.rows + 1, self.tokens)
            logits = decoder.mixed(decode, extend, self.capacity, bounds)
            out[: logits.shape[0]].copy_(logits)

        self._graph = torch.cuda.CUDAGraph()
        start = time.perf_counter()
        _capture(self._graph, step, spec.device, pool)
        self.capture_ms = (time.perf_counter() - start) * 1e3

    def _fill(self, decode: DecodeInputs, questions: Sequence[ExtendRequest]) -> None:
        ids, positions, spans, src = decode
        pad = self.batch - len(ids)
        fed = list(src) if src is not None else [-1] * len(ids)
        rows = [list(ids), list(positions), [s for s, _ in spans], [u for _, u in spans], fed]
        # A padding row feeds token 0 at position 0 into the slot after the question padding's slab.
        padding = [0, 0, self._scratch + self.tokens, 1, -1]
        head = [value for row, p in zip(rows, padding, strict=True) for value in row + [p] * pad]
        flat, _ = extend_layout(questions, self.rows, self.tokens, self._scratch)
        copy_into(self._inputs, torch.tensor(head + flat, dtype=torch.long))

    def replay(self, decode: DecodeInputs, questions: Sequence[ExtendRequest]) -> torch.Tensor:
        """fp32 logits [len(ids) + len(questions), vocab]: the decode rows', then each question's last token's;
        static (read before the next replay of any mixed graph)."""
        ids, _, spans, _ = decode
        if not 0 < len(ids) <= self.batch or any(u > self.capacity for _, u in spans):
            raise ValueError(f"{len(ids)} rows do not fit a graph of {self.batch} rows up to {self.capacity} slots")
        self._fill(decode, questions)
        self._graph.replay()
        rows, asked = len(ids), len(questions)
        if rows == self.batch:
            return self._out[: rows + asked]
        return torch.cat((self._out[:rows], self._out[self.batch : self.batch + asked]))


class MixedGraphs:
    """Mixed-step graphs by (batch bucket, question rows, token bucket, capacity), captured on first use or by
    `warm`, over one decoder's pool."""

    def __init__(self, decoder: BatchDecoder, max_picks: int = max(STEP_BUCKETS)) -> None:
        """`max_picks`: the most unread picks a step may be fed from (the size of `feed`)."""
        spec = decoder.forward.spec
        if spec.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        if decoder.attention != FLASH_VARLEN or decoder.extend_backend != FLASH_VARLEN:
            raise ValueError("only a mixed step whose both attentions are flash varlen can be captured")
        self.decoder = decoder
        self.tokens = tuple(b for b in MIXED_TOKENS if b + 1 <= decoder.pool.slots * SCRATCH_SHARE)
        if not self.tokens:
            raise ValueError(f"a pool of {decoder.pool.slots} slots is too small for mixed-step graphs")
        # The question padding's slab, then the decode padding's slot; held as long as the graphs live.
        self._scratch = decoder.pool.allocate(max(self.tokens) + 1)
        self._pool = torch.cuda.graph_pool_handle()
        self._graphs: dict[tuple[int, int, int, int], MixedGraph] = {}
        self._feed = torch.zeros(max(max_picks, *STEP_BUCKETS), dtype=torch.long, device=spec.device)
        rows = max(STEP_BUCKETS) + max(MIXED_ROWS) + 1
        self._out = torch.zeros((rows, spec.vocab_size), dtype=torch.float32, device=spec.device)

    def fits(self, batch: int, question_tokens: Sequence[int]) -> bool:
        """Whether a step of `batch` decode rows and questions of these token counts has a graph shape."""
        rows, total = len(question_tokens), sum(question_tokens)
        return (
            0 < batch <= max(STEP_BUCKETS)
            and 0 < rows <= max(MIXED_ROWS)
            and all(n > 0 for n in question_tokens)
            and token_bucket(total, self.tokens) is not None
        )

    def step(self, decode: DecodeInputs, feed: StepFeed | None, questions: Sequence[ExtendRequest]) -> torch.Tensor:
        """The mixed step through its graph (`fits` must hold); logits as `MixedGraph.replay` returns them."""
        ids, _, spans, _ = decode
        tokens = [len(q[0]) for q in questions]
        if not self.fits(len(ids), tokens):
            raise ValueError(f"no mixed-step graph for {len(ids)} rows and questions of {tokens} tokens")
        batch, rows = batch_bucket(len(ids), STEP_BUCKETS), batch_bucket(len(questions), MIXED_ROWS)
        total = token_bucket(sum(tokens), self.tokens)
        assert batch is not None and rows is not None and total is not None
        capacity = bucket_capacity(max(u for _, u in spans), self.decoder.forward.spec.max_context)
        graph = self._graph((batch, rows, total, capacity))
        if feed is not None:
            picks = feed.picks.numel()
            if picks > self._feed.numel():
                raise ValueError(f"{picks} picks do not fit the feed of {self._feed.numel()}")
            with torch.inference_mode():
                # Queued after the previous replay (which read the feed before) and before this one: stream order.
                self._feed[:picks].copy_(feed.picks)
            decode = (decode[0], decode[1], decode[2], feed.src)
        return graph.replay(decode, questions)

    def _graph(self, shape: tuple[int, int, int, int]) -> MixedGraph:
        graph = self._graphs.get(shape)
        if graph is None:
            static = (self._feed, self._out)
            graph = MixedGraph(self.decoder, shape, self._scratch.start, self._pool, static)
            self._graphs[shape] = graph
            log.info("captured the mixed step %s (batch, questions, tokens, slots) in %.0f ms", shape, graph.capture_ms)
        return graph

    def warm(self, tokens: int) -> None:
        """Capture every shape for decode rows of live lengths up to `tokens` now (server start)."""
        capacity = bucket_capacity(tokens, self.decoder.forward.spec.max_context)
        for batch in STEP_BUCKETS:
            for rows in MIXED_ROWS:
                for total in self.tokens:
                    if total >= rows:
                        self._graph((batch, rows, total, capacity))

    def close(self) -> None:
        """Give the scratch slots back to the pool (the graphs must not replay afterwards)."""
        self._graphs.clear()
        self.decoder.pool.free(self._scratch)
