"""The one command: `kvstitch serve` as a real process, fed by `kvstitch ingest` and asked by `kvstitch ask`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.ports import free_port

STARTUP_TIMEOUT_S = 180


def _kvstitch(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "service", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=False)


def test_serve_ingest_and_ask_from_the_command_line(tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "KVSTITCH_CHUNK_SIZE": "48",
        "KVSTITCH_CHUNK_OVERLAP": "8",
        "KVSTITCH_HOST_CACHE_MB": "8",
        "KVSTITCH_DEVICE": "cpu",
    }
    env.pop("KVSTITCH_REDIS_URL", None)
    corpus = tmp_path / "corpus"
    (corpus / "notes").mkdir(parents=True)
    (corpus / "otters.md").write_text("# Otters\n\nSea otters hold hands while they sleep.\n", encoding="utf-8")
    (corpus / "notes" / "volcano.txt").write_text("Mauna Loa is the largest active volcano.\n", encoding="utf-8")
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "service", "serve", "--model", str(tiny_model_dirs["qwen2"]),
         "--data-dir", str(tmp_path / "data"), "--port", str(port)],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        _wait_ready(url, server, tmp_path / "serve.log")

        ingested = _kvstitch("ingest", str(corpus), "--url", url, env=env)
        asked = _kvstitch("ask", "Why do otters hold hands?", "--url", url, "--max-new-tokens", "6", env=env)
        asked_naive = _kvstitch("ask", "Why do otters hold hands?", "--url", url, "--mode", "naive", env=env)
        finished_job = ingested.stdout.split()[1].rstrip(":")  # "job <id>: done — …"
        cancel_finished = _kvstitch("cancel", finished_job, "--url", url, env=env)
        cancel_unknown = _kvstitch("cancel", "no-such-job", "--url", url, env=env)
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(timeout=60)
        log.close()

    assert ingested.returncode == 0, ingested.stderr
    assert "done — 2 documents" in ingested.stdout and "2/2 documents" in ingested.stderr
    assert asked.returncode == 0, asked.stderr
    assert "[sources: corpus/otters.md" in asked.stdout
    assert "TTFT" in asked.stdout and "KV tiers: gpu=0 host=0 disk=2 miss=0" in asked.stdout
    assert "(naive), KV tiers: gpu=0 host=0 disk=0 miss=0" in asked_naive.stdout
    assert cancel_finished.returncode == 1 and "409" in cancel_finished.stderr
    assert f"job {finished_job!r} already finished (done)" in cancel_finished.stderr
    assert cancel_unknown.returncode == 1 and "404" in cancel_unknown.stderr and "no-such-job" in cancel_unknown.stderr
    assert server.returncode == 0


def test_ask_without_a_server_says_it_cannot_connect(tmp_path: Path) -> None:
    result = _kvstitch("ask", "hello", "--url", f"http://127.0.0.1:{free_port()}", env=dict(os.environ))
    assert result.returncode == 1 and "cannot talk to the server" in result.stderr


def _wait_ready(url: str, server: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        assert server.poll() is None, f"kvstitch serve exited early:\n{log.read_text()}"
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise AssertionError(f"kvstitch serve did not become ready:\n{log.read_text()}")
