"""Helpers of the HTTP tests: a corpus, ingest-and-wait, and an SSE reader."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from typing import Any

import httpx
import pytest

from service.commands.ask import sse_events
from service.engine.batch_request import BatchRequest
from service.engine.scheduler import Scheduler

DOCS = [
    {
        "id": "otters",
        "text": "Sea otters hold hands while they sleep so they do not drift apart.",
        "metadata": {"k": 1},
    },
    {"id": "volcano", "text": "Mauna Loa on Hawaii is the largest active volcano on Earth by volume."},
    {"id": "bread", "text": "Sourdough rises because wild yeast and bacteria ferment the flour.", "format": "markdown"},
]
QUESTION = "Why do sea otters hold hands?"


def ingest(client: httpx.Client, documents: list[dict[str, Any]] = DOCS, timeout_s: float = 60) -> dict[str, Any]:
    reply = client.post("/ingest", json={"documents": documents})
    assert reply.status_code == 202, reply.text
    return wait_job(client, reply.json()["job_id"], timeout_s)


def wait_job(client: httpx.Client, job_id: str, timeout_s: float = 60) -> dict[str, Any]:
    """The status of a job (ingest or delete) once it is done or failed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status: dict[str, Any] = client.get(f"/ingest/{job_id}").json()
        if status["status"] in ("done", "failed"):
            return status
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} did not finish")


def sse(lines: Iterable[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(event, parsed data) pairs of a text/event-stream body, read with the CLI's own parser."""
    for event, data in sse_events(iter(lines)):
        yield event, json.loads(data)


def ask_events(client: httpx.Client, **body: Any) -> list[tuple[str, dict[str, Any]]]:
    with client.stream("POST", "/ask", json={"question": QUESTION, **body}) as reply:
        assert reply.status_code == 200, reply.read()
        assert reply.headers["content-type"].startswith("text/event-stream")
        return list(sse(reply.iter_lines()))


def record_added(monkeypatch: pytest.MonkeyPatch, scheduler: Scheduler) -> list[BatchRequest]:
    """Every request handed to `scheduler` from now on, in order (each still goes to the scheduler)."""
    added: list[BatchRequest] = []
    add = scheduler.add

    def recording_add(request: BatchRequest) -> None:
        added.append(request)
        add(request)

    monkeypatch.setattr(scheduler, "add", recording_add)
    return added
