"""`kvstitch engine`: one engine (its scheduler, its GPU, host and disk tiers) serving already-retrieved questions to
gateways (`service.facade.engine.EngineFacade`, behind `service/api/engine_app.py`).

An engine opens only what answering needs: the model, the engine loop and its scheduler, the KV index and store, and
with Redis the publisher of its tier moves (`service.fleet.tier_events`) with the URL gateways reach it at. No
retrieval, no queue: the gateway searches and ingests. Start-up runs on a background thread as the gateway's does
(model, gate, warm-up), so `/healthz` answers at once and `/readyz` says when it serves.

Questions arrive with their chunks' token ids; the engine keys, fetches (or computes) and stitches their KV exactly
as the embedded gateway does (`AnswerSession` over the same `Answerer`), so an answer does not depend on where it ran.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import anyio

from service.engine.engine import GenerationMode, StitchEngine
from service.engine.kv_path import KVPath
from service.engine.recompute_spec import NO_RECOMPUTE, parse_recompute
from service.engine.sampling import SamplingParams
from service.engine.stitch import PositionMode
from service.errors import BusyError, InvalidRequestError, NotReadyError
from service.facade.engine import EngineAnswerRequest, WireChunk, check_vocabulary
from service.fleet.tier_events import TierPublisher
from service.kvcache.index import KVIndex, open_index
from service.kvcache.store import KVStore
from service.kvcache.tiers import Tier
from service.metrics import Metrics
from service.retrieval.collection import RetrievedChunk, SearchOptions
from service.serving.answer_session import AnswerSession
from service.serving.answer_stream import EventStream
from service.serving.data_dir_lock import DataDirLock, claim_data_dir
from service.serving.engine_loop import EngineBusyError, EngineLoop
from service.serving.gc_pauses import GcPauses, freeze_startup_heap, set_young_threshold
from service.serving.readiness import startup_checks
from service.serving.runtime import (
    GateOutcome,
    arena_residency,
    gate_on_loop,
    kv_path_after_gate,
    open_engine,
    open_engine_loop,
    open_kv_path,
    open_store,
    open_tier_publisher,
    serve_answers,
    warm_prefill_graphs,
)
from service.settings import Settings
from service.usecases.answer import Answerer, Question, Retrieval

log = logging.getLogger(__name__)


@dataclass
class EngineRuntime:
    """What one engine process works with; `close` releases it in reverse order."""

    settings: Settings
    engine: StitchEngine
    loop: EngineLoop
    index: KVIndex
    store: KVStore
    publisher: TierPublisher | None
    data_dir_lock: DataDirLock | None

    def close(self) -> None:
        self.loop.close()
        scheduler, self.loop.scheduler = self.loop.scheduler, None
        if scheduler is not None:
            if scheduler.shared is not None:  # its graphs' scratch slot goes back before the pool itself
                scheduler.shared.close()
                scheduler.shared.arena.close()
            scheduler.pool.release()
        if self.publisher is not None:  # before the store: its last moves are flushed, the engine retired
            self.publisher.close()
        self.store.close()
        self.index.close()
        if self.data_dir_lock is not None:
            self.data_dir_lock.release()


def open_engine_runtime(
    settings: Settings, engine_id: str, url: str, engine: StitchEngine | None = None
) -> EngineRuntime:
    """The model, loop, KV index and store, and (with Redis) the tier publisher. Without Redis the KV index is a
    SQLite file in the data dir, which this process then holds to itself (a second engine needs its own dir)."""
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    lock = claim_data_dir(settings.data_dir) if settings.redis_url is None else None
    try:
        engine = engine or open_engine(settings)
        loop = open_engine_loop(settings, engine)
        index = open_index(settings.redis_url, settings.data_dir, f"{settings.redis_prefix}:kv")
        store = open_store(settings, engine, index, loop.bind(engine.precompute))
        publisher = open_tier_publisher(settings, store, engine_id, url)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return EngineRuntime(settings, engine, loop, index, store, publisher, lock)


def _no_search(texts: Sequence[str], top_k: int, options: SearchOptions) -> list[list[RetrievedChunk]]:
    raise RuntimeError("an engine does not search: the gateway sends the chunks")


class EngineServer:
    """Implements `EngineFacade` over one engine runtime."""

    def __init__(self, settings: Settings, engine_id: str, url: str, engine: StitchEngine | None = None) -> None:
        self.settings = settings
        self.engine_id = engine_id
        self.url = url
        self.metrics = Metrics()
        self.runtime: EngineRuntime | None = None
        self.answerer: Answerer | None = None
        self.gate: GateOutcome | None = None
        self.kv_path: KVPath | None = None  # shared chunks or the copy path, chosen at start
        self.startup_error: str | None = None
        self.started = threading.Event()
        self._given = engine
        # As the gateway's `Server`: an engine holds torch, transformers and the tokenizer (hundreds of thousands of
        # objects), and every full collection walks them with the GIL held, stopping the engine thread.
        self._gc_pauses = GcPauses()
        self.metrics.watch_gc(self._gc_pauses)

    # ---- lifecycle ------------------------------------------------------------------------------------------

    def start(self) -> None:
        threading.Thread(target=self.start_now, name="engine-start", daemon=True).start()

    def start_now(self) -> None:
        try:
            began = time.perf_counter()
            self._gc_pauses.install()
            runtime = self.runtime = open_engine_runtime(self.settings, self.engine_id, self.url, self._given)
            self.metrics.watch_store(runtime.store.stats)
            self.metrics.watch_queue_depth(lambda: runtime.loop.waiting)
            self.metrics.watch_engine(runtime.loop.seconds, runtime.loop.question_prefills, runtime.loop.rider_tokens)
            asked = open_kv_path(self.settings, runtime.engine)
            self.gate = gate_on_loop(self.settings, runtime.engine, runtime.loop, asked.shared)
            if not self.gate.passed:
                raise RuntimeError(f"correctness gate failed: max |logit diff| {self.gate.max_abs_logit_diff:.3e}")
            kv_path = self.kv_path = kv_path_after_gate(asked, self.gate)
            warm_prefill_graphs(self.settings, runtime.engine, runtime.loop)
            scheduler = serve_answers(self.settings, runtime.engine, runtime.store, runtime.loop, kv_path)
            pool = scheduler.pool
            self.metrics.watch_batching(lambda: len(scheduler.running), lambda: pool.used_bytes, pool.capacity_bytes)
            self.metrics.set_kv_path(kv_path.mode.value, kv_path.reason.value)
            if scheduler.shared is not None:
                self.metrics.watch_arena(scheduler.shared.stats)
            resident = arena_residency(scheduler, runtime.engine)
            self.answerer = Answerer(runtime.engine, runtime.store, _no_search, resident)
            if self.settings.gc_freeze:
                log.info("froze %d start-up objects out of the garbage collector's walks", freeze_startup_heap())
            set_young_threshold(self.settings.gc_gen0_threshold)
            log.info("engine %s ready in %.1f s at %s", self.engine_id, time.perf_counter() - began, self.url)
        except Exception as err:
            log.exception("engine start-up failed")
            self.startup_error = f"{type(err).__name__}: {err}"
        finally:
            self.started.set()

    def close(self) -> None:
        self._gc_pauses.uninstall()
        if self.runtime is not None:
            self.runtime.close()

    # ---- state ----------------------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.answerer is not None and self.startup_error is None

    def readiness(self) -> dict[str, Any]:
        index = self.runtime.index if self.runtime is not None else None
        checks = startup_checks(self.started, self.startup_error, index, self.gate)
        ok = self.ready and (self.runtime is None or checks["index"] == "ok")
        report: dict[str, Any] = {"ready": ok, "checks": checks, "engine_id": self.engine_id}
        if self.kv_path is not None:
            report["kv_path"] = self.kv_path.as_json()
        return report

    def info(self) -> dict[str, Any]:
        space = self.runtime.store.key_space if self.runtime is not None else None
        return {
            "engine_id": self.engine_id,
            "url": self.url,
            "model": self.settings.model,
            "ready": self.ready,
            "key_space": None if space is None else {**dataclasses.asdict(space), "digest": space.digest()},
            **self.load(),
        }

    def load(self) -> dict[str, int]:
        loop = self.runtime.loop if self.runtime is not None else None
        return {"running": loop.running if loop else 0, "waiting": loop.waiting if loop else 0}

    def tiers(self, limit: int) -> dict[str, Any]:
        runtime = self._ready_runtime()
        held: dict[str, list[str]] = {t.value: [] for t in (Tier.GPU, Tier.HOST, Tier.DISK)}
        for move in runtime.store.tier_contents(disk_limit=limit):
            held[move.tier.value].append(move.key)
        return {tier: {"blocks": len(keys), "keys": keys[:limit]} for tier, keys in held.items()}

    def metrics_text(self) -> bytes:
        return self.metrics.render()

    def vocab_size(self) -> int:
        """The model's vocabulary (`NotReadyError` while it loads): every chunk id an answer reads is below it."""
        return self._ready_runtime().engine.spec.vocab_size

    def _ready_runtime(self) -> EngineRuntime:
        if self.runtime is None or not self.ready:
            raise NotReadyError(self.startup_error or "the engine is still loading")
        return self.runtime

    # ---- answers --------------------------------------------------------------------------------------------

    async def answer(self, request: EngineAnswerRequest) -> EventStream:
        session = await anyio.to_thread.run_sync(self.open_answer, request)
        return EventStream(session)

    def open_answer(self, request: EngineAnswerRequest, vocabulary_checked: bool = False) -> AnswerSession:
        """Admit the question with its chunks (`BusyError` when the line is full). `vocabulary_checked`: the
        engine's API process checked the chunks' ids against `vocab_size()` already."""
        started = time.perf_counter()
        runtime = self._ready_runtime()
        assert self.answerer is not None
        if not vocabulary_checked:
            check_vocabulary([c.token_ids for c in request.chunks], runtime.engine.spec.vocab_size)
        try:
            question = self.answerer.prepare(_question(request))
        except InvalidRequestError:
            raise
        except ValueError as err:
            raise InvalidRequestError("max_new_tokens", str(err)) from err
        try:
            admission = runtime.loop.admit()
        except EngineBusyError as err:
            self.metrics.rejected.labels("busy").inc()
            raise BusyError(f"engine {self.engine_id} busy: {err}") from err
        retrieval = Retrieval([_retrieved(c, i) for i, c in enumerate(request.chunks)], request.dropped, 0.0)
        session = AnswerSession(runtime.loop, self.answerer, self.metrics, question, retrieval, admission, started)
        return session

    async def precompute(self, chunks: Sequence[Sequence[int]]) -> dict[str, int]:
        return await anyio.to_thread.run_sync(self.precompute_now, chunks)

    def precompute_now(self, chunks: Sequence[Sequence[int]]) -> dict[str, int]:
        """The chunks' KV fetched once on the engine loop (misses computed and kept by the store's tiers)."""
        runtime = self._ready_runtime()
        check_vocabulary(chunks, runtime.engine.spec.vocab_size)
        template = runtime.engine.template
        blocks = [template.chunk_block(tuple(ids)) for ids in chunks]
        result = runtime.loop.call(lambda: runtime.store.fetch(blocks))
        try:
            counts: Counter[str] = Counter({tier.value: n for tier, n in result.counts.items()})
        finally:
            runtime.store.release(result)
        return {tier.value: counts[tier.value] for tier in Tier}


def _question(request: EngineAnswerRequest) -> Question:
    """The request in the engine's terms (the gateway applied the deployment's defaults)."""
    try:
        sampling = SamplingParams(
            max_new_tokens=request.max_new_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            seed=request.seed,
            stop=request.stop,
            logprobs=request.logprobs,
        )
        mode = GenerationMode(request.mode)
        recompute = parse_recompute(request.recompute) if mode is GenerationMode.TURBO else NO_RECOMPUTE
    except ValueError as err:
        raise InvalidRequestError("sampling", str(err)) from err
    return Question(
        text=request.question,
        history=request.history,
        top_k=max(1, len(request.chunks)),
        mode=mode,
        positions=PositionMode(request.positions),
        sampling=sampling,
        recompute=recompute,
    )


def _retrieved(chunk: WireChunk, index: int) -> RetrievedChunk:
    """A chunk as the answer path reads it (the fields retrieval alone uses are left empty)."""
    return RetrievedChunk(
        id=chunk.id,
        doc_id=chunk.doc_id,
        index=index,
        score=chunk.score,
        text=chunk.text,
        token_ids=chunk.token_ids,
        version="",
        kv_key="",
        char_start=0,
        char_end=0,
        metadata=chunk.metadata,
        context=chunk.context,
    )
