"""A real Redis (the KV index, queue and job statuses) stopping and coming back: /readyz names it, /ask answers 503,
and service resumes by itself once Redis is back. (Blocks already in the GPU or host tier are still served while
the index is away; this test's blocks are only on disk, so the request needs the index.)"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from api_support import QUESTION, ingest
from app_server import MakeApp, wait_ready
from fastapi.testclient import TestClient

from tests.ports import free_port

REDIS_SERVER = shutil.which("redis-server")


class RedisProcess:
    """A private redis-server on a free port, without persistence, that a test may stop and start again."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        assert REDIS_SERVER is not None
        command = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self.process = subprocess.Popen(command, cwd=self.workdir, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise AssertionError("redis-server did not start")

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)
            self.process = None


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[RedisProcess]:
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed")
    server = RedisProcess(tmp_path)
    server.start()
    yield server
    server.stop()


def test_redis_going_away_gives_503_then_service_resumes(make_app: MakeApp, private_redis: RedisProcess) -> None:
    app = make_app(redis_url=private_redis.url)
    with TestClient(app) as client:
        wait_ready(app)
        assert ingest(client)["status"] == "done"  # the chunks' KV is on disk, listed in the Redis index only
        body = {"question": QUESTION, "stream": False, "max_new_tokens": 2}

        private_redis.stop()
        ready = client.get("/readyz")
        asked = client.post("/ask", json=body)
        queued = client.post("/ingest", json={"documents": [{"id": "late", "text": "Arrives while Redis is down."}]})

        assert ready.status_code == 503 and ready.json()["checks"]["index"].startswith("unreachable")
        assert asked.status_code == 503 and "KV index is unreachable" in asked.json()["detail"]
        assert queued.status_code == 503 and "job queue is unreachable" in queued.json()["detail"]

        private_redis.start()  # empty: no persistence, so every block is a miss and is computed again
        deadline = time.monotonic() + 30
        while client.get("/readyz").status_code != 200:
            assert time.monotonic() < deadline, client.get("/readyz").json()
            time.sleep(0.2)
        again = client.post("/ask", json=body)

        assert again.status_code == 200
        assert again.json()["kv"]["miss"] == len(again.json()["chunks"]) > 0
        assert ingest(client, [{"id": "late", "text": "Arrives after Redis is back."}])["status"] == "done"
