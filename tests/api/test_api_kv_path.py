"""The KV path chosen at start, as an operator sees it: `/readyz` (`kv_path`, `arena`) and `/metrics`.

On (the CPU serves shared chunks through the torch segment attention) the gate checks the zero-copy path too, the
arena's figures follow the answers, and the metrics say the same; a zero-copy path the gate finds off the reference
is not served: the copy path answers, and both endpoints say why.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from api_support import QUESTION, ingest
from app_server import MakeApp, server_of, wait_ready
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

import service.engine.shared_gate as shared_gate_module
import service.serving.runtime as runtime_module
from service.engine.kv_layout import ModelSpec
from service.engine.kv_path import COPY_PATH, KVPath, KVPathReason
from service.engine.segment_attention import ChunkRange
from service.engine.shared_decode import Placement, placements
from service.engine.stitch import StitchPlan


def samples(client: TestClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every kvstitch sample of /metrics: (name, sorted labels) -> value."""
    text = client.get("/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("kvstitch_")
    }


def ask(client: TestClient, mode: str) -> dict[str, int]:
    """The answer's chunk counts by tier (its `kv`)."""
    body = {"question": QUESTION, "stream": False, "top_k": 2, "max_new_tokens": 6, "mode": mode}
    reply = client.post("/ask", json=body)
    assert reply.status_code == 200, reply.text
    kv: dict[str, int] = reply.json()["kv"]
    return kv


def test_shared_chunks_on_are_reported_with_the_arenas_figures(make_app: MakeApp) -> None:
    app = make_app(shared_chunks="on")
    with TestClient(app) as client:
        wait_ready(app)
        ready: dict[str, Any] = client.get("/readyz").json()
        assert ready["kv_path"] == {
            "mode": "shared",
            "reason": "on",
            "detail": "KVSTITCH_SHARED_CHUNKS=on",
            "attention": "torch",
        }
        assert ready["checks"]["gate"].startswith("passed") and "zero-copy" in ready["checks"]["gate"]
        assert "failed" not in ready["checks"]["gate"]
        gate = server_of(app).gate
        assert gate is not None and gate.shared_max_abs_logit_diff is not None
        assert 0 < gate.shared_max_abs_logit_diff <= 1e-4
        arena = ready["arena"]
        assert arena["capacity_bytes"] > 0 and arena["answers"] == 0 and arena["chunks"] == 0
        ingest(client)
        first, again, _ = (ask(client, mode) for mode in ("turbo", "turbo", "naive"))
        # The second answer reads the same chunks: resident in the arena, fetched no more, counted as GPU hits.
        chunks = sum(first.values())
        assert chunks >= 1 and again == {"gpu": chunks, "host": 0, "disk": 0, "miss": 0}
        arena = client.get("/readyz").json()["arena"]
        assert arena["resident_reads"] == chunks
        assert arena["answers"] == 2 and arena["readers"] == 0 and arena["pinned_chunks"] == 0
        assert arena["chunks"] >= 2 and 0 < arena["used_bytes"] <= arena["capacity_bytes"]
        assert arena["waited"] == 0 and arena["evictions"] == 0
        got = samples(client)
    assert got[("kvstitch_kv_path", (("mode", "shared"), ("reason", "on")))] == 1
    assert got[("kvstitch_gate_zero_copy_max_abs_logit_diff", ())] == gate.shared_max_abs_logit_diff
    assert got[("kvstitch_arena_bytes", (("kind", "used"),))] == arena["used_bytes"]
    assert got[("kvstitch_arena_bytes", (("kind", "capacity"),))] == arena["capacity_bytes"]
    assert got[("kvstitch_arena_chunks", ())] == arena["chunks"]
    assert got[("kvstitch_arena_pinned_chunks", ())] == 0
    assert got[("kvstitch_arena_readers", ())] == 0
    assert got[("kvstitch_arena_answers_total", ())] == 2
    assert got[("kvstitch_arena_waits_total", ())] == 0
    assert got[("kvstitch_arena_evictions_total", ())] == 0
    assert got[("kvstitch_arena_resident_reads_total", ())] == arena["resident_reads"]


@pytest.mark.parametrize(("setting", "reason"), [("off", "off"), (None, "auto")], ids=["off", "auto-on-the-cpu"])
def test_shared_chunks_off_report_the_copy_path_and_no_arena(
    make_app: MakeApp, setting: str | None, reason: str
) -> None:
    """Off, and the default (auto) on the CPU, where the segment kernels do not run: the copy path, saying why."""
    app = make_app() if setting is None else make_app(shared_chunks=setting)
    with TestClient(app) as client:
        wait_ready(app)
        ready = client.get("/readyz").json()
        got = samples(client)
    assert ready["kv_path"]["mode"] == "copy" and ready["kv_path"]["reason"] == reason
    assert "arena" not in ready and "zero-copy" not in ready["checks"]["gate"]
    assert got[("kvstitch_kv_path", (("mode", "copy"), ("reason", reason)))] == 1
    assert not any(name.startswith("kvstitch_arena") for name, _ in got)


def _shifted(plan: StitchPlan, ranges: list[ChunkRange]) -> tuple[Placement, ...]:
    return tuple(Placement(p.chunk, p.offset + 1) for p in placements(plan, ranges))


def test_a_zero_copy_path_the_gate_fails_is_not_served(make_app: MakeApp, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks read one position off in the gate's zero-copy cases: the server still starts (the copy path passed),
    serves the copy path, and says why on /readyz and /metrics."""
    monkeypatch.setattr(shared_gate_module, "placements", _shifted)
    app = make_app(shared_chunks="on")
    with TestClient(app) as client:
        wait_ready(app)
        ready = client.get("/readyz").json()
        runtime = server_of(app).runtime
        assert runtime is not None and runtime.loop.scheduler is not None
        assert runtime.loop.scheduler.shared is None  # no arena: every answer on the copy path
        ingest(client)
        ask(client, "turbo")
        got = samples(client)
    assert ready["ready"] is True and ready["checks"]["gate"].startswith("passed")
    assert ready["checks"]["gate"].endswith("failed: the copy path serves)")
    path = ready["kv_path"]
    assert (path["mode"], path["reason"], path["attention"]) == ("copy", "gate", None)
    assert "zero-copy max |logit diff|" in path["detail"] and "arena" not in ready
    assert got[("kvstitch_kv_path", (("mode", "copy"), ("reason", "gate")))] == 1
    assert got[("kvstitch_gate_zero_copy_max_abs_logit_diff", ())] > 1e-2


def test_a_shared_path_the_engine_cannot_run_falls_back_before_the_gate(
    make_app: MakeApp, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Asked for on an engine segment attention cannot serve (here: CUDA without Triton, as `choose_kv_path` says):
    the copy path serves from the start, the gate runs no zero-copy case, and the log, /readyz and /metrics say why."""

    def no_triton(requested: str, spec: ModelSpec) -> KVPath:
        return COPY_PATH.fallback(KVPathReason.TRITON, "the segment attention kernels need Triton, not installed")

    monkeypatch.setattr(runtime_module, "choose_kv_path", no_triton)
    app = make_app(shared_chunks="on")
    with caplog.at_level(logging.WARNING, logger=runtime_module.__name__), TestClient(app) as client:
        wait_ready(app)
        ready = client.get("/readyz").json()
        runtime = server_of(app).runtime
        assert runtime is not None and runtime.loop.scheduler is not None and runtime.loop.scheduler.shared is None
        got = samples(client)
    assert ready["kv_path"]["mode"] == "copy" and ready["kv_path"]["reason"] == "triton"
    assert "zero-copy" not in ready["checks"]["gate"] and "arena" not in ready
    assert got[("kvstitch_kv_path", (("mode", "copy"), ("reason", "triton")))] == 1
    assert any("copy path serving: the segment attention kernels need Triton" in r.getMessage() for r in caplog.records)
