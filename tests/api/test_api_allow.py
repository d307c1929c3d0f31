"""A 405 names in `Allow` every method its path is served with, not only those of the first route that matched."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from app_server import LiveServer, MakeApp


@pytest.fixture(scope="module")
def server(make_module_app: MakeApp) -> Iterator[LiveServer]:
    with LiveServer(make_module_app()) as live:
        yield live


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("PUT", "/documents/otters", "DELETE, GET"),
        ("POST", "/documents/otters", "DELETE, GET"),
        ("PATCH", "/ingest/job-1", "DELETE, GET"),
        ("PUT", "/ingest/files", "DELETE, GET, POST"),  # POST /ingest/files, GET and DELETE /ingest/{job_id}
        ("GET", "/ask", "POST"),
        ("DELETE", "/documents", "GET"),
        ("GET", "/v1/chat/completions", "POST"),
    ],
)
def test_a_405_allows_every_method_the_path_serves(server: LiveServer, method: str, path: str, allowed: str) -> None:
    reply = httpx.request(method, f"{server.url}{path}")

    assert reply.status_code == 405
    assert reply.headers["allow"] == allowed
    if path.startswith("/v1/"):
        assert reply.json()["error"]["code"] == "method_not_allowed"


def test_the_methods_allowed_are_served(server: LiveServer) -> None:
    """What `Allow` names for /ingest/files is answered by a route, not with another 405."""
    for method in ("GET", "DELETE"):
        assert httpx.request(method, f"{server.url}/ingest/files").status_code == 404  # no job named "files"
