"""The one command: `kvstitch serve` as a real process, fed by `kvstitch ingest` and asked by `kvstitch ask`."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import time
import unicodedata
from pathlib import Path

import httpx

from service.commands.ask import print_events, sse_events
from service.devtools.ports import free_port

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
    # The two chunks' KV came from disk, or from the host tier where the answer's read ahead landed it first.
    tiers = re.search(r"KV tiers: gpu=0 host=(\d) disk=(\d) miss=0", asked.stdout)
    assert "TTFT" in asked.stdout and tiers is not None and int(tiers[1]) + int(tiers[2]) == 2, asked.stdout
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


def test_ask_prints_no_control_characters_but_newlines_and_tabs() -> None:
    # The body a server could send: JSON escapes let any character through (ESC sequences, CR, BEL, C1, DEL).
    events = [
        ("retrieval", {"chunks": [{"doc_id": "evil\x1b]0;owned\x07.md", "score": 0.5}], "dropped": 0}),
        ("token", {"text": "red\x1b[31m text\r\n"}),
        ("token", {"text": "\tcleared\x1b[2J\x9b\x7f\x00 end\x08"}),
        ("done", {"kv": {"gpu": 0}, "timings_ms": {"load": 1.0}, "ttft_ms": 2.0, "mode": "turbo\x1b[0m",
                  "output_tokens": 2}),
    ]  # fmt: skip
    lines = [line for name, data in events for line in (f"event: {name}", f"data: {json.dumps(data)}", "")]
    out = io.StringIO()

    assert print_events(sse_events(iter(lines)), out) == 0

    printed = out.getvalue()
    assert printed.startswith("[sources: evil]0;owned.md (0.50)]\nred[31m text\n\tcleared[2J end\n\nTTFT 2.0 ms")
    assert "(turbo[0m)" in printed
    assert not [c for c in printed if unicodedata.category(c) == "Cc" and c not in "\n\t"]


def test_a_data_dir_in_use_stops_a_second_serve_and_ingest_with_one_line(
    tiny_model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    env = {**os.environ, "KVSTITCH_DEVICE": "cpu", "KVSTITCH_HOST_CACHE_MB": "8"}
    env.pop("KVSTITCH_REDIS_URL", None)
    env.pop("KVSTITCH_QDRANT_URL", None)
    model, data_dir, port = str(tiny_model_dirs["qwen2"]), tmp_path / "data", free_port()
    (tmp_path / "note.txt").write_text("Sea otters hold hands while they sleep.\n", encoding="utf-8")
    log = (tmp_path / "serve.log").open("w")
    first = subprocess.Popen(
        [sys.executable, "-m", "service", "serve", "--model", model, "--data-dir", str(data_dir), "--port", str(port)],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        _wait_ready(f"http://127.0.0.1:{port}", first, tmp_path / "serve.log")
        started = time.monotonic()
        second = _kvstitch("serve", "--model", model, "--data-dir", str(data_dir), "--port", str(free_port()), env=env)
        embedded = _kvstitch("ingest", "--embedded", "--model", model, "--data-dir", str(data_dir),
                             str(tmp_path / "note.txt"), env=env)  # fmt: skip
        elapsed = time.monotonic() - started
        still_ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5).status_code
    finally:
        first.send_signal(signal.SIGINT)
        first.wait(timeout=60)
        log.close()

    expected = f"kvstitch: data dir {data_dir.resolve()} is in use by another kvstitch process (pid {first.pid})"
    for result in (second, embedded):
        assert result.returncode == 1, result.stderr
        assert result.stderr.strip().splitlines() == [expected]
        assert "Traceback" not in result.stdout + result.stderr
    assert elapsed < 60  # both gave up at once: neither loaded the model nor waited for anything
    assert still_ready == 200 and first.returncode == 0
    # the lock went with the first process: the data dir is free again
    again = _kvstitch("ingest", "--embedded", "--model", model, "--data-dir", str(data_dir),
                      str(tmp_path / "note.txt"), env=env)  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert "done — 1 documents" in again.stdout
