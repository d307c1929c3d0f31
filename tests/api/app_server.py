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
    def __init__(self, app: FastAPI) -> None:
        self.app = app
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"the live server did not become ready: {gateway_of(self.app).readiness()}")

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
