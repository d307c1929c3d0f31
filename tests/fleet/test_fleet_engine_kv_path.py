"""An engine process (`kvstitch engine`) chooses its KV path at start as the embedded gateway does: with
`KVSTITCH_SHARED_CHUNKS=on` its gate checks the zero-copy path, its scheduler reads chunks from the arena, and its
/readyz and /metrics say so; off, the copy path, reported too."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from service.engine.engine import StitchEngine
from service.serving.engine_server import EngineServer
from service.settings import Settings


@pytest.mark.parametrize("shared", ["on", "off"])
def test_an_engine_reports_the_kv_path_it_serves(
    get_engine: Callable[[str, str], StitchEngine], tiny_model_dirs: dict[str, Path], tmp_path: Path, shared: str
) -> None:
    settings = Settings(
        model=str(tiny_model_dirs["qwen2"]),
        data_dir=tmp_path / "engine",
        device="cpu",
        gpu_cache_mb=0,
        host_cache_mb=8,
        disk_cache_mb=64,
        shared_chunks=shared,
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
