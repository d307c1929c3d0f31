"""With KVSTITCH_API_KEY set the key is checked from the headers before the body is read, every route but the
probes, the metrics and the chat page needs it (the OpenAPI document too), and no page loads anything from a CDN.
Every answer carries the browser security headers."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from app_server import LiveServer, MakeApp

KEY = "s3cret-key"
GOOD = {"Authorization": f"Bearer {KEY}"}
MIB = 1 << 20


@pytest.fixture(scope="module")
def server(make_module_app: MakeApp) -> Iterator[LiveServer]:
    with LiveServer(make_module_app(api_key=KEY)) as live:
        yield live


def test_a_broken_body_without_the_key_is_a_401_not_a_422(server: LiveServer) -> None:
    headers = {"content-type": "application/json"}
    for path in ("/ask", "/ingest", "/v1/chat/completions"):
        reply = httpx.post(f"{server.url}{path}", content=b'{"question":', headers=headers)
        assert reply.status_code == 401, (path, reply.text)
        assert reply.headers["www-authenticate"] == "Bearer"
    v1 = httpx.post(f"{server.url}/v1/chat/completions", content=b"{", headers=headers).json()
    assert v1["error"]["code"] == "invalid_api_key" and "API key" in v1["error"]["message"]
    with_key = httpx.post(f"{server.url}/ask", content=b'{"question":', headers={**headers, **GOOD})
    assert with_key.status_code == 422  # read and refused as broken JSON once the key is right


def test_a_large_upload_without_the_key_is_refused_before_its_body_is_sent(server: LiveServer) -> None:
    """60 MiB declared, not a byte of it sent: the 401 comes at once and the server closes the connection."""
    head = (
        "POST /ingest/files HTTP/1.1\r\nHost: test\r\nContent-Type: multipart/form-data; boundary=b\r\n"
        f"Content-Length: {60 * MIB}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.settimeout(10)
        sock.sendall(head.encode())
        started = time.monotonic()
        answer = _read_until_closed(sock)
        waited = time.monotonic() - started

    status, _, rest = answer.partition(b"\r\n")
    assert status == b"HTTP/1.1 401 Unauthorized", answer[:200]
    assert b"connection: close" in rest.lower()
    assert waited < 5, f"the connection stayed open {waited:.1f} s waiting for the body"


def test_the_openapi_document_needs_the_key_and_the_cdn_pages_are_off(server: LiveServer) -> None:
    assert httpx.get(f"{server.url}/openapi.json").status_code == 401
    schema = httpx.get(f"{server.url}/openapi.json", headers=GOOD)
    assert schema.status_code == 200 and "/ask" in schema.json()["paths"]
    for page in ("/docs", "/redoc"):
        assert httpx.get(f"{server.url}{page}").status_code == 401
        assert httpx.get(f"{server.url}{page}", headers=GOOD).status_code == 404
    for path in ("/", "/health", "/healthz", "/readyz", "/metrics", "/static/app.js", "/static/style.css"):
        assert httpx.get(f"{server.url}{path}").status_code == 200, path


@pytest.mark.parametrize("path", ["/", "/static/app.js", "/healthz", "/v1/models", "/ask", "/nowhere"])
def test_every_answer_carries_the_security_headers(server: LiveServer, path: str) -> None:
    reply = httpx.get(f"{server.url}{path}", headers=GOOD)

    assert reply.headers["x-frame-options"] == "DENY"
    assert reply.headers["x-content-type-options"] == "nosniff"
    assert reply.headers["referrer-policy"] == "no-referrer"
    policy = dict(part.strip().split(" ", 1) for part in reply.headers["content-security-policy"].split(";"))
    assert policy["script-src"] == "'self'" and policy["default-src"] == "'self'"
    assert policy["frame-ancestors"] == "'none'"


def test_the_chat_page_loads_nothing_from_elsewhere(server: LiveServer) -> None:
    page = httpx.get(f"{server.url}/").text

    assert "http://" not in page and "https://" not in page
    assert "<script>" not in page and "<style>" not in page  # inline code would be refused by the policy


def _read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while True:
        more = sock.recv(65536)
        if not more:
            return data
        data += more
