"""`kvstitch engine`: one engine (scheduler, GPU/host/disk tiers) serving gateways over an internal HTTP API."""

from __future__ import annotations

import logging
import re
import signal
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from service.commands.logs import serving_logs
from service.settings import Settings

if TYPE_CHECKING:
    from service.engine.engine import StitchEngine
    from service.serving.engine_server import EngineServer

log = logging.getLogger(__name__)

DEFAULT_ENGINE_PORT = 8100
DEFAULT_ENGINE_HOST = "127.0.0.1"
ANY_ADDRESS = ("", "0.0.0.0", "::")


def default_engine_id(port: int) -> str:
    """`HOSTNAME-PORT`, reduced to the characters an engine id may hold (a colon may not: Redis key names use it)."""
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:48] or "engine"
    return f"{host}-{port}"


def engine_url(settings: Settings, host: str, port: int) -> str:
    """Where gateways reach this engine: KVSTITCH_ENGINE_URL, else the address it listens on (127.0.0.1 when it
    listens on every address: set KVSTITCH_ENGINE_URL where gateways run on other hosts)."""
    if settings.engine_url:
        return settings.engine_url.rstrip("/")
    shown = "127.0.0.1" if host in ANY_ADDRESS else host
    return f"http://[{shown}]:{port}" if ":" in shown else f"http://{shown}:{port}"


def run_engine(settings: Settings, host: str | None, port: int | None, engine: StitchEngine | None = None) -> int:
    """Serve the engine API until stopped; over `engine` where the caller built one (a benchmark's random model),
    else over the settings' model."""
    import uvicorn

    from service.api.engine_app import create_engine_app, engine_server_options
    from service.facade.engine import ENGINE_KEEP_ALIVE_S
    from service.serving.engine_server import EngineServer

    if not settings.model:
        print("error: no model: pass --model DIR_OR_HUB_ID or set KVSTITCH_MODEL")
        return 2
    host = host or DEFAULT_ENGINE_HOST
    port = port or DEFAULT_ENGINE_PORT
    engine_id = settings.engine_id or default_engine_id(port)
    url = engine_url(settings, host, port)
    serving_logs()
    published = "tier moves published to Redis" if settings.redis_url else "no Redis: nothing published"
    print(f"kvstitch engine {engine_id} serving {settings.model} on {url} — {published}", flush=True)
    server = EngineServer(settings, engine_id, url, engine)
    if settings.engine_api_process and sys.platform != "win32":  # the link's socket passes by fd: POSIX only
        return serve_from_api_process(server, host, port, round(settings.shutdown_timeout_s))
    app = create_engine_app(server)
    loop, http = engine_server_options()
    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level="info",
        access_log=False,
        timeout_keep_alive=ENGINE_KEEP_ALIVE_S,
        timeout_graceful_shutdown=max(1, round(settings.shutdown_timeout_s)),
        loop=loop,
        http=http,
    )
    return 0


def serve_from_api_process(server: EngineServer, host: str, port: int, graceful_s: int) -> int:
    """Run the engine here and its HTTP API in a second process (`api/engine_front.py`) until that process exits.
    SIGTERM or SIGINT asks the API process to stop: it finishes the streams it has, then exits, and so does this."""
    from service.serving.engine_core import CoreHost

    core_end, front_end = socket.socketpair()
    command = [sys.executable, "-m", "service.api.engine_front", "--fd", str(front_end.fileno())]
    command += ["--host", host, "--port", str(port), "--graceful-s", str(max(1, graceful_s))]
    front = subprocess.Popen(command, pass_fds=[front_end.fileno()])
    front_end.close()
    core = CoreHost(server, Connection(core_end.detach()))
    for stop_signal in (signal.SIGTERM, signal.SIGINT):
        signal.signal(stop_signal, lambda *_: core.stop())
    server.start()
    try:
        core.serve()  # until the API process closes its end
    finally:
        server.close()
        try:
            front.wait(timeout=graceful_s + 10)
        except subprocess.TimeoutExpired:
            front.kill()
    if front.returncode:
        log.error("the engine's API process exited with status %s", front.returncode)
    return 0 if front.returncode in (0, None) else 1
