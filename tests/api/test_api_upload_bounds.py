"""Uploads that would hold the server: HTML nested past the bound is a 422 at once, and an upload whose client leaves
while its file is read is stopped then and there, and never ingested."""

from __future__ import annotations

import contextlib
import multiprocessing
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from app_server import LiveServer, MakeApp

from service.formats.html import MAX_DEPTH

DEEP_DIVS = b"<!doctype html><html><body>" + b"<div>" * 200_000 + b"deep"
SLOW_PAGE = b"<!doctype html><html><body>" + b"<p>Sea otters <b>hold</b> <a href='x'>hands</a>.</p>\n" * 300_000


@pytest.fixture(scope="module")
def server(make_module_app: MakeApp) -> Iterator[LiveServer]:
    with LiveServer(make_module_app(extract_timeout_s=60)) as live:
        yield live


def test_deeply_nested_html_is_a_422_naming_the_bound_at_once(server: LiveServer) -> None:
    started = time.monotonic()
    reply = httpx.post(f"{server.url}/ingest/files", files={"files": ("deep.html", DEEP_DIVS)}, timeout=60)
    took = time.monotonic() - started

    assert reply.status_code == 422, reply.text
    assert f"deep.html: HTML nested deeper than {MAX_DEPTH} elements" in reply.json()["detail"][0]["msg"]
    assert took < 5.0


def test_an_upload_whose_client_leaves_before_the_202_is_stopped_and_not_ingested(server: LiveServer) -> None:
    boundary = "otterboundary"
    body = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="files"; filename="slow.html"\r\n'
            "Content-Type: text/html\r\n\r\n"
        ).encode()
        + SLOW_PAGE
        + f"\r\n--{boundary}--\r\n".encode()
    )
    head = (
        f"POST /ingest/files HTTP/1.1\r\nHost: test\r\nContent-Type: multipart/form-data; boundary={boundary}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    before, cpu = _upload_statuses(server), _readers_cpu_ticks()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(head + body)
        _wait_for(lambda: _readers_cpu_ticks() > cpu + 20, "a reader to be busy with the file")  # 0.2 CPU-s
        left = time.monotonic()
    _wait_for(lambda: _upload_statuses(server) != before, "the upload to end")
    ended = time.monotonic() - left
    after = _upload_statuses(server)

    assert {s: n - before.get(s, 0.0) for s, n in after.items() if n != before.get(s)} == {"499": 1.0}  # no 202
    assert ended < 2.0 and _readers() == 0  # the reader was killed, not left to finish the 15 MB page
    assert _metric(server, 'kvstitch_ingest_jobs_total{status="submitted"}') == 0.0
    assert httpx.get(f"{server.url}/documents").json()["total"] == 0


def _readers() -> int:
    return sum(child.name == "kvstitch-extract" and child.is_alive() for child in multiprocessing.active_children())


def _readers_cpu_ticks() -> int:
    """CPU time (clock ticks) the reader processes alive now have used."""
    ticks = 0
    for child in multiprocessing.active_children():
        if child.name == "kvstitch-extract" and child.pid is not None:
            with contextlib.suppress(OSError):
                fields = Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()
                ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks


def _upload_statuses(server: LiveServer) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics").text
    found = re.findall(r'^kvstitch_requests_total\{route="/ingest/files",status="(\d+)"\} (\S+)$', text, re.M)
    return {status: float(value) for status, value in found}


def _metric(server: LiveServer, series: str) -> float:
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    raise AssertionError(f"no {series} in /metrics")


def _wait_for(condition: object, what: str, timeout_s: float = 60) -> None:
    assert callable(condition)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")
