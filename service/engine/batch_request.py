"""One request through the continuous-batching scheduler: its inputs, its state while running, its result."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import StrEnum

import torch

from service.engine.chunk_source import ChunkFetch
from service.engine.detokenize import IncrementalDetokenizer
from service.engine.engine import GenerationMode, GenerationResult
from service.engine.kv_buffer import KVBuffer
from service.engine.kv_layout import KVBlock
from service.engine.kv_pool import Slab
from service.engine.prompt import PromptIds
from service.engine.recompute_spec import NO_RECOMPUTE, RecomputeSpec
from service.engine.sampling import Sampler, SamplingParams
from service.engine.segment_attention import ChunkRange
from service.engine.shared_decode import Reads
from service.engine.stitch import BlockReady, PositionMode

TextSink = Callable[[str], None]


class RequestStatus(StrEnum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class BatchRequest:
    """One request through the scheduler: its inputs, its slab and decoding state while running, its result.

    `on_text(delta)` is called with each text delta and `on_finish(request)` once at the end, both on the
    scheduler's thread. A turbo request without `chunk_kv` gets it at admission from the scheduler's KV source
    (`fetch` then keeps what the source reported: tiers, bytes, timings, for `on_finish` to read). Once `on_finish`
    returned, the request lets go of both callbacks and of its chunk KV (`let_go`): whoever still holds a finished
    request (a listener it references back, an error's traceback) holds no device memory through it.
    `result.finish_reason` ends as "length", "stop", "cancelled" or "error" (`error` then holds the exception); a
    `shadow` request (low priority: admitted only while no other request waits) may also end "preempted", to make
    room for one that does. `keep_first_logits`: the first token's logits are kept in `first_logits` (fp32, on the
    host).
    """

    def __init__(
        self,
        prompt: PromptIds,
        sampling: SamplingParams,
        mode: GenerationMode | str = GenerationMode.TURBO,
        positions: PositionMode | str = PositionMode.REORDERED,
        chunk_kv: Sequence[KVBlock] | None = None,
        chunk_ready: Sequence[BlockReady | None] | None = None,
        on_text: TextSink | None = None,
        on_finish: Callable[[BatchRequest], None] | None = None,
        recompute: RecomputeSpec = NO_RECOMPUTE,
        shadow: bool = False,
        keep_first_logits: bool = False,
    ) -> None:
        self.prompt = prompt
        self.sampling = sampling
        self.mode = GenerationMode(mode)
        self.positions = PositionMode(positions)
        self.chunk_kv = chunk_kv
        self.chunk_ready = chunk_ready
        self.recompute = recompute  # turbo only: part of the stitched context recomputed before the question
        self.on_text = on_text
        self.on_finish = on_finish
        self.shadow = shadow  # yields to every other request: admitted after them, preempted for them
        self.keep_first_logits = keep_first_logits
        self.first_logits: torch.Tensor | None = None  # [vocab] fp32 on the host, once picked (when kept)
        self.fetch: ChunkFetch | None = None  # what the KV source handed at admission
        self.status = RequestStatus.WAITING
        self.cancelled = False
        self.error: BaseException | None = None
        self.result = GenerationResult(prompt_tokens=prompt.total_tokens, context_tokens=prompt.context_tokens)
        self.queue_ms = 0.0  # from `add` to admission; part of `result.timings.ttft_ms`
        # State the scheduler keeps while the request runs.
        self.slab: Slab | None = None
        self.kv: KVBuffer | None = None  # over the slab
        # Shared-chunk mode (`shared_chunks.py`): set at `add` for a request that reads its chunks from the arena.
        self.tail_tokens: int | None = None  # its slab's size: prefix, question, answer budget
        self.arena_ranges: tuple[ChunkRange, ...] = ()  # the chunks it pins while it runs
        # Its chunks (by index) the arena held at admission: read there without a fetch (`fetch` holds the others').
        self.resident_chunks: tuple[int, ...] = ()
        self.reads: Reads = Reads()  # each chunk's range and offset (empty: its slab holds its context)
        self.sampler: Sampler | None = None
        self.detok: IncrementalDetokenizer | None = None
        self.last_token = -1  # the token the next decode step feeds
        self.added_at = 0.0
        self.handed_at = 0.0  # perf_counter when handed to the engine loop (`EngineLoop.add_answer`); 0: never
        self.first_token_at = 0.0

    def drop_chunk_kv(self) -> None:
        """Let go of the chunk KV fetched at admission: the blocks, their arrivals and the fetch that holds them.
        Blocks the KV source's device tier does not keep (host and disk hits beyond its budget) are then freed."""
        self.chunk_kv, self.chunk_ready, self.fetch = None, None, None

    def let_go(self) -> None:
        """After the end was reported: nothing reads the chunk KV or calls the callbacks again. The callbacks are
        usually bound to a listener that holds the request, a cycle only a full garbage collection would break
        (which long-lived servers run rarely): while it waits, so would the chunk KV, on the device."""
        self.drop_chunk_kv()
        self.on_text, self.on_finish = None, None

    @property
    def tokens_needed(self) -> int:
        """Slots the request's slab holds: the joined prompt and the answer budget."""
        return self.result.prompt_tokens + self.sampling.max_new_tokens

    @property
    def slab_tokens(self) -> int:
        """Slots its slab takes: its tail where it reads shared chunks, else `tokens_needed`."""
        return self.tokens_needed if self.tail_tokens is None else self.tail_tokens

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def buffer(self) -> KVBuffer:
        assert self.kv is not None, "the request is not running"
        return self.kv

    @property
    def running_sampler(self) -> Sampler:
        assert self.sampler is not None, "the request is not running"
        return self.sampler
