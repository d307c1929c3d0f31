"""`kvstitch serve`: the gateway with everything it needs in one process (embedded default) or beside Redis."""

from __future__ import annotations

import logging

from service.settings import Settings


def serve(settings: Settings) -> int:
    import uvicorn

    from service.api.app import create_app
    from service.api.connections import ConnectionLimits, limit_log_floods, raise_fd_limit, server_options
    from service.serving.runtime import hold_data_dir
    from service.serving.server import Server
    from workers.worker import in_process_worker

    if not settings.model:
        print("error: no model: pass --model DIR_OR_HUB_ID or set KVSTITCH_MODEL")
        return 2
    # Before the port opens and the model loads: a data dir in use ends here with one line (DataDirInUseError,
    # reported by the CLI), not with a server answering 503 forever. Held until the process ends.
    data_dir_lock = hold_data_dir(settings)
    logging.getLogger().setLevel(logging.INFO)
    form = "embedded (local Qdrant and index)" if settings.embedded else "distributed (Redis)"
    form += ", in-process ingest worker" if settings.worker_in_process else ", workers run as `kvstitch worker`"
    print(f"kvstitch serving {settings.model} on http://{settings.host}:{settings.port} — {form}", flush=True)
    app = create_app(Server(settings, worker_factory=in_process_worker))
    # SIGTERM: open requests get the shutdown timeout, then the runtime gives the worker as long to hand back its
    # job (`Runtime.close`), so the process is gone within about twice the setting whatever is running.
    limits = ConnectionLimits(
        settings.max_connections, settings.header_timeout_s, settings.body_timeout_s, settings.keep_alive_s
    )
    raise_fd_limit(limits)
    limit_log_floods()
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level="info",
        access_log=False,  # the app writes each request's line itself, with its id (service/api/request_id.py)
        timeout_graceful_shutdown=max(1, round(settings.shutdown_timeout_s)),
        **server_options(limits),
    )
    if data_dir_lock is not None:
        data_dir_lock.release()
    return 0
