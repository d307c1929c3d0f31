"""An engine process (`kvstitch engine`) chooses its KV path at start as the embedded gateway does: with
`KVSTITCH_SHARED_CHUNKS=on` its gate checks the zero-copy path, its scheduler reads chunks from the arena, and its
/readyz and /metrics say so; off, the copy path, reported too. Once ready it also sets up the garbage collector as
the gateway does."""

from __future__ import annotations

import gc
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from service.engine.engine import StitchEngine
from service.errors import InvalidRequestError
from service.facade.engine import EngineAnswerRequest, WireChunk
from service.serving.engine_server import EngineServer
from service.settings import Settings


def engine_settings(model: Path, tmp_path: Path, **overrides: object) -> Settings:
    """A CPU engine's settings over `model` with no GPU tier, and the garbage collector as this test process has it
    (a ready engine would otherwise freeze the heap and raise the threshold); `overrides` on top."""
    defaults: dict[str, object] = {
        "model": str(model),
        "data_dir": tmp_path / "engine",
        "device": "cpu",
        "gpu_cache_mb": 0,
        "gc_freeze": False,
        "gc_gen0_threshold": gc.get_threshold()[0],
    }
    return Settings(**{**defaults, **overrides})  # type: ignore[arg-type]


@pytest.mark.parametrize("shared", ["on", "off"])
def test_an_engine_reports_the_kv_path_it_serves(
    get_engine: Callable[[str, str], StitchEngine], tiny_model_dirs: dict[str, Path], tmp_path: Path, shared: str
) -> None:
    settings = engine_settings(
        tiny_model_dirs["qwen2"], tmp_path, host_cache_mb=8, disk_cache_mb=64, shared_chunks=shared
    )
    server = EngineServer(settings, "e1", "http://127.0.0.1:9", get_engine("qwen2", "cpu"))
    server.start_now()
    try:
        assert server.ready, server.startup_error
        report = server.readiness()
        runtime, gate = server.runtime, server.gate
        assert runtime is not None and runtime.loop.scheduler is not None and gate is not None
        text = server.metrics_text().decode()
        if shared == "on":
            assert report["kv_path"] == {
                "mode": "shared",
                "reason": "on",
                "detail": "KVSTITCH_SHARED_CHUNKS=on",
                "attention": "torch",
            }
            assert gate.shared_passed is True and gate.shared_max_abs_logit_diff is not None
            assert runtime.loop.scheduler.shared is not None
            assert 'kvstitch_kv_path{mode="shared",reason="on"} 1.0' in text
            assert "kvstitch_arena_bytes" in text
        else:
            assert report["kv_path"]["mode"] == "copy" and report["kv_path"]["reason"] == "off"
            assert gate.shared_passed is None and runtime.loop.scheduler.shared is None
            assert 'kvstitch_kv_path{mode="copy",reason="off"} 1.0' in text
            assert "kvstitch_arena_bytes" not in text
    finally:
        server.close()


def test_a_ready_engine_froze_its_start_up_heap_and_reports_every_collection(
    get_engine: Callable[[str, str], StitchEngine], tiny_model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """As the gateway does: an engine process holds torch and transformers, and a full collection walking them would
    stop its engine thread for hundreds of milliseconds."""
    frozen_before, threshold_before = gc.get_freeze_count(), gc.get_threshold()
    settings = engine_settings(
        tiny_model_dirs["qwen2"], tmp_path, gate_on_start=False, gc_freeze=True, gc_gen0_threshold=12_345
    )
    server = EngineServer(settings, "e1", "http://127.0.0.1:9", get_engine("qwen2", "cpu"))
    try:
        server.start_now()
        assert server.ready, server.startup_error
        assert gc.get_freeze_count() > frozen_before + 100_000  # torch and transformers alone
        assert gc.get_threshold() == (12_345, *threshold_before[1:])
        gc.collect()
        text = server.metrics_text().decode()
    finally:
        server.close()
        gc.unfreeze()
        gc.set_threshold(*threshold_before)
    count = re.search(r'kvstitch_gc_pause_seconds_count\{generation="2"\} (\S+)', text)
    assert count is not None and float(count.group(1)) >= 1


def test_an_engine_refuses_chunk_ids_outside_its_vocabulary(
    get_engine: Callable[[str, str], StitchEngine], tiny_model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """Ids past the embedding table (another tokenizer's, a stray caller's) are a 422 before admission, for answers
    and precomputes alike: on CUDA the lookup would be a device-side assert ending the process."""
    engine = get_engine("qwen2", "cpu")
    settings = engine_settings(tiny_model_dirs["qwen2"], tmp_path, gate_on_start=False)
    server = EngineServer(settings, "e1", "http://127.0.0.1:9", engine)
    vocab = engine.spec.vocab_size
    try:
        server.start_now()
        assert server.ready, server.startup_error
        fits = WireChunk("c0", "d", 1.0, "t", (1, 2, vocab - 1))
        past = WireChunk("c1", "d", 1.0, "t", (1, vocab, 2))
        with pytest.raises(InvalidRequestError, match=re.escape("chunks[1].token_ids: ids of this model's vocabulary")):
            server.open_answer(EngineAnswerRequest("why?", (fits, past), max_new_tokens=2))
        with pytest.raises(InvalidRequestError, match=re.escape("chunks[0].token_ids")):
            server.precompute_now([[vocab + 5]])
        assert server.runtime is not None and server.runtime.loop.waiting == 0  # nothing was admitted
        assert server.precompute_now([[1, 2, vocab - 1]])["miss"] == 1  # the last id of the table is fine
    finally:
        server.close()
