"""The request body limit (KVSTITCH_MAX_REQUEST_MB) holds for chunked bodies too: 413 while the body is read, in
the route's error shape, and counted under the route."""

from __future__ import annotations

import json
import select
import socket
from collections.abc import Callable, Iterator

from app_server import LiveServer, MakeApp, wait_ready
from fastapi.testclient import TestClient

MIB = 1 << 20


def chunks(total_bytes: int, size: int = 64 * 1024) -> Iterator[bytes]:
    """A JSON body handed over piece by piece, so httpx sends it chunked, without a Content-Length."""
    text = "x" * (total_bytes - 64)
    body = json.dumps({"documents": [{"id": "big", "text": text}]}).encode()
    for start in range(0, len(body), size):
        yield body[start : start + size]


def test_a_chunked_body_over_the_limit_is_a_413_in_the_routes_error_shape(make_app: MakeApp) -> None:
    app = make_app(max_request_mb=1)
    with TestClient(app) as client:
        wait_ready(app)
        headers = {"content-type": "application/json"}

        ingest = client.post("/ingest", content=chunks(2 * MIB), headers=headers)
        chat = client.post("/v1/chat/completions", content=chunks(2 * MIB), headers=headers)
        small = client.post("/ingest", content=chunks(4096), headers=headers)
        metrics = client.get("/metrics").text

    assert "content-length" not in {k.lower() for k in ingest.request.headers}
    assert ingest.status_code == 413 and "KVSTITCH_MAX_REQUEST_MB" in ingest.json()["detail"]
    assert chat.status_code == 413 and chat.json()["error"]["code"] == "request_too_large"
    assert "KVSTITCH_MAX_REQUEST_MB" in chat.json()["error"]["message"]
    assert small.status_code == 202
    assert 'kvstitch_requests_total{route="/ingest",status="413"} 1.0' in metrics


def test_over_the_limit_is_answered_while_the_body_is_sent(live_server: Callable[..., LiveServer]) -> None:
    """Over real sockets, with a 1 MiB limit: a declared 32 MiB body is refused before a byte of it is sent, and a
    chunked 32 MiB body while the client is still sending it."""
    total = 32 * MIB
    piece = b"x" * (64 * 1024)
    frame = b"%x\r\n%s\r\n" % (len(piece), piece)
    head = "POST /ingest HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
    with live_server(max_request_mb=1) as server:
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(f"{head}Content-Length: {total}\r\n\r\n".encode())
            declared = _read_status_line(sock)
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(f"{head}Transfer-Encoding: chunked\r\n\r\n".encode())
            sent = 0
            while sent < total and not _readable(sock):
                sock.sendall(frame)
                sent += len(piece)
            if sent >= total:  # not refused while sending: end the body so the answer comes (and the test fails)
                sock.sendall(b"0\r\n\r\n")
            chunked = _read_status_line(sock)

    assert declared.startswith("HTTP/1.1 413"), declared
    assert sent < total // 2, f"the answer came only after {sent / MIB:.0f} MiB of {total / MIB:.0f} MiB"
    assert chunked.startswith("HTTP/1.1 413"), chunked


def _readable(sock: socket.socket) -> bool:
    readable, _, _ = select.select([sock], [], [], 0)
    return bool(readable)


def _read_status_line(sock: socket.socket, timeout_s: float = 30) -> str:
    sock.settimeout(timeout_s)
    data = b""
    while b"\r\n" not in data:
        more = sock.recv(4096)
        if not more:
            break
        data += more
    return data.split(b"\r\n", 1)[0].decode()
