"""A real Redis (the KV index, queue and job statuses) stopping and coming back: /readyz names it, /ask answers 503,
and service resumes by itself once Redis is back. (Blocks already in the GPU or host tier are still served while
the index is away; this test's blocks are only on disk, so the request needs the index.)"""

from __future__ import annotations

import logging
import math
import re
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

from service.devtools.ports import free_port

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


def test_an_outage_is_logged_once_counted_and_its_end_logged(
    make_app: MakeApp, private_redis: RedisProcess, caplog: pytest.LogCaptureFixture
) -> None:
    """Blocks in the host tier are served while Redis is away, and each answer queues an index touch that fails:
    one warning for the outage, every failure counted in the metrics, one line when Redis is back."""
    app = make_app(redis_url=private_redis.url)
    with TestClient(app) as client:
        wait_ready(app)
        assert ingest(client)["status"] == "done"
        body = {"question": QUESTION, "stream": False, "max_new_tokens": 2}
        kv = client.post("/ask", json=body).json()["kv"]
        assert kv["disk"] + kv["host"] > 0  # now in the host tier too (read there or read ahead)

        private_redis.stop()
        with caplog.at_level(logging.WARNING):
            for _ in range(OUTAGE_ASKS):
                reply = client.post("/ask", json=body)
                assert reply.status_code == 200 and reply.json()["kv"]["host"] > 0, reply.text
            errors = _wait_for_metric(client, 'kvstitch_kv_write_errors_total{reason="index"}', OUTAGE_ASKS)
            outage_log = _writeback_records(caplog)

            time.sleep(1.5)  # the worker polls the queue once a second
            private_redis.start()
            assert client.post("/ask", json=body).status_code == 200
            deadline = time.monotonic() + 30
            while len(_writeback_records(caplog)) == len(outage_log) or not _recovered(caplog, "workers.worker"):
                assert time.monotonic() < deadline, "no recovery line"
                time.sleep(0.05)
            after = _writeback_records(caplog)
            worker = [r for r in caplog.records if r.name == "workers.worker" and r.levelno >= logging.WARNING]

    assert errors == OUTAGE_ASKS
    (warning,) = outage_log
    assert warning.levelno == logging.WARNING and warning.exc_info is None
    assert "KV index update failed: ConnectionError" in warning.getMessage()
    (recovered,) = after[len(outage_log) :]
    assert recovered.getMessage() == f"KV index update recovered after {OUTAGE_ASKS} failures"
    # The in-process worker's queue polls failed all along (once a second): one warning and one recovery line too.
    assert [r.exc_info for r in worker] == [None, None], [r.getMessage() for r in worker]
    assert "the job queue failed: ConnectionError" in worker[0].getMessage()
    assert re.fullmatch(r"ingest worker .*: the job queue recovered after \d+ failures", worker[1].getMessage())


OUTAGE_ASKS = 5


def _recovered(caplog: pytest.LogCaptureFixture, logger: str) -> bool:
    return any(r.name == logger and "recovered after" in r.getMessage() for r in caplog.records)


def _writeback_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "service.kvcache.writeback"]


def _wait_for_metric(client: TestClient, sample: str, expected: float, timeout_s: float = 30) -> float:
    """The sample's value once it reaches `expected` (the touches fail on the write-back thread, a bit later)."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = client.get("/metrics")
        assert metrics.status_code == 200, metrics.text
        values = [float(line.rsplit(" ", 1)[1]) for line in metrics.text.splitlines() if line.startswith(sample)]
        if (values and values[0] >= expected) or time.monotonic() > deadline:
            return values[0] if values else math.nan
        time.sleep(0.05)
