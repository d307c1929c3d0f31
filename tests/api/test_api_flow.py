"""The full flow over HTTP: ingest → job status → /ask (both modes, both position modes), SSE order and fields."""

from __future__ import annotations

import time

import anyio
import pytest
from api_support import DOCS, QUESTION, ask_events, ingest, wait_job
from app_server import server_of
from fastapi.testclient import TestClient

TIMING_KEYS = {"retrieve", "load", "h2d", "stitch", "prefill", "decode", "queue", "engine_wait", "transport"}


def test_ingest_reports_a_finished_job_with_counts(client: TestClient) -> None:
    status = ingest(client)

    assert status["status"] == "done" and status["error"] is None
    assert status["documents"] == status["documents_done"] == len(DOCS)
    assert status["chunks"] == status["chunks_precomputed"] + status["chunks_reused"] >= len(DOCS)


def test_an_unknown_job_is_404(client: TestClient) -> None:
    reply = client.get("/ingest/no-such-job")
    assert reply.status_code == 404 and "no-such-job" in reply.json()["detail"]


@pytest.mark.parametrize("mode", ["turbo", "naive"])
@pytest.mark.parametrize("positions", ["reordered", "composite"])
def test_ask_streams_retrieval_tokens_then_done(client: TestClient, mode: str, positions: str) -> None:
    ingest(client)

    events = ask_events(client, mode=mode, positions=positions, top_k=2, max_new_tokens=12)

    names = [name for name, _ in events]
    assert names[0] == "retrieval" and names[-1] == "done"
    assert set(names[1:-1]) == {"token"} and len(names) > 2
    chunks = events[0][1]["chunks"]
    assert len(chunks) == 2 and chunks[0]["doc_id"] == "otters"
    assert set(chunks[0]) >= {"id", "doc_id", "score", "tokens", "text"} and chunks[0]["score"] > chunks[1]["score"]
    done = events[-1][1]
    assert (done["mode"], done["positions"]) == (mode, positions)
    assert done["ttft_ms"] > 0 and 1 <= done["output_tokens"] <= 12
    assert set(done["timings_ms"]) >= TIMING_KEYS and all(v >= 0 for v in done["timings_ms"].values())
    # The wait with the engine loop is part of the time between retrieval and admission (rounded to 1 µs).
    assert done["timings_ms"]["engine_wait"] <= done["timings_ms"]["queue"] + 0.002
    assert done["timings_ms"]["transport"] == 0.0  # one process: no hop to an engine
    assert set(done["kv"]) == {"gpu", "host", "disk", "miss"}
    assert sum(done["kv"].values()) == (2 if mode == "turbo" else 0)


def test_a_repeated_question_is_served_from_the_memory_tier(client: TestClient) -> None:
    ingest(client)

    first = ask_events(client, top_k=3, max_new_tokens=4)[-1][1]
    second = ask_events(client, top_k=3, max_new_tokens=4)[-1][1]

    # The worker stored every chunk's KV on disk: the first question's admission copied them from disk, or from the
    # host tier where its read ahead landed first (on CPU the host tier is the memory tier); the second finds
    # them there.
    assert first["kv"]["host"] + first["kv"]["disk"] == 3 and first["kv"]["miss"] == 0
    assert second["kv"]["host"] == 3


def test_streamed_and_json_answers_agree_and_turbo_matches_itself(client: TestClient) -> None:
    ingest(client)

    streamed = ask_events(client, max_new_tokens=10)
    reply = client.post("/ask", json={"question": QUESTION, "stream": False, "max_new_tokens": 10})

    assert reply.status_code == 200
    body = reply.json()
    assert body["answer"] == "".join(data["text"] for name, data in streamed if name == "token")
    assert [c["id"] for c in body["chunks"]] == [c["id"] for c in streamed[0][1]["chunks"]]
    assert body["output_tokens"] == streamed[-1][1]["output_tokens"] and body["ttft_ms"] > 0


def test_deleting_a_document_removes_it_from_retrieval(client: TestClient) -> None:
    ingest(client)

    reply = client.delete("/documents/otters")

    assert reply.status_code == 202 and reply.json()["doc_id"] == "otters"
    status = wait_job(client, reply.json()["job_id"])
    assert status["kind"] == "delete" and status["status"] == "done" and status["chunks_deleted"] >= 1
    chunks = ask_events(client, top_k=5, max_new_tokens=2)[0][1]["chunks"]
    assert "otters" not in {c["doc_id"] for c in chunks} and len(chunks) == len(DOCS) - 1
    assert client.delete("/documents/otters").status_code == 404  # gone, and no job for it is waiting
    assert client.delete("/documents/never-ingested").status_code == 404


def test_a_delete_sent_right_after_an_ingest_of_the_same_document_wins(client: TestClient) -> None:
    """The delete is queued behind the ingest (it used to run inline first, and the document came back)."""
    ingest(client, DOCS[1:])
    sent = client.post("/ingest", json={"documents": DOCS[:1]})
    deleted = client.delete("/documents/otters")  # at once: the ingest has not run yet

    assert sent.status_code == 202 and deleted.status_code == 202
    ingest_status = wait_job(client, sent.json()["job_id"])
    delete_status = wait_job(client, deleted.json()["job_id"])
    assert (ingest_status["status"], delete_status["status"]) == ("done", "done")
    chunks = ask_events(client, top_k=5, max_new_tokens=2)[0][1]["chunks"]
    assert "otters" not in {c["doc_id"] for c in chunks}

    assert ingest(client, DOCS[:1])["status"] == "done"  # ingesting it again makes it retrievable
    chunks = ask_events(client, top_k=5, max_new_tokens=2)[0][1]["chunks"]
    assert "otters" in {c["doc_id"] for c in chunks}


def test_the_documents_api_lists_pages_and_describes_what_is_stored(client: TestClient) -> None:
    before = time.time()
    ingest(client)

    listed = client.get("/documents").json()
    page = client.get("/documents", params={"offset": 1, "limit": 1}).json()
    otters = client.get("/documents/otters")

    assert listed["total"] == len(DOCS) and [d["id"] for d in listed["documents"]] == sorted(d["id"] for d in DOCS)
    assert all(d["chunks"] >= 1 and d["tokens"] > 0 and d["ingested_at"] >= before for d in listed["documents"])
    assert page["total"] == len(DOCS) and [d["id"] for d in page["documents"]] == ["otters"]
    assert otters.status_code == 200 and otters.json()["metadata"] == {"k": 1}
    assert otters.json()["version"] == next(d for d in listed["documents"] if d["id"] == "otters")["version"]
    assert client.get("/documents/never-ingested").status_code == 404
    assert client.get("/documents", params={"limit": 0}).status_code == 422
    wait_job(client, client.delete("/documents/otters").json()["job_id"])
    assert client.get("/documents/otters").status_code == 404
    assert client.get("/documents").json()["total"] == len(DOCS) - 1


def test_ttft_counts_the_wait_for_a_worker_thread(client: TestClient) -> None:
    """Retrieval blocks, so a question is opened on one of the event loop's worker threads; when every one is busy
    (many questions at once) the question waits for one, and that wait is part of its time to the first token."""
    ingest(client)
    portal = client.portal
    assert portal is not None

    async def occupy_every_worker_thread(seconds: float) -> None:
        limiter = anyio.to_thread.current_default_thread_limiter()
        borrowers = [object() for _ in range(int(limiter.total_tokens))]
        for borrower in borrowers:
            await limiter.acquire_on_behalf_of(borrower)
        await anyio.sleep(seconds)
        for borrower in borrowers:
            limiter.release_on_behalf_of(borrower)

    held = portal.start_task_soon(occupy_every_worker_thread, 0.4)
    done = ask_events(client, top_k=1, max_new_tokens=2)[-1][1]
    held.result(timeout=5)

    assert done["ttft_ms"] >= 350
    assert done["timings_ms"]["queue"] >= 300  # before admission, beside retrieval


def test_engine_wait_is_the_time_a_question_waits_for_a_busy_engine_loop(client: TestClient) -> None:
    """While the engine thread runs a 0.4 s work item, a question handed to it waits: `engine_wait` counts that
    wait, and it is part of `queue` (retrieval to admission)."""
    ingest(client)
    loop = server_of(client.app).runtime.loop  # type: ignore[arg-type]
    busy = loop.submit(lambda: time.sleep(0.4))
    done = ask_events(client, top_k=1, max_new_tokens=2)[-1][1]
    busy.result(timeout=5)

    waited = done["timings_ms"]["engine_wait"]
    assert 150 <= waited <= done["timings_ms"]["queue"] + 0.002
    assert done["ttft_ms"] >= waited
