"""A separate `kvstitch worker` serves its own metrics on KVSTITCH_WORKER_METRICS_PORT: the stream backlog, jobs by
outcome, chunks by whether their KV was computed or reused, and its KV store's tiers."""

from __future__ import annotations

import httpx
from ingest_support import CORPUS

from service.devtools.ports import free_port
from service.jobs.submit import submit_ingest
from service.serving.runtime import Runtime
from workers.__main__ import serve_metrics
from workers.worker import runtime_worker


def sample(text: str, line_start: str) -> float:
    (line,) = [line for line in text.splitlines() if line.startswith(line_start + " ")]
    return float(line.rsplit(" ", 1)[1])


def test_the_worker_serves_its_ingest_metrics_on_its_port(runtime: Runtime) -> None:
    settings = runtime.settings.model_copy(update={"worker_metrics_port": free_port(), "host": "127.0.0.1"})
    worker = runtime_worker(runtime, name="metrics-test", poll_ms=50)
    server = serve_metrics(settings, runtime, worker)
    assert server is not None
    url = f"http://127.0.0.1:{settings.worker_metrics_port}/metrics"
    try:
        job_id = submit_ingest(runtime.queue, runtime.jobs, runtime.order, CORPUS)
        queued = httpx.get(url, timeout=5).text
        assert worker.run_once() == 1
        done = httpx.get(url, timeout=5).text
    finally:
        server.shutdown()

    status = runtime.jobs.get(job_id)
    assert status is not None and status.status == "done"
    assert sample(queued, "kvstitch_ingest_pending") == 1
    assert sample(done, "kvstitch_ingest_pending") == 0
    assert sample(done, 'kvstitch_ingest_jobs_total{status="done"}') == 1
    assert sample(done, 'kvstitch_ingest_jobs_total{status="failed"}') == 0
    assert sample(done, 'kvstitch_ingest_chunks_total{kv="precomputed"}') == status.chunks_precomputed > 0
    assert sample(done, 'kvstitch_tier_bytes{kind="used",tier="disk"}') > 0


def test_no_port_no_metrics_server(runtime: Runtime) -> None:
    assert serve_metrics(runtime.settings, runtime, runtime_worker(runtime, name="quiet")) is None


def test_a_job_is_counted_before_its_status_says_done(runtime: Runtime) -> None:
    """A client that reads `done` and then scrapes must find the job counted (the flaky API metrics test of
    issue 29): the hook runs while the status still says `running`, and the status says `done` after it."""
    job_id = submit_ingest(runtime.queue, runtime.jobs, runtime.order, CORPUS)
    worker = runtime_worker(runtime, name="order-test", poll_ms=50)
    seen: list[tuple[str, str | None]] = []

    def record(outcome: str, counts: object) -> None:
        status = runtime.jobs.get(job_id)
        seen.append((outcome, status.status if status is not None else None))

    worker.on_job_finished = record
    assert worker.run_once() == 1

    status = runtime.jobs.get(job_id)
    assert status is not None and status.status == "done"
    assert seen == [("done", "running")]
