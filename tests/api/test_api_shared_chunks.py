"""`KVSTITCH_SHARED_CHUNKS=on` through the gateway: `/ask` answers read their chunks from the chunk arena the
runtime built, and give the copy path's greedy answers; nothing stays pinned once they are done."""

from __future__ import annotations

from typing import Any

import pytest
from api_support import QUESTION, ingest, record_added
from app_server import MakeApp, server_of, wait_ready
from fastapi.testclient import TestClient

ASKS = (("turbo", "reordered"), ("turbo", "composite"), ("naive", "reordered"))


def answers(make_app: MakeApp, monkeypatch: pytest.MonkeyPatch, shared: str) -> list[tuple[Any, ...]]:
    """Per ask: the answer, its token ids, whether it read the arena; with the arena's pins checked after."""
    app = make_app(shared_chunks=shared)
    out: list[tuple[Any, ...]] = []
    with TestClient(app) as client:
        wait_ready(app)
        ingest(client)
        runtime = server_of(app).runtime
        assert runtime is not None and runtime.loop.scheduler is not None
        scheduler = runtime.loop.scheduler
        assert (scheduler.shared is not None) is (shared == "on")
        added = record_added(monkeypatch, scheduler)
        for mode, positions in ASKS:
            body = {"question": QUESTION, "stream": False, "top_k": 2, "max_new_tokens": 12}
            reply = client.post("/ask", json={**body, "mode": mode, "positions": positions})
            assert reply.status_code == 200, reply.text
            request = added.pop()
            out.append((reply.json()["answer"], request.result.token_ids, request.tail_tokens is not None))
        if scheduler.shared is not None:
            arena = scheduler.shared.arena
            assert arena.chunks >= 2 and arena.pinned_chunks == 0
        assert scheduler.pool.used_slots == 0
    return out


def test_shared_chunks_serve_the_copy_paths_answers(make_app: MakeApp, monkeypatch: pytest.MonkeyPatch) -> None:
    copy = answers(make_app, monkeypatch, "off")
    shared = answers(make_app, monkeypatch, "on")
    assert [a[:2] for a in shared] == [a[:2] for a in copy]
    assert [a[2] for a in copy] == [False, False, False]
    assert [a[2] for a in shared] == [True, True, False]  # turbo answers read the arena; naive keeps its slab
