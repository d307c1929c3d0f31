"""`python -m workers` (the same as `kvstitch worker`): consume ingest jobs until SIGINT or SIGTERM."""

from __future__ import annotations

import logging
import signal
import sys
from types import FrameType
from wsgiref.simple_server import WSGIServer

from prometheus_client import start_http_server

from service.metrics import Metrics
from service.runtime import Runtime, open_runtime
from service.settings import Settings
from workers.worker import IngestWorker, runtime_worker

log = logging.getLogger(__name__)


def run_worker(settings: Settings, name: str | None = None) -> int:
    """Open the runtime and work; a signal lets the current job finish (a SIGKILL is recovered by others)."""
    if settings.redis_url is None:
        print(
            "error: a separate worker needs KVSTITCH_REDIS_URL (the queue it reads); without Redis, "
            "`kvstitch serve` runs the worker in-process",
            file=sys.stderr,
        )
        return 2
    with open_runtime(settings) as runtime:
        worker = runtime_worker(runtime, name)
        metrics_server = serve_metrics(settings, runtime, worker)

        def stop(signum: int, frame: FrameType | None) -> None:
            log.info("signal %d: stopping after the current job", signum)
            worker.stop()

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        print(f"kvstitch worker {worker.config.name} ready (model {settings.model})", flush=True)
        worker.run()
        if metrics_server is not None:
            metrics_server.shutdown()
    return 0


def serve_metrics(settings: Settings, runtime: Runtime, worker: IngestWorker) -> WSGIServer | None:
    """Expose this worker's ingest counters, backlog and KV store on `worker_metrics_port` (a daemon thread),
    so Prometheus scrapes each worker as its own target; the server, or None when no port is set."""
    if settings.worker_metrics_port is None:
        return None
    metrics = Metrics()
    metrics.watch_store(runtime.store.stats)
    metrics.watch_ingest_backlog(runtime.queue.pending_count)
    worker.on_job_finished = metrics.ingest_finished
    server, _ = start_http_server(settings.worker_metrics_port, addr=settings.host, registry=metrics.registry)
    log.info("worker metrics on http://%s:%d/metrics", settings.host, settings.worker_metrics_port)
    return server


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_worker(Settings())


if __name__ == "__main__":
    raise SystemExit(main())
