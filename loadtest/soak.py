"""Soak: a real `kvstitch serve` (the tiny model) under a bounded, mixed loopback load; does it stay healthy?

For `--duration` seconds `--clients` clients each loop over a mix of requests: streaming `/ask`, non-streaming
`/ask`, `/v1/chat/completions` (streaming or not), streams the client drops after the first token, and ingest
jobs (submitted and followed to the end). Every reply is classified: only 503 with `Retry-After` is an allowed
refusal (the client then waits as told, at most `RETRY_CAP_S`); anything else that is not a success is an error,
recorded by kind. Meanwhile the server process is sampled every `--sample-s` seconds from /proc: resident memory,
open descriptors, threads. The invariants: no errors, resident memory at the end within 10% of what it was after
the warm-up, descriptors and threads at the end within a small slack of their post-warm-up values.

    python -m loadtest.soak --duration 300 --clients 64 --out soak-out

writes `soak-out/soak.json` (the figures and every sample) and prints a summary; exit status 1 when an invariant
fails. `tests/api/test_api_soak.py` runs a 20-second, 8-client version of it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from loadtest.load import corpus, question, sse

KINDS = ("ask_stream", "ask_json", "chat", "chat_stream", "disconnect", "ingest")
WEIGHTS = (30, 20, 15, 10, 15, 10)  # the mix: mostly answers, a share of dropped streams and ingests
RETRY_CAP_S = 2.0  # a refused client waits Retry-After, at most this (the soak is about the server, not patience)
REQUEST_TIMEOUT_S = 120.0
READY_TIMEOUT_S = 240.0
INGEST_WAIT_S = 120.0
RSS_GROWTH_LIMIT = 0.10
FD_SLACK = 16  # descriptors: a few sockets in flight at the moment of a sample
THREAD_SLACK = 8
SERVER_ENV = {  # small, so 2 CPU cores can serve it: short answers, small chunks, little memory
    "KVSTITCH_DEVICE": "cpu",
    "KVSTITCH_CHUNK_SIZE": "96",
    "KVSTITCH_CHUNK_OVERLAP": "16",
    "KVSTITCH_GPU_CACHE_MB": "0",
    "KVSTITCH_HOST_CACHE_MB": "64",
    "KVSTITCH_DEFAULT_MAX_NEW_TOKENS": "16",
    "KVSTITCH_MAX_QUEUE": "16",
}


@dataclass(frozen=True)
class SoakConfig:
    duration_s: float = 300.0
    clients: int = 64
    warmup_s: float = 60.0
    sample_s: float = 5.0
    topics: int = 40
    max_new_tokens: int = 16
    top_k: int = 3
    seed: int = 11
    out_dir: Path = Path("soak-out")
    model: Path | None = None  # a model folder; None: a tiny random Qwen2 written to a temp dir


@dataclass
class Sample:
    t_s: float
    rss_mb: float
    fds: int
    threads: int


@dataclass
class Tally:
    """Outcomes per request kind; errors by kind and reason, the first few in full."""

    ok: Counter[str] = field(default_factory=Counter)
    refused: Counter[str] = field(default_factory=Counter)  # 503 with Retry-After: allowed
    errors: Counter[str] = field(default_factory=Counter)  # "kind: reason"
    examples: list[str] = field(default_factory=list)

    def error(self, kind: str, reason: str, detail: str = "") -> None:
        self.errors[f"{kind}: {reason}"] += 1
        if len(self.examples) < 20:
            self.examples.append(f"{time.strftime('%H:%M:%S')} {kind}: {reason} {detail[:300]}")


class RefusedError(Exception):
    """A 503 with Retry-After: the client waits, it is not an error."""

    def __init__(self, retry_after_s: float) -> None:
        super().__init__(f"503, retry after {retry_after_s} s")
        self.retry_after_s = retry_after_s


class FailedError(Exception):
    """A reply that is neither a success nor an allowed refusal; `reason` is its kind (e.g. "HTTP 500")."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason} {detail}")
        self.reason, self.detail = reason, detail


# ---- the server process ----------------------------------------------------------------------------------------


def start_server(config: SoakConfig, work: Path, port: int) -> subprocess.Popen[bytes]:
    model = config.model or tiny_model(work / "model")
    env = {**os.environ, **SERVER_ENV}
    env.pop("KVSTITCH_REDIS_URL", None)  # the embedded form: everything in this one process
    command = [sys.executable, "-m", "service", "serve", "--model", str(model), "--data-dir", str(work / "data")]
    log = (work / "serve.log").open("wb")
    return subprocess.Popen([*command, "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT)


def tiny_model(path: Path) -> Path:
    command = [sys.executable, "-m", "service", "tiny-model", str(path), "--arch", "qwen2"]
    subprocess.run(command, check=True, capture_output=True, timeout=300)
    return path


async def wait_ready(client: httpx.AsyncClient, server: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"kvstitch serve exited with {server.returncode} before it was ready")
        try:
            if (await client.get("/readyz", timeout=2)).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.5)
    raise TimeoutError(f"kvstitch serve was not ready after {READY_TIMEOUT_S:.0f} s")


def sample(pid: int, t_s: float) -> Sample:
    """Resident memory, open descriptors and threads of a process, from /proc (Linux)."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    rss_kb = int(fields["VmRSS"].split()[0])
    return Sample(t_s, rss_kb / 1024, sum(1 for _ in Path(f"/proc/{pid}/fd").iterdir()), int(fields["Threads"]))


async def watch(pid: int, start: float, every_s: float, samples: list[Sample], stop: asyncio.Event) -> None:
    while not stop.is_set():
        samples.append(sample(pid, time.monotonic() - start))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=every_s)
    samples.append(sample(pid, time.monotonic() - start))


# ---- the requests ----------------------------------------------------------------------------------------------


def check(reply: httpx.Response, body: bytes = b"") -> None:
    """Raise `RefusedError` for a 503 with Retry-After, `FailedError` for any other status that is not 2xx."""
    if reply.status_code < 300:
        return
    retry_after = reply.headers.get("retry-after")
    if reply.status_code == 503 and retry_after is not None:
        raise RefusedError(float(retry_after))
    reason = f"HTTP {reply.status_code}" + (" without Retry-After" if reply.status_code == 503 else "")
    raise FailedError(reason, repr(body))


async def ask_stream(client: httpx.AsyncClient, body: dict[str, Any], drop_after_first: bool = False) -> None:
    async with client.stream("POST", "/ask", json={**body, "stream": True}) as reply:
        check(reply, await reply.aread() if reply.status_code >= 300 else b"")
        seen_done = False
        async for event, data in sse(reply.aiter_lines()):
            if event == "error":
                raise FailedError("error event", data)
            if drop_after_first and event == "token":
                return  # leaving the block closes the connection mid-stream: the server must free the answer
            seen_done = seen_done or event == "done"
        if not seen_done and not drop_after_first:
            raise FailedError("stream ended without done")


async def ask_json(client: httpx.AsyncClient, body: dict[str, Any]) -> None:
    reply = await client.post("/ask", json={**body, "stream": False})
    check(reply, reply.content)
    if "answer" not in reply.json():
        raise FailedError("no answer in the reply", reply.text)


_served: dict[str, str] = {}


async def served_model(client: httpx.AsyncClient) -> str:
    """The model name the server answers to (`/v1/models`; any other is a 404), asked once per server."""
    key = str(client.base_url)
    if key not in _served:
        reply = await client.get("/v1/models")
        check(reply, reply.content)
        _served[key] = str(reply.json()["data"][0]["id"])
    return _served[key]


async def chat(client: httpx.AsyncClient, body: dict[str, Any], stream: bool) -> None:
    request = {
        "model": await served_model(client),
        "messages": [{"role": "user", "content": body["question"]}],
        "max_tokens": body["max_new_tokens"],
        "stream": stream,
        "top_k": body["top_k"],
    }
    if not stream:
        reply = await client.post("/v1/chat/completions", json=request)
        check(reply, reply.content)
        if not reply.json()["choices"]:
            raise FailedError("no choices", reply.text)
        return
    async with client.stream("POST", "/v1/chat/completions", json=request) as reply:
        check(reply, await reply.aread() if reply.status_code >= 300 else b"")
        lines = [line async for line in reply.aiter_lines() if line.startswith("data: ")]
        if not lines or lines[-1] != "data: [DONE]":
            raise FailedError("chat stream ended without [DONE]", repr(lines[-1:]))


async def ingest(client: httpx.AsyncClient, rng: random.Random, client_id: int) -> None:
    """One small job of fresh documents (new ids, so the worker really chunks, computes and publishes)."""
    n = rng.randint(1, 3)
    documents = [
        {"id": f"soak-{client_id}-{rng.randrange(10**9)}", "text": doc["text"] + f" Noted by client {client_id}."}
        for doc in rng.sample(corpus(40, 3, seed=rng.randrange(1000)), n)
    ]
    reply = await client.post("/ingest", json={"documents": documents})
    check(reply, reply.content)
    job_id = reply.json()["job_id"]
    deadline = time.monotonic() + INGEST_WAIT_S
    while time.monotonic() < deadline:
        status = await client.get(f"/ingest/{job_id}")
        check(status, status.content)
        state = status.json()["status"]
        if state == "done":
            return
        if state in ("failed", "cancelled"):
            raise FailedError(f"ingest job {state}", status.json().get("error") or "")
        await asyncio.sleep(0.5)
    raise FailedError("ingest job not done in time", job_id)


async def one_request(client: httpx.AsyncClient, kind: str, rng: random.Random, config: SoakConfig, cid: int) -> None:
    body = {"question": question(rng.randrange(config.topics)), "top_k": config.top_k}
    body["max_new_tokens"] = config.max_new_tokens
    if kind == "ask_stream":
        await ask_stream(client, body)
    elif kind == "disconnect":
        await ask_stream(client, body, drop_after_first=True)
    elif kind == "ask_json":
        await ask_json(client, body)
    elif kind in ("chat", "chat_stream"):
        await chat(client, body, stream=kind == "chat_stream")
    else:
        await ingest(client, rng, cid)


async def soak_client(client: httpx.AsyncClient, cid: int, config: SoakConfig, end: float, tally: Tally) -> None:
    rng = random.Random(config.seed * 1000 + cid)
    while time.monotonic() < end:
        kind = rng.choices(KINDS, WEIGHTS)[0]
        try:
            await one_request(client, kind, rng, config, cid)
            tally.ok[kind] += 1
        except RefusedError as refused:
            tally.refused[kind] += 1
            await asyncio.sleep(min(refused.retry_after_s, RETRY_CAP_S) * rng.uniform(0.5, 1.0))
        except FailedError as failed:
            tally.error(kind, failed.reason, failed.detail)
        except (httpx.HTTPError, ValueError, KeyError) as err:  # transport errors, unreadable replies
            tally.error(kind, type(err).__name__, str(err))


# ---- the run ---------------------------------------------------------------------------------------------------


async def run_soak(config: SoakConfig, url: str, pid: int) -> dict[str, Any]:
    # Idle connections are dropped before uvicorn's 5 s keep-alive closes them: reusing one the server is closing at
    # that moment fails with a read error that says nothing about the server (every HTTP client must do this).
    limits = httpx.Limits(
        max_connections=config.clients + 8, max_keepalive_connections=config.clients + 8, keepalive_expiry=2.0
    )
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        reply = await client.post("/ingest", json={"documents": corpus(config.topics, 4, config.seed)})
        reply.raise_for_status()
        await wait_job(client, reply.json()["job_id"])
        samples: list[Sample] = []
        tally, stop = Tally(), asyncio.Event()
        start = time.monotonic()
        watcher = asyncio.create_task(watch(pid, start, config.sample_s, samples, stop))
        end = start + config.duration_s
        await asyncio.gather(*(soak_client(client, cid, config, end, tally) for cid in range(config.clients)))
        stop.set()
        await watcher
        final = (await client.get("/metrics")).text
    return summarize(config, samples, tally, final)


async def wait_job(client: httpx.AsyncClient, job_id: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        status = (await client.get(f"/ingest/{job_id}")).json()
        if status["status"] == "done":
            return
        if status["status"] in ("failed", "cancelled"):
            raise RuntimeError(f"the soak corpus was not ingested: {status}")
        await asyncio.sleep(0.3)
    raise TimeoutError("the soak corpus was not ingested in time")


def summarize(config: SoakConfig, samples: list[Sample], tally: Tally, metrics: str) -> dict[str, Any]:
    """The figures and the verdict of each invariant."""
    warm = next((s for s in samples if s.t_s >= config.warmup_s), samples[-1])
    # Descriptors and threads are compared while the clients still run (after it, sockets and idle pool threads go
    # and anything would look stable); memory at the very end, its highest point.
    loaded = [s for s in samples if s.t_s <= config.duration_s][-1]
    last = samples[-1]
    growth = (last.rss_mb - warm.rss_mb) / warm.rss_mb
    checks = {
        "no errors": not tally.errors,
        f"RSS growth after warm-up < {RSS_GROWTH_LIMIT:.0%}": growth < RSS_GROWTH_LIMIT,
        f"descriptors stable (end of load <= warm + {FD_SLACK})": loaded.fds <= warm.fds + FD_SLACK,
        f"threads stable (end of load <= warm + {THREAD_SLACK})": loaded.threads <= warm.threads + THREAD_SLACK,
    }
    return {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "requests_ok": dict(tally.ok),
        "refused_503_retry_after": dict(tally.refused),
        "errors": dict(tally.errors),
        "error_examples": tally.examples,
        "rss_mb": {"after_warmup": warm.rss_mb, "end": last.rss_mb, "max": max(s.rss_mb for s in samples)},
        "rss_growth": growth,
        "fds": {
            "after_warmup": warm.fds,
            "end_of_load": loaded.fds,
            "end": last.fds,
            "max": max(s.fds for s in samples),
        },
        "threads": {
            "after_warmup": warm.threads,
            "end_of_load": loaded.threads,
            "end": last.threads,
            "max": max(s.threads for s in samples),
        },
        "client_disconnects": metric_total(metrics, "kvstitch_client_disconnects_total"),
        "checks": checks,
        "passed": all(checks.values()),
        "samples": [asdict(s) for s in samples],
    }


def metric_total(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def soak(config: SoakConfig, port: int) -> dict[str, Any]:
    """Start the server, run the soak against it, stop it (SIGINT, as an operator would); the report."""
    config.out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvstitch-soak-") as tmp:
        server = start_server(config, Path(tmp), port)
        try:
            url = f"http://127.0.0.1:{port}"
            asyncio.run(_ready(url, server))
            report = asyncio.run(run_soak(config, url, server.pid))
        finally:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
            (config.out_dir / "serve.log").write_bytes((Path(tmp) / "serve.log").read_bytes())
    report["server_exit_code"] = server.returncode
    (config.out_dir / "soak.json").write_text(json.dumps(report, indent=2))
    return report


async def _ready(url: str, server: subprocess.Popen[bytes]) -> None:
    async with httpx.AsyncClient(base_url=url) as client:
        await wait_ready(client, server)


def summary(report: dict[str, Any]) -> str:
    rows = [
        f"requests ok: {sum(report['requests_ok'].values())} {report['requests_ok']}",
        f"refused (503 + Retry-After): {sum(report['refused_503_retry_after'].values())}",
        f"errors: {sum(report['errors'].values())} {report['errors']}",
        f"RSS MB after warm-up {report['rss_mb']['after_warmup']:.0f}, end {report['rss_mb']['end']:.0f}, "
        f"max {report['rss_mb']['max']:.0f} (growth {report['rss_growth']:+.1%})",
        f"fds after warm-up {report['fds']['after_warmup']}, end of load {report['fds']['end_of_load']}, "
        f"after it {report['fds']['end']}, max {report['fds']['max']}",
        f"threads after warm-up {report['threads']['after_warmup']}, end of load {report['threads']['end_of_load']}, "
        f"after it {report['threads']['end']}, max {report['threads']['max']}",
        f"client disconnects counted by the server: {report['client_disconnects']:.0f}",
        *(f"{'PASS' if ok else 'FAIL'}  {name}" for name, ok in report["checks"].items()),
    ]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=300.0, help="seconds of load (default 300)")
    parser.add_argument("--clients", type=int, default=64, help="concurrent clients (default 64)")
    parser.add_argument("--warmup", type=float, default=None, help="seconds before the baseline (default 20%%)")
    parser.add_argument("--sample", type=float, default=5.0, help="seconds between /proc samples (default 5)")
    parser.add_argument("--port", type=int, default=8765, help="loopback port of the server (default 8765)")
    parser.add_argument("--model", type=Path, default=None, help="model folder (default: a tiny random Qwen2)")
    parser.add_argument("--out", type=Path, default=Path("soak-out"), help="report folder (default soak-out)")
    args = parser.parse_args(argv)
    if args.duration <= 0 or not 1 <= args.clients <= 1024:
        parser.error("--duration must be positive and --clients between 1 and 1024")
    warmup = args.warmup if args.warmup is not None else args.duration * 0.2
    config = SoakConfig(args.duration, args.clients, warmup, args.sample, out_dir=args.out, model=args.model)
    report = soak(config, args.port)
    print(summary(report))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
