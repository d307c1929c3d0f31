"""Connections that never finish a request cannot take the service down: over real sockets, thousands of half-open
connections (half a request head each) leave `/healthz` answering within a second and are all closed after the head
timeout; a stalled body is cut after the body timeout; when every connection is busy the next one gets a clear 503;
and running out of file descriptors logs a few lines, not thousands a second."""

from __future__ import annotations

import logging
import os
import selectors
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from app_server import LiveServer, MakeApp

from service.api.connections import ConnectionLimits, RateLimitedLog

ROOT = Path(__file__).resolve().parents[2]
LIMITS = ConnectionLimits(max_connections=50, header_timeout_s=2.0, body_timeout_s=2.0)
HALF_A_HEAD = b"GET /healthz HTTP/1.1\r\nHost: test\r\nX-Slow: "


@pytest.fixture(scope="module")
def server(make_module_app: MakeApp) -> Iterator[LiveServer]:
    with LiveServer(make_module_app(), limits=LIMITS) as live:
        yield live


def test_thousands_of_half_open_connections_leave_healthz_answering(server: LiveServer) -> None:
    sockets = [_half_open(server.port) for _ in range(2000)]
    try:
        started = time.monotonic()
        reply = httpx.get(f"{server.url}/healthz", timeout=5)
        took = time.monotonic() - started
        open_now = len(server.server.server_state.connections)

        closed = _closed_within(sockets, LIMITS.header_timeout_s + 3)
    finally:
        for sock in sockets:
            sock.close()

    assert reply.status_code == 200 and took < 1.0, f"/healthz took {took:.2f} s"
    assert open_now <= LIMITS.max_connections + 5  # descriptors stay bounded whatever the clients do
    assert closed == len(sockets), f"{len(sockets) - closed} half-open connections still open after the timeout"


def test_a_head_that_never_ends_gets_a_408_and_the_connection_closes(server: LiveServer) -> None:
    with _half_open(server.port) as sock:
        started = time.monotonic()
        answer = _read_until_closed(sock, timeout_s=10)
        waited = time.monotonic() - started

    assert answer.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), answer[:100]
    assert LIMITS.header_timeout_s - 0.5 < waited < LIMITS.header_timeout_s + 1.5


def test_a_stalled_body_is_cut_and_busy_connections_are_never_evicted(server: LiveServer) -> None:
    """`max_connections` connections each in the middle of a body: the next connection is refused with a 503 and
    Retry-After (busy requests are not closed to make room); once the bodies stall past the body timeout the
    server closes them and answers again."""
    head = b"POST /ingest HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"
    busy = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(LIMITS.max_connections)]
    try:
        for sock in busy:
            sock.sendall(head)
        time.sleep(0.5)  # every head arrived: the connections wait for their bodies, not for a head
        with socket.create_connection(("127.0.0.1", server.port)) as extra:
            refused = _read_until_closed(extra, timeout_s=5)
        started = time.monotonic()
        closed = _closed_within(busy, LIMITS.body_timeout_s + 3)
        waited = time.monotonic() - started
    finally:
        for sock in busy:
            sock.close()

    assert refused.startswith(b"HTTP/1.1 503 Service Unavailable\r\n"), refused[:100]
    assert b"Retry-After: 1" in refused
    assert closed == len(busy) and waited > LIMITS.body_timeout_s - 1.0
    assert httpx.get(f"{server.url}/healthz", timeout=5).status_code == 200


SERVE_WITH_FEW_FDS = """
import socket, sys
import uvicorn
from service.api.connections import ConnectionLimits, limit_log_floods, server_options

async def app(scope, receive, send):
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

listener = socket.socket(fileno=int(sys.argv[1]))
limits = ConnectionLimits(max_connections=5000, header_timeout_s=30.0)  # over the descriptor limit, on purpose
limit_log_floods()
config = uvicorn.Config(app, log_level="info", lifespan="off", **server_options(limits))
uvicorn.Server(config).run(sockets=[listener])
"""


def test_running_out_of_descriptors_logs_a_few_lines_not_a_flood(tmp_path: Path) -> None:
    """A server allowed 128 descriptors and 300 half-open clients: accept() fails thousands of times a second
    (asyncio logs each with a traceback); a few lines reach the log."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    log_path = tmp_path / "server.log"
    command = f'ulimit -n 128 && exec "{sys.executable}" -c "$0" {listener.fileno()}'
    with log_path.open("w") as log_file:
        child = subprocess.Popen(
            ["bash", "-c", command, SERVE_WITH_FEW_FDS],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            pass_fds=[listener.fileno()],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    listener.close()
    sockets: list[socket.socket] = []
    try:
        _wait_for_http(port)
        sockets = [_half_open(port) for _ in range(300)]
        time.sleep(4)
    finally:
        child.terminate()
        child.wait(10)
        for sock in sockets:
            sock.close()

    text = log_path.read_text()
    failures = text.count("socket.accept() out of system resource")
    assert 1 <= failures <= 3, f"{failures} accept failures logged:\n{text[-2000:]}"
    assert "more like it in the last" not in text or failures > 1
    assert len(text.splitlines()) < 200


def test_a_rate_limited_log_lets_one_line_through_per_interval_and_counts_the_rest() -> None:
    limiter = RateLimitedLog(interval_s=0.3)
    records = [logging.LogRecord("x", logging.ERROR, __file__, 1, "accept failed", None, None) for _ in range(1001)]

    passed = [limiter.filter(record) for record in records[:1000]]
    time.sleep(0.35)
    later = limiter.filter(records[1000])

    assert passed.count(True) == 1 and passed[0]
    assert later and records[1000].getMessage() == "accept failed (999 more like it in the last 0 s not logged)"


def _half_open(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(HALF_A_HEAD)
    return sock


def _closed_within(sockets: list[socket.socket], timeout_s: float) -> int:
    """How many of the sockets the server closed (they read to their end) before `timeout_s` passed."""
    watch = selectors.DefaultSelector()  # epoll: select() cannot take descriptors above 1023
    for sock in sockets:
        watch.register(sock, selectors.EVENT_READ)
    closed = 0
    deadline = time.monotonic() + timeout_s
    while closed < len(sockets) and time.monotonic() < deadline:
        for key, _ in watch.select(timeout=0.1):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            try:
                ended = not sock.recv(65536)
            except ConnectionError:
                ended = True
            if ended:
                watch.unregister(sock)
                closed += 1
    watch.close()
    return closed


def _read_until_closed(sock: socket.socket, timeout_s: float) -> bytes:
    sock.settimeout(timeout_s)
    data = b""
    while more := sock.recv(65536):
        data += more
    return data


def _wait_for_http(port: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise AssertionError("the server did not start")
