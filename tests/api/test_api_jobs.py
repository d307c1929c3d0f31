"""Jobs under control over HTTP (issue 15): DELETE /ingest/{id} cancels a queued or running job (404 unknown, 409
finished), and a job over KVSTITCH_MAX_JOB_TOKENS is refused at submit with 413."""

from __future__ import annotations

from typing import Any

from api_support import DOCS, ingest, wait_job
from app_server import MakeApp, wait_ready
from fastapi.testclient import TestClient

from tests.workers.test_workers_sigkill import corpus

LARGE = [d.to_json() for d in corpus(30)]  # seconds of work for the tiny model on a CPU


def test_cancelling_an_unknown_job_is_404_and_a_finished_one_409(client: TestClient) -> None:
    missing = client.delete("/ingest/no-such-job")
    assert missing.status_code == 404 and "no-such-job" in missing.json()["detail"]

    finished = ingest(client)
    again = client.delete(f"/ingest/{finished['job_id']}")
    assert again.status_code == 409 and "already finished (done)" in again.json()["detail"]
    assert client.get(f"/ingest/{finished['job_id']}").json()["status"] == "done"


def test_a_cancelled_job_publishes_whole_documents_only_and_can_be_cancelled_once(client: TestClient) -> None:
    job_id = client.post("/ingest", json={"documents": LARGE}).json()["job_id"]
    reply = client.delete(f"/ingest/{job_id}")

    assert reply.status_code == 200, reply.text
    assert (reply.json()["job_id"], reply.json()["status"]) == (job_id, "cancelled")
    assert reply.json()["finished_at"] is not None
    assert client.delete(f"/ingest/{job_id}").status_code == 409  # cancelled is finished
    # A job sent after it is done only once the worker has dealt with the cancelled one (dropped or stopped).
    assert wait_job(client, client.post("/ingest", json={"documents": DOCS[:1]}).json()["job_id"])["status"] == "done"

    status = client.get(f"/ingest/{job_id}").json()
    assert status["status"] == "cancelled" and status["documents_done"] < len(LARGE)
    stored = {d["id"]: d for d in client.get("/documents", params={"limit": 1000}).json()["documents"]}
    assert sum(1 for d in LARGE if d["id"] in stored) == status["documents_done"]  # finished ones only


def test_a_job_over_the_token_bound_is_413_naming_the_setting(make_app: MakeApp) -> None:
    app = make_app(max_job_tokens=200)
    with TestClient(app) as client:
        wait_ready(app)
        small: list[dict[str, Any]] = DOCS  # a few dozen tokens: accepted
        assert client.post("/ingest", json={"documents": small}).status_code == 202

        reply = client.post("/ingest", json={"documents": LARGE})

        assert reply.status_code == 413, reply.text
        detail = reply.json()["detail"]
        assert detail.startswith("documents: ") and "more than 200 tokens" in detail
        assert "KVSTITCH_MAX_JOB_TOKENS" in detail
        assert client.get("/documents").json()["total"] <= len(DOCS)  # nothing of the refused job was queued
