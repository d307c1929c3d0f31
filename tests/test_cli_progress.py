"""`kvstitch ingest`'s progress bar follows `chunks_done` as a job's batches finish, not only finished documents."""

from __future__ import annotations

import io
from collections.abc import Iterator, Mapping
from typing import Any

from service.commands.ingest import follow_jobs


def statuses() -> Iterator[Mapping[str, Any]]:
    base = {"documents": 2, "documents_done": 0, "chunks": 20}
    yield {**base, "status": "queued", "chunks": 0, "chunks_done": 0}
    for done in (0, 5, 10, 15):
        yield {**base, "status": "running", "chunks_done": done}
    yield {**base, "status": "done", "documents_done": 2, "chunks_done": 20}


def test_the_bar_moves_with_chunks_done_within_one_job() -> None:
    out = io.StringIO()
    feed = statuses()

    final = follow_jobs(["job-1"], lambda _: next(feed), out=out, step=lambda: None)

    frames = [f for f in out.getvalue().split("\r") if f.strip()]
    bars = [f.split("]")[0].count("#") for f in frames]
    assert final["job-1"]["status"] == "done"
    assert [f.split("] ")[1].strip() for f in frames] == [
        "0/2 documents, 0/0 chunks",
        "0/2 documents, 0/20 chunks",
        "0/2 documents, 5/20 chunks",
        "0/2 documents, 10/20 chunks",
        "0/2 documents, 15/20 chunks",
        "2/2 documents, 20/20 chunks",
    ]
    assert bars == [0, 0, 7, 15, 22, 30]  # of 30: a quarter, a half, three quarters, whole
