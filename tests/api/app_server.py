"""The app under test as a process would run it: readiness waits and a real uvicorn server on a free port.

Kept out of conftest.py so test modules import it by a name no other test folder uses.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

import httpx
import uvicorn
from fastapi import FastAPI

from service.api.connections import ConnectionLimits, server_options
from service.serving.server import Server

READY_TIMEOUT_S = 120
MakeApp = Callable[..., FastAPI]


def server_of(app: FastAPI) -> Server:
    """The service behind an app under test (the routes see it only as a `Facade`)."""
    server: Server = app.state.facade
    return server


def wait_ready(app: FastAPI) -> None:
    server = server_of(app)
    assert server.started.wait(READY_TIMEOUT_S), "the service did not finish starting"
    assert server.ready, f"the service failed to start: {server.startup_error}"


class LiveServer:
    """The app under a real uvicorn server in a thread, on a socket bound here and handed over (no window for
    another process to take the port); entering waits for /readyz and fails fast when start-up failed."""

    def __init__(self, app: FastAPI, limits: ConnectionLimits | None = None) -> None:
        """`limits`: serve through `kvstitch serve`'s guarded protocol with these connection limits."""
        self.app = app
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        host, self.port = self.listener.getsockname()
        self.url = f"http://{host}:{self.port}"
        options = server_options(limits) if limits is not None else {}
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=self.port, log_level="warning", **options))
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.listener]}, name="live-server", daemon=True
        )

    def __enter__(self) -> LiveServer:
        self.thread.start()
        server = server_of(self.app)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.thread.is_alive(), "the uvicorn server stopped while starting"
            if server.startup_error is not None:
                raise AssertionError(f"the service failed to start: {server.startup_error}")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"the live server did not become ready: {server.readiness()}")

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)
        assert not self.thread.is_alive(), "the uvicorn server did not stop"
