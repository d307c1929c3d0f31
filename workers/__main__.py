"""`python -m workers` (the same as `kvstitch worker`): consume ingest jobs until SIGINT or SIGTERM."""

from __future__ import annotations

import logging
import signal
import sys
from types import FrameType

from service.settings import Settings
from workers.runtime import open_runtime

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
        worker = runtime.worker(name)

        def stop(signum: int, frame: FrameType | None) -> None:
            log.info("signal %d: stopping after the current job", signum)
            worker.stop()

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        print(f"kvstitch worker {worker.config.name} ready (model {settings.model})", flush=True)
        worker.run()
    return 0


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_worker(Settings())


if __name__ == "__main__":
    raise SystemExit(main())
