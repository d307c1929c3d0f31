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

from service.api.gateway import Gateway

READY_TIMEOUT_S = 120
MakeApp = Callable[..., FastAPI]


def gateway_of(app: FastAPI) -> Gateway:
    gateway: Gateway = app.state.gateway
    return gateway


def wait_ready(app: FastAPI) -> None:
    gateway = gateway_of(app)
    assert gateway.started.wait(READY_TIMEOUT_S), "the gateway did not finish starting"
    assert gateway.ready, f"the gateway failed to start: {gateway.startup_error}"


class LiveServer:
    """The app under a real uvicorn server in a thread, on a socket bound here and handed over (no window for
    another process to take the port); entering waits for /readyz and fails fast when start-up failed."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        host, self.port = self.listener.getsockname()
        self.url = f"http://{host}:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=self.port, log_level="warning"))
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.listener]}, name="live-server", daemon=True
        )

    def __enter__(self) -> LiveServer:
        self.thread.start()
        gateway = gateway_of(self.app)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.thread.is_alive(), "the uvicorn server stopped while starting"
            if gateway.startup_error is not None:
                raise AssertionError(f"the gateway failed to start: {gateway.startup_error}")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"the live server did not become ready: {gateway.readiness()}")

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)
        assert not self.thread.is_alive(), "the uvicorn server did not stop"
