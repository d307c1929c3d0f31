"""The gateway with questions embedded in child processes (`embedding_process="on"`, two of them) retrieves what the
in-process embedder does, and its shutdown ends the children."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from api_support import ask_events, ingest
from app_server import MakeApp, server_of, wait_ready
from fastapi.testclient import TestClient

pytestmark = pytest.mark.slow


def turbo_sources(make_app: MakeApp, embedding_process: str) -> tuple[list[dict[str, Any]], list[int | None]]:
    """The retrieved chunks of one turbo question after the test corpus's ingest, and the children's pids (if any);
    two children, so the retrieval runs two rounds at once."""
    app = make_app(embedding_process=embedding_process, embedding_processes=2)
    with TestClient(app) as client:
        wait_ready(app)
        runtime = server_of(app).runtime
        assert runtime is not None
        pool = runtime.question_embedder
        assert (pool is not None) is (embedding_process == "on")
        pids = pool.pids if pool is not None else []
        assert len(runtime.retrieval._threads) == (2 if pool is not None else 1)
        assert ingest(client)["status"] == "done"
        events = ask_events(client, mode="turbo", top_k=3, max_new_tokens=4)
    assert events[0][0] == "retrieval" and events[-1][0] == "done"
    chunks: list[dict[str, Any]] = events[0][1]["chunks"]
    return chunks, pids


def test_a_child_embedder_retrieves_the_same_sources_as_the_in_process_one(make_app: MakeApp) -> None:
    in_child, pids = turbo_sources(make_app, "on")
    in_process, _ = turbo_sources(make_app, "off")

    assert [c["doc_id"] for c in in_child] == [c["doc_id"] for c in in_process]
    assert in_child[0]["doc_id"] == "otters" and len(in_child) == 3
    assert [c["text"] for c in in_child] == [c["text"] for c in in_process]
    assert all(abs(a["score"] - b["score"]) < 1e-4 for a, b in zip(in_child, in_process, strict=True))
    assert len(pids) == 2  # the app's shutdown ended (and reaped) both
    assert all(pid is not None and not Path(f"/proc/{pid}").exists() for pid in pids)
