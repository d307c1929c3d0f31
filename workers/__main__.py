"""`python -m workers` (the same as `kvstitch worker`): consume ingest jobs until SIGINT or SIGTERM."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from types import FrameType
from wsgiref.simple_server import WSGIServer

from prometheus_client import start_http_server

from service.metrics import Metrics
from service.serving.data_dir_lock import DataDirInUseError
from service.serving.runtime import Runtime, open_runtime
from service.settings import Settings
from workers.worker import IngestWorker, runtime_worker

log = logging.getLogger(__name__)


EXIT_FORCED = 3


def run_worker(settings: Settings, name: str | None = None) -> int:
    """Open the runtime and work; a signal stops the worker between two document groups (its job is handed back
    to the queue) and the process ends within `shutdown_timeout_s` (a SIGKILL is recovered by others)."""
    if settings.redis_url is None:
        print(
            "error: a separate worker needs KVSTITCH_REDIS_URL (the queue it reads); without Redis, "
            "`kvstitch serve` runs the worker in-process",
            file=sys.stderr,
        )
        return 2
    with open_runtime(settings, answers=False) as runtime:
        worker = runtime_worker(runtime, name)
        metrics_server = serve_metrics(settings, runtime, worker)

        def stop(signum: int, frame: FrameType | None) -> None:
            log.info("signal %d: stopping at the next document group; the job goes back to the queue", signum)
            worker.stop()
            watchdog = threading.Timer(settings.shutdown_timeout_s, _exit_now, args=(settings.shutdown_timeout_s,))
            watchdog.daemon = True
            watchdog.start()

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        print(f"kvstitch worker {worker.config.name} ready (model {settings.model})", flush=True)
        worker.run()
        if metrics_server is not None:
            metrics_server.shutdown()
    return 0


def _exit_now(timeout_s: float) -> None:
    """The job did not reach a group boundary in time: leave it pending (not acked), for another worker to claim
    after `job_claim_idle_ms`, as if this process had been killed."""
    log.warning("still busy %.0f s after the signal: exiting now", timeout_s)
    logging.shutdown()
    os._exit(EXIT_FORCED)


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
    try:
        return run_worker(Settings())
    except DataDirInUseError as err:  # as `kvstitch worker` reports it: one line, no traceback
        print(f"kvstitch: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
