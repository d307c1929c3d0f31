"""The stitching engine: precompute blocks, stitch them, prefill only the question, decode.

`StitchEngine` is the interface the KV cache, the worker and the gateway use; it knows nothing of HTTP,
files or queues. Tensors handed to it may live on the CPU or on the model's device.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch

from service.engine.conversation import ConversationTemplate
from service.engine.cuda_graph import (
    DecodeGraph,
    DecodeGraphs,
    LayerGroups,
    graph_tokens,
    graphs_enabled,
    layer_groups,
)
from service.engine.detokenize import IncrementalDetokenizer
from service.engine.forward import LeanForward
from service.engine.fused_stitch import FusedStitch, fused_stitch_enabled
from service.engine.kv_buffer import KVBuffer
from service.engine.kv_layout import KVBlock, check_block
from service.engine.model import LoadedModel
from service.engine.prompt import PromptIds, PromptTemplate, build_template, encode
from service.engine.recompute import recompute_context
from service.engine.recompute_spec import NO_RECOMPUTE, RecomputeSpec, parse_recompute
from service.engine.sampling import Sampler, SamplingParams, TokenLogprobs
from service.engine.stitch import (
    BlockReady,
    LayeredReady,
    PositionMode,
    StitchPlan,
    plan_positions,
    stitch_into,
    stitch_layers,
)

# Layer groups of the pipelined host-tier prefill: 4 x 7 layers for a 28-layer model (docs/benchmarks.md §8.2).
DEFAULT_PIPELINE_GROUPS = 4


class GenerationMode(StrEnum):
    TURBO = "turbo"
    NAIVE = "naive"


@dataclass
class Timings:
    """Milliseconds spent per stage of one request inside the engine."""

    precompute_ms: float = 0.0
    stitch_ms: float = 0.0
    recompute_ms: float = 0.0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    ttft_ms: float = 0.0

    @property
    def stages_ms(self) -> float:
        """The engine's stages before the first token: precompute, stitch, recompute and prefill."""
        return self.precompute_ms + self.stitch_ms + self.recompute_ms + self.prefill_ms


@dataclass
class GenerationResult:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"
    prompt_tokens: int = 0
    context_tokens: int = 0
    recomputed_tokens: int = 0  # context tokens whose KV were recomputed after the stitch (`recompute`)
    timings: Timings = field(default_factory=Timings)
    # One entry per answer token (EOS excluded) when the request asks for log-probabilities (the scheduler's)
    logprobs: list[TokenLogprobs] = field(default_factory=list)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


StageSetter = Callable[[float], None]


def stage_setter(timings: Timings, stage: str) -> StageSetter:
    """A setter of one `Timings` field (ms), for `Stopwatch.lap`."""
    if not hasattr(timings, stage):
        raise AttributeError(f"no stage {stage!r} in Timings")

    def set_ms(ms: float) -> None:
        setattr(timings, stage, ms)

    return set_ms


class Stopwatch:
    """Stage times of work queued on the device.

    Synchronous (the default): each lap waits for the device, so it is the stage's time as the host sees it.
    Deferred (`deferred=True`, CUDA only): a lap records a CUDA event and nothing waits; the stages' times (GPU
    time between consecutive events, so not the wait for work queued before the first) are handed to their
    setters by `settle()`, once the work is done — the overlapped scheduler then never stalls the GPU to time a
    stitch or a prefill.
    """

    def __init__(self, device: torch.device, deferred: bool = False) -> None:
        self._device = device
        self._start = time.perf_counter()
        self.deferred = deferred and device.type == "cuda"
        self._mark: Any = self._event() if self.deferred else None
        self._laps: list[tuple[StageSetter, Any, Any]] = []

    def lap_ms(self) -> float:
        """Milliseconds since the last lap, after the device finished the queued work."""
        if self.deferred:
            raise RuntimeError("a deferred stopwatch's laps are read by settle()")
        _sync(self._device)
        now = time.perf_counter()
        elapsed, self._start = (now - self._start) * 1e3, now
        return elapsed

    def lap(self, setter: StageSetter) -> None:
        """End a stage: its milliseconds go to `setter`, now (synchronous) or at `settle()` (deferred)."""
        if not self.deferred:
            setter(self.lap_ms())
            return
        mark = self._event()
        self._laps.append((setter, self._mark, mark))
        self._mark = mark

    def settle(self) -> None:
        """Hand every deferred lap its time (waits for the last one's event; at once when the work is done)."""
        laps, self._laps = self._laps, []
        for setter, began, ended in laps:
            ended.synchronize()
            setter(began.elapsed_time(ended))

    @staticmethod
    def _event() -> Any:
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record()
        return event


class StitchEngine:
    """One model, its template and the lean forward; stateless across requests except the prefix block
    and, with CUDA graphs, the captured decode steps.

    `cuda_graphs`: prefill the question and decode through captured CUDA graphs (`cuda_graph.py`). None
    (default) turns them on wherever the model is on CUDA: eager prefill and decode there are bound by kernel
    launches, and graphs are captured once per capacity bucket (and question bucket; a few at most per server).
    The turbo mode then stitches straight into the graph's buffer; the naive mode prefills eagerly and decodes
    through the graph. False keeps everything eager; on the CPU it is always eager.
    `graph_attention` picks the graph's attention ("auto", "flash_varlen" or "sdpa_mask").
    `fused_stitch`: stitch with the fused Triton rotate-and-place (`fused_stitch.py`). None (default) turns it on
    wherever the model is on CUDA and triton imports; False keeps the torch stitch.
    `pipeline`: with graphs on, overlap blocks still arriving by layer groups (the KV cache's host tier copies
    `pipeline_layers` group by group when it asks) with the question prefill, run as one graph segment per layer
    group: group g is stitched, then its segment replays, while group g + 1 is still copying. None (default) and
    True: on wherever graphs are; False: off (blocks arrive whole, the stitch then the one-graph prefill).
    """

    def __init__(
        self,
        model: LoadedModel,
        template: PromptTemplate | None = None,
        cuda_graphs: bool | None = None,
        graph_attention: str = "auto",
        fused_stitch: bool | None = None,
        pipeline: bool | None = None,
        pipeline_groups: int = DEFAULT_PIPELINE_GROUPS,
    ) -> None:
        self.model = model
        self.spec = model.spec
        self.tokenizer = model.tokenizer
        self.forward = LeanForward(model)
        self.template = template or build_template(model.tokenizer)
        self.conversation = ConversationTemplate(model.tokenizer, self.template)
        self._prefix_block: KVBlock | None = None
        self.fused_stitch: FusedStitch | None = None
        if fused_stitch_enabled(fused_stitch, self.spec.device):
            self.fused_stitch = FusedStitch(self.forward.rotary, self.spec.head_dim)
        self.decode_graphs: DecodeGraphs | None = None
        # Layer ranges the KV cache copies host blocks by (and the prefill segments run by); None: no pipelining.
        self.pipeline_layers: LayerGroups | None = None
        if graphs_enabled(cuda_graphs, self.spec.device):
            if pipeline is not False and pipeline_groups > 1 and self.spec.num_layers > 1:
                self.pipeline_layers = layer_groups(self.spec.num_layers, pipeline_groups)
            self.decode_graphs = DecodeGraphs(self.forward, graph_attention, pipeline_groups=self.pipeline_layers)

    @property
    def prefix_block(self) -> KVBlock:
        """The template prefix's KV, computed once per engine."""
        if self._prefix_block is None:
            self._prefix_block = self.forward.precompute([self.template.prefix])[0]
        return self._prefix_block

    def eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (
            self.tokenizer.eos_token_id,
            getattr(self.model.hf.generation_config, "eos_token_id", None),
        ):
            if isinstance(source, int):
                ids.add(source)
            elif isinstance(source, list):
                ids.update(int(i) for i in source)
        return ids

    def encode_question(self, question: str) -> tuple[int, ...]:
        return encode(self.tokenizer, question)

    def precompute(self, blocks: Sequence[Sequence[int]]) -> list[KVBlock]:
        """Position-independent KV of several blocks, batched in one forward."""
        return self.forward.precompute(blocks)

    # ---- prefill -------------------------------------------------------------------------------------------

    def stitch(
        self,
        chunk_kv: Sequence[KVBlock],
        positions: PositionMode | str,
        room: int,
        chunk_ready: Sequence[BlockReady | None] | None = None,
        into: KVBuffer | None = None,
    ) -> tuple[KVBuffer, StitchPlan]:
        """A buffer holding prefix + chunk blocks at their planned positions, with `room` free slots after.

        `chunk_ready` (one entry per chunk block, e.g. a KV cache fetch's `ready`) is called just before each
        block is placed, so blocks still being copied to the device are waited for one by one. `into` reuses a
        buffer (a leased graph's) instead of allocating one; whatever it held is dropped.
        """
        blocks = [self.prefix_block, *chunk_kv]
        for block in blocks:
            check_block(self.spec, block)
        ready = None if chunk_ready is None else [None, *_ready_for(chunk_kv, chunk_ready)]
        plan = plan_positions(positions, [b.num_tokens for b in blocks])
        if into is None:
            buffer = KVBuffer(self.spec, plan.context_tokens + room)
        elif into.capacity < plan.context_tokens + room:
            raise ValueError(f"a buffer of {into.capacity} slots cannot hold {plan.context_tokens} + {room}")
        else:
            buffer = into
            buffer.truncate(0, 0)
        stitch_into(buffer, self.forward.rotary, blocks, plan, ready, self.fused_stitch)
        return buffer, plan

    def prefill_question(
        self,
        buffer: KVBuffer,
        question: Sequence[int],
        all_logits: bool = False,
        graph: DecodeGraph | None = None,
    ) -> torch.Tensor:
        """Run only the question against a stitched buffer, at its true index.

        With `graph` (leased, and `buffer` being its buffer) the question runs through its bucket's prefill
        graph where one holds it, else eagerly in the same buffer.
        """
        if graph is not None and not all_logits:
            if buffer is not graph.buffer:
                raise ValueError("a graph prefill needs the question's context stitched into the graph's buffer")
            logits = graph.prefill(question)
            if logits is not None:
                # A copy: the static output may share pool memory with the decode step's scratch (~0.6 MB).
                return logits.clone()
        start = buffer.next_position
        return self.forward.extend(buffer, question, torch.arange(start, start + len(question)), all_logits)

    def lease_graph(self, context_tokens: int, question_tokens: int, extra_tokens: int) -> DecodeGraph | None:
        """A CUDA graph (and its buffer) for a turbo request, or None: graphs off, the bucket's graph busy
        with another stream, or a sequence longer than the model's context (the eager path reports that).
        Hand it back with `release_graph` when the request is done."""
        if self.decode_graphs is None:
            return None
        tokens = graph_tokens(context_tokens, question_tokens, extra_tokens, self.spec.max_context)
        if tokens > self.spec.max_context:
            return None
        return self.decode_graphs.lease(tokens)

    def release_graph(self, graph: DecodeGraph) -> None:
        if self.decode_graphs is not None:
            self.decode_graphs.release(graph)

    def prefill_stitched(
        self,
        chunk_kv: Sequence[KVBlock],
        question: Sequence[int],
        positions: PositionMode | str = PositionMode.REORDERED,
        extra_tokens: int = 0,
        all_logits: bool = False,
        chunk_ready: Sequence[BlockReady | None] | None = None,
        graph: DecodeGraph | None = None,
    ) -> tuple[KVBuffer, torch.Tensor, StitchPlan]:
        """Stitch prefix + chunk blocks, then run only the question; returns buffer, logits and plan.

        With a leased `graph` (see `lease_graph`) the blocks are stitched into its buffer and the question
        prefilled through its graph: the buffer returned is then the graph's, valid while the lease lasts.
        """
        if graph is not None and not all_logits:
            done = self.prefill_pipelined(chunk_kv, question, positions, extra_tokens, chunk_ready, graph)
            if done is not None:
                return done
        into = graph.buffer if graph is not None else None
        buffer, plan = self.stitch(chunk_kv, positions, len(question) + extra_tokens, chunk_ready, into)
        return buffer, self.prefill_question(buffer, question, all_logits, graph), plan

    def pipelines(
        self,
        context_tokens: int,
        question_tokens: int,
        chunk_ready: Sequence[BlockReady | None] | None,
        graph: DecodeGraph | None,
    ) -> bool:
        """True when `prefill_pipelined` applies: pipelining on, a leased graph whose bucket holds the question,
        and at least one block arriving by layer groups (with every block resident there is nothing to hide)."""
        return (
            self.pipeline_layers is not None
            and graph is not None
            and chunk_ready is not None
            and any(isinstance(r, LayeredReady) for r in chunk_ready)
            and graph.fits_prefill(context_tokens, question_tokens)
        )

    def prefill_pipelined(
        self,
        chunk_kv: Sequence[KVBlock],
        question: Sequence[int],
        positions: PositionMode | str,
        extra_tokens: int,
        chunk_ready: Sequence[BlockReady | None] | None,
        graph: DecodeGraph,
    ) -> tuple[KVBuffer, torch.Tensor, StitchPlan] | None:
        """Stitch and prefill layer group by layer group into the leased graph's buffer, or None (nothing done)
        where `pipelines` says no.

        Ahead of prefill segment g (on the compute stream) the stream waits for layer group g's copies of every
        block and places those layers (`stitch_layers`); segment g then replays while group g + 1 still copies on
        the KV cache's stream. Only the order of the work changes: the buffer and the logits are those of the
        stitch followed by the one-graph prefill.
        """
        blocks = [self.prefix_block, *chunk_kv]
        for block in blocks:
            check_block(self.spec, block)
        plan = plan_positions(positions, [b.num_tokens for b in blocks])
        if not self.pipelines(plan.context_tokens, len(question), chunk_ready, graph):
            return None
        assert chunk_ready is not None and self.pipeline_layers is not None
        ready = [None, *_ready_for(chunk_kv, chunk_ready)]
        buffer = graph.buffer
        if buffer.capacity < plan.context_tokens + len(question) + extra_tokens:
            raise ValueError(f"a buffer of {buffer.capacity} slots cannot hold {plan.context_tokens} + more")
        buffer.truncate(0, 0)
        buffer.reserve(plan.context_tokens)
        # Committed up front: the segments read the context's length now, its layers are placed ahead of each.
        buffer.commit(plan.context_tokens, plan.question_start)
        rotary, fused = self.forward.rotary, self.fused_stitch

        def place(layers: tuple[int, int]) -> None:
            stitch_layers(buffer, rotary, blocks, plan, ready, fused, layers)

        logits = graph.prefill(question, place, self.pipeline_layers)
        assert logits is not None  # `pipelines` checked that the bucket's graph holds the question
        return buffer, logits.clone(), plan

    def recompute(self, buffer: KVBuffer, plan: StitchPlan, chunk_kv: Sequence[KVBlock], spec: RecomputeSpec) -> int:
        """Recompute the context tokens `spec` chooses in `buffer`, just stitched from `chunk_kv` (before the
        question); returns how many were recomputed (`recompute.py`)."""
        ids = [t for block in (self.prefix_block, *chunk_kv) for t in block.token_ids]
        return recompute_context(self.forward, buffer, plan, ids, spec)

    def prefill_naive(
        self, prompt: PromptIds, extra_tokens: int = 0, all_logits: bool = False, into: KVBuffer | None = None
    ) -> tuple[KVBuffer, torch.Tensor]:
        """One causal prefill over the joined ids: the baseline and the fallback. `into`: an empty buffer to
        prefill (a pool slab's) instead of a new one."""
        ids = prompt.joined()
        buffer = KVBuffer(self.spec, len(ids) + extra_tokens) if into is None else into
        if buffer.length != 0:
            raise ValueError("a naive prefill needs an empty buffer")
        logits = self.forward.extend(buffer, ids, torch.arange(len(ids)), all_logits=all_logits)
        return buffer, logits

    def prefill_turbo(
        self,
        request: TurboPrefill,
        watch: Stopwatch,
        result: GenerationResult,
        graph: DecodeGraph | None = None,
        into: KVBuffer | None = None,
    ) -> tuple[KVBuffer, torch.Tensor]:
        """Stitch, recompute where the request asks, and prefill the question (timed into `result.timings`, the
        recomputed tokens counted in `result`); returns the buffer and the last logits.

        With a leased `graph` the chunks go into its buffer and the question through its prefill graph (layer
        group by layer group when blocks still arrive: one time for both steps, unless the request recomputes,
        which needs the whole context stitched first); else into `into` (a pool slab's buffer) or a new buffer,
        eagerly. The recompute itself always runs eagerly, between the stitch and the question."""
        r, timings = request, result.timings
        if graph is not None:
            if not r.recompute.active:
                done = self.prefill_pipelined(r.chunk_kv, r.question, r.positions, r.extra_tokens, r.chunk_ready, graph)
                if done is not None:
                    watch.lap(stage_setter(timings, "prefill_ms"))
                    return done[0], done[1]
            into = graph.buffer
        room = len(r.question) + r.extra_tokens
        buffer, plan = self.stitch(r.chunk_kv, r.positions, room, r.chunk_ready, into)
        watch.lap(stage_setter(timings, "stitch_ms"))
        if r.recompute.active:
            result.recomputed_tokens = self.recompute(buffer, plan, r.chunk_kv, r.recompute)
            watch.lap(stage_setter(timings, "recompute_ms"))
        logits = self.prefill_question(buffer, r.question, graph=graph)
        watch.lap(stage_setter(timings, "prefill_ms"))
        return buffer, logits

    # ---- generate ------------------------------------------------------------------------------------------

    def generate(
        self,
        prompt: PromptIds,
        sampling: SamplingParams,
        mode: GenerationMode | str = GenerationMode.TURBO,
        positions: PositionMode | str = PositionMode.REORDERED,
        chunk_kv: Sequence[KVBlock] | None = None,
        chunk_ready: Sequence[BlockReady | None] | None = None,
        recompute: RecomputeSpec | str = NO_RECOMPUTE,
    ) -> GenerationStream:
        """Start generating; iterate the returned stream for text deltas, then read its `result`.

        `chunk_ready` goes with `chunk_kv` (see `stitch`). `recompute` (turbo only; naive computes everything)
        recomputes part of the stitched context before the question; such a request skips the pipelined prefill
        (it needs the whole context stitched first) but keeps the graph question prefill and decode.
        """
        spec = parse_recompute(recompute) if isinstance(recompute, str) else recompute
        return GenerationStream(
            self, prompt, sampling, GenerationMode(mode), PositionMode(positions), chunk_kv, chunk_ready, spec
        )


@dataclass(frozen=True)
class TurboPrefill:
    """What a turbo request's prefill needs: its chunk KV (and when each block lands), question, position mode
    and the free slots to leave after the question."""

    chunk_kv: Sequence[KVBlock]
    question: Sequence[int]
    positions: PositionMode
    extra_tokens: int
    chunk_ready: Sequence[BlockReady | None] | None = None
    recompute: RecomputeSpec = NO_RECOMPUTE  # part of the context recomputed between the stitch and the question


def check_request(
    engine: StitchEngine,
    prompt: PromptIds,
    chunk_kv: Sequence[KVBlock] | None,
    chunk_ready: Sequence[BlockReady | None] | None,
) -> list[BlockReady | None] | None:
    """Raise ValueError when a request's parts do not belong together; returns `chunk_ready` as a list."""
    if prompt.prefix != engine.template.prefix:
        raise ValueError("the prompt was not built with this engine's template")
    if chunk_kv is not None and [b.token_ids for b in chunk_kv] != list(prompt.blocks):
        raise ValueError("the KV blocks handed in do not hold the prompt's chunk ids")
    if chunk_ready is None:
        return None
    if chunk_kv is None:
        raise ValueError("`chunk_ready` needs the `chunk_kv` it belongs to")
    return _ready_for(chunk_kv, chunk_ready)


def _ready_for(chunk_kv: Sequence[KVBlock], chunk_ready: Sequence[BlockReady | None]) -> list[BlockReady | None]:
    if len(chunk_ready) != len(chunk_kv):
        raise ValueError(f"{len(chunk_ready)} ready entries for {len(chunk_kv)} chunk blocks")
    return list(chunk_ready)


class GenerationStream:
    """Iterator of text deltas for one request; `result` is complete once iteration ends.

    Stopping the iteration early (a client went away) simply drops the buffer with the generator.
    """

    def __init__(
        self,
        engine: StitchEngine,
        prompt: PromptIds,
        sampling: SamplingParams,
        mode: GenerationMode,
        positions: PositionMode,
        chunk_kv: Sequence[KVBlock] | None,
        chunk_ready: Sequence[BlockReady | None] | None = None,
        recompute: RecomputeSpec = NO_RECOMPUTE,
    ) -> None:
        chunk_ready = check_request(engine, prompt, chunk_kv, chunk_ready)
        self._engine = engine
        self._prompt = prompt
        self._sampling = sampling
        self._mode = mode
        self._positions = positions
        self._chunk_kv = chunk_kv
        self._chunk_ready = chunk_ready
        self._recompute = recompute
        self._graph: DecodeGraph | None = None  # leased for the whole request; its buffer is the request's
        self.result = GenerationResult(prompt_tokens=len(prompt.joined()), context_tokens=prompt.context_tokens)

    def __iter__(self) -> Iterator[str]:
        try:
            yield from self._generate()
        finally:
            if self._graph is not None:
                self._engine.release_graph(self._graph)
                self._graph = None

    def _generate(self) -> Iterator[str]:
        engine, timings = self._engine, self.result.timings
        watch = Stopwatch(engine.spec.device)
        buffer, logits = self._prefill(watch)
        sampler = Sampler(self._sampling, engine.spec.device)
        detok = IncrementalDetokenizer(engine.tokenizer, self._sampling.stop)
        first = sampler.pick(logits)
        timings.ttft_ms = timings.stages_ms + watch.lap_ms()
        for token in self._decode(buffer, sampler, first):
            delta = detok.push(token)
            if delta:
                yield delta
            if detok.stopped:
                self.result.finish_reason = "stop"
                break
        tail = detok.flush()
        if tail:
            yield tail
        self.result.text = detok.text
        timings.decode_ms = watch.lap_ms()

    def _decode(self, buffer: KVBuffer, sampler: Sampler, first: int) -> Iterator[int]:
        """Yield accepted token ids (EOS excluded) until EOS, the token budget, or the consumer stops."""
        eos = set() if self._sampling.ignore_eos else self._engine.eos_ids()
        # A turbo request already holds its graph (its buffer is the graph's); a naive one leases at the first
        # step that needs it, so one-token answers never copy the buffer. None (graphs off or the bucket busy)
        # decodes eagerly to the end.
        graphs = self._engine.decode_graphs if self._graph is None else None
        graph = self._graph
        token = first
        while True:
            self.result.token_ids.append(token)
            if token in eos:
                self.result.finish_reason = "stop"
                return
            yield token
            if len(self.result.token_ids) == self._sampling.max_new_tokens:
                return
            if graphs is not None:
                graph = self._graph = graphs.lease(buffer.capacity)
                if graph is not None:
                    graph.load(buffer)  # from here on the graph's buffer is the sequence's buffer
                graphs = None
            token = self._step(buffer, graph, sampler, token)

    def _step(self, buffer: KVBuffer, graph: DecodeGraph | None, sampler: Sampler, token: int) -> int:
        """One decode step: a graph replay when leased (argmax inside the graph when greedy), else eager."""
        if graph is not None:
            logits = graph.step(token)
            return graph.greedy_token() if sampler.greedy else sampler.pick(logits)
        position = torch.tensor([buffer.next_position])
        return sampler.pick(self._engine.forward.extend(buffer, [token], position))

    def _prefill(self, watch: Stopwatch) -> tuple[KVBuffer, torch.Tensor]:
        engine, timings, extra = self._engine, self.result.timings, self._sampling.max_new_tokens
        if self._mode is GenerationMode.NAIVE:
            buffer, logits = engine.prefill_naive(self._prompt, extra_tokens=extra)
            timings.prefill_ms = watch.lap_ms()
            return buffer, logits
        chunk_kv = self._chunk_kv
        if chunk_kv is None:
            chunk_kv = engine.precompute(self._prompt.blocks) if self._prompt.blocks else []
            timings.precompute_ms = watch.lap_ms()
        # With graphs the chunks are stitched straight into the leased graph's buffer, so the question prefill
        # graph and the decode graph find the context where they read it: no copy of the request's KV.
        self._graph = engine.lease_graph(self._prompt.context_tokens, len(self._prompt.question), extra)
        turbo = TurboPrefill(
            chunk_kv, self._prompt.question, self._positions, extra, self._chunk_ready, self._recompute
        )
        return engine.prefill_turbo(turbo, watch, self.result, self._graph)
