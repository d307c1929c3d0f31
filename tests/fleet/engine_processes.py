"""Helpers of the fleet's process tests: `kvstitch engine` processes on loopback, started and stopped by the tests,
and the HTTP helpers the tests share (ingest and wait, SSE events)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import httpx

from service.commands.engine import default_engine_id

ROOT = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 120.0
# Small tiers and pools: CPU engines of the tiny model.
ENGINE_ENV = {
    "KVSTITCH_DEVICE": "cpu",
    "KVSTITCH_GPU_CACHE_MB": "0",
    "KVSTITCH_HOST_CACHE_MB": "8",
    "KVSTITCH_DISK_CACHE_MB": "512",
    "KVSTITCH_KV_POOL_MB": "16",
    "KVSTITCH_MAX_PRECOMPUTE_TOKENS": "256",
    "KVSTITCH_GATE_ON_START": "false",  # the gate is tested elsewhere; each engine would pay for it at start
}


class EngineProcess:
    """One `python -m service engine` on 127.0.0.1:`port`, its output in `log_path`. Without Redis in `env` an
    engine takes no id of its own (it publishes nothing): it goes by its default, `HOSTNAME-PORT`."""

    def __init__(self, engine_id: str, port: int, log_path: Path, env: dict[str, str]) -> None:
        self.engine_id = engine_id if "KVSTITCH_REDIS_URL" in env else default_engine_id(port)
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        command = [sys.executable, "-m", "service", "engine", "--host", "127.0.0.1", "--port", str(port)]
        full_env = {**os.environ, **ENGINE_ENV, **env, "PYTHONPATH": str(ROOT)}
        if "KVSTITCH_REDIS_URL" in env:
            full_env["KVSTITCH_ENGINE_ID"] = engine_id
        self._log = log_path.open("wb")
        self.process = subprocess.Popen(command, env=full_env, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"engine {self.engine_id} exited: {self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"engine {self.engine_id} not ready: {self.log_path.read_text()[-3000:]}")

    def kill(self) -> None:
        """SIGKILL: no clean stop, no retirement from Redis (what a crash or an OOM kill leaves)."""
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


def start_engines(specs: list[tuple[str, int, dict[str, str]]], log_dir: Path) -> list[EngineProcess]:
    """Start every engine at once (their start-ups overlap each other and whatever the caller does next)."""
    return [EngineProcess(i, port, log_dir / f"{i}.log", env) for i, port, env in specs]


def wait_ready(engines: list[EngineProcess]) -> None:
    """Wait for every engine to be ready; stop them all when one fails."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    try:
        for engine in engines:
            engine.wait_ready(deadline)
    except BaseException:
        for engine in engines:
            engine.stop()
        raise


def ingest(client: Any, documents: list[dict[str, Any]], timeout_s: float = 60) -> None:
    reply = client.post("/ingest", json={"documents": documents})
    assert reply.status_code == 202, reply.text
    job_id = reply.json()["job_id"]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = client.get(f"/ingest/{job_id}").json()
        if status["status"] in ("done", "failed"):
            assert status["status"] == "done", status
            return
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} did not finish")


def sse(lines: Iterable[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(event, data) pairs of a text/event-stream body."""
    event = None
    for line in lines:
        if line.startswith("event:"):
            event = line.partition(":")[2].strip()
        elif line.startswith("data:") and event is not None:
            yield event, json.loads(line.partition(":")[2].strip())
            event = None
