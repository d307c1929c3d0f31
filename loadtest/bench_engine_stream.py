"""What an engine's internal API costs its event loop per answer, without a model (CPU).

python -m loadtest.bench_engine_stream --clients 128 --tokens 32 --step-ms 12 --duration 10

The engine's event loop and its engine thread share one GIL, so every millisecond the loop spends reading a request
and writing an answer's lines is a millisecond the engine thread cannot launch the next step. This serves
`kvstitch engine`'s own app (`service.api.engine_app`, the same `/answer` route, `EventStream` and mailbox) over a
stand-in engine thread: every `--step-ms` it emits one token to every running answer, as a decode step does, and
ends an answer after `--tokens`. Clients in another process keep `--clients` questions in flight, each with 16
chunks of 520 packed ids as a gateway sends them. With `--api-process` the API runs in a second process as
`kvstitch engine` runs it by default (`CoreHost` here, `api/engine_front.py` there). It reports answers/s and the CPU
per answer of the process holding the engine thread (what the engine thread competes with for the GIL) and of the
API process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import anyio
import httpx

from loadtest.canned_engine import serve_engine_app
from service.api.engine_app import create_engine_app
from service.facade.engine import EngineAnswerRequest, WireChunk, check_vocabulary
from service.facade.types import DoneEvent, TokenEvent
from service.serving.answer_stream import EventStream
from service.serving.engine_core import CoreHost

CHUNKS = 16
CHUNK_TOKENS = 520
VOCAB_SIZE = 152_064  # Qwen2's: the ids the stand-in questions carry are below it


class SteppedSession:
    """An answer session as `EventStream` drives one, whose tokens come from `Stepper`'s thread."""

    def __init__(self, stepper: Stepper, request: EngineAnswerRequest) -> None:
        self._stepper = stepper
        self.tokens_left = request.max_new_tokens
        self.listener: Any = None
        self.done: DoneEvent | None = None
        self.cancelled = False

    def sources(self) -> list[Any]:
        return []

    @property
    def retrieval(self) -> Any:
        return argparse.Namespace(dropped=0)

    def start(self, listener: Any) -> None:
        self.listener = listener
        self._stepper.add(self)

    def cancel(self) -> None:
        self.cancelled = True


class Stepper:
    """The stand-in engine thread: a step every `step_s` emits a token to every running session."""

    def __init__(self, step_s: float) -> None:
        self._step_s = step_s
        self._lock = threading.Lock()
        self._arrived: list[SteppedSession] = []
        self._running: list[SteppedSession] = []
        threading.Thread(target=self._run, name="engine", daemon=True).start()

    def add(self, session: SteppedSession) -> None:
        with self._lock:
            self._arrived.append(session)

    def _run(self) -> None:
        while True:
            time.sleep(self._step_s)  # the GPU's step, the GIL released
            with self._lock:
                self._running += self._arrived
                self._arrived = []
            self._running = [s for s in self._running if self._emit(s)]

    @staticmethod
    def _emit(session: SteppedSession) -> bool:
        if session.cancelled:
            session.listener(None)
            return False
        session.tokens_left -= 1
        session.listener(TokenEvent(" tok"))
        if session.tokens_left > 0:
            return True
        session.done = DoneEvent(
            mode="turbo",
            positions="reordered",
            ttft_ms=1.0,
            output_tokens=1,
            finish_reason="length",
            timings_ms={"queue": 0.0, "prefill": 0.0, "decode": 0.0},
            kv={"gpu": CHUNKS, "host": 0, "disk": 0, "miss": 0},
            answer="",
            prompt_tokens=1,
            context_tokens=1,
        )
        session.listener(session.done)
        session.listener(None)
        return False


class SteppedEngine:
    """The `EngineFacade` parts `/answer` uses, and the `EngineServer` parts `CoreHost` uses, over `Stepper`."""

    def __init__(self, step_s: float) -> None:
        self._stepper = Stepper(step_s)

    def open_answer(self, request: EngineAnswerRequest, vocabulary_checked: bool = False) -> SteppedSession:
        if not vocabulary_checked:  # as the real engine: here in one process, in the API process in two
            check_vocabulary([c.token_ids for c in request.chunks], VOCAB_SIZE)
        return SteppedSession(self._stepper, request)

    def vocab_size(self) -> int:
        return VOCAB_SIZE

    def readiness(self) -> dict[str, Any]:
        return {"ready": True, "checks": {}}

    def info(self) -> dict[str, Any]:
        return {"engine_id": "stepped"}

    def load(self) -> dict[str, int]:
        return {"running": 0, "waiting": 0}

    def tiers(self, limit: int) -> dict[str, Any]:
        return {}

    def metrics_text(self) -> bytes:
        return b""

    def precompute_now(self, chunks: Any) -> dict[str, int]:
        return {}

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass

    async def answer(self, request: EngineAnswerRequest) -> EventStream:
        # the real engine admits on a worker thread (`EngineServer.answer`): so does this one
        session = await anyio.to_thread.run_sync(SteppedSession, self._stepper, request)
        return EventStream(session)  # type: ignore[arg-type]


def serve(port: int, step_s: float, front_pid_file: str | None) -> None:
    cores = os.sched_getaffinity(0)
    if len(cores) > 1:
        os.sched_setaffinity(0, {min(cores)})  # a core of its own, the clients (and an API process) on the others
    if front_pid_file is not None:
        serve_from_api_process(port, step_s, Path(front_pid_file), cores - {min(cores)} or cores)
        return
    serve_engine_app(create_engine_app(SteppedEngine(step_s)), port)  # type: ignore[arg-type]


def serve_from_api_process(port: int, step_s: float, front_pid_file: Path, front_cores: set[int]) -> None:
    """As `kvstitch engine` with KVSTITCH_ENGINE_API_PROCESS: this process the core, the API in another."""
    core_end, front_end = socket.socketpair()
    command = [sys.executable, "-m", "service.api.engine_front", "--fd", str(front_end.fileno())]
    front = subprocess.Popen([*command, "--host", "127.0.0.1", "--port", str(port)], pass_fds=[front_end.fileno()])
    front_end.close()
    os.sched_setaffinity(front.pid, front_cores)
    front_pid_file.write_text(str(front.pid))
    CoreHost(SteppedEngine(step_s), Connection(core_end.detach())).serve()  # type: ignore[arg-type]


def request_body(tokens: int) -> bytes:
    rng = random.Random(0)
    chunks = tuple(
        WireChunk(f"c{i}", "d", 1.0, "text " * 100, tuple(rng.randrange(150_000) for _ in range(CHUNK_TOKENS)))
        for i in range(CHUNKS)
    )
    return EngineAnswerRequest("what is it?", chunks, max_new_tokens=tokens).body()


async def client_loop(url: str, body: bytes, clients: int, duration_s: float) -> dict[str, Any]:
    answers = 0
    lines = 0
    deadline = time.perf_counter() + duration_s
    limits = httpx.Limits(max_connections=None)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:

        async def one() -> None:
            nonlocal answers, lines
            while time.perf_counter() < deadline:
                async with client.stream("POST", url, content=body, headers={"content-type": "application/json"}) as r:
                    r.raise_for_status()
                    async for _ in r.aiter_lines():
                        lines += 1
                answers += 1

        await asyncio.gather(*(one() for _ in range(clients)))
    return {"answers": answers, "lines": lines}


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds of each thread of `pid`, summed by thread name."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--step-ms", type=float, default=12.0)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--port", type=int, default=18431)
    parser.add_argument("--api-process", action="store_true", help="the API in a second process (CoreHost)")
    parser.add_argument("--profile", type=Path, help="py-spy's collapsed stacks of the server over the run")
    args = parser.parse_args()
    front_pid_file = Path(tempfile.mkdtemp()) / "front.pid" if args.api_process else None
    serve_args = (args.port, args.step_ms / 1e3, None if front_pid_file is None else str(front_pid_file))
    server = multiprocessing.get_context("spawn").Process(target=serve, args=serve_args)
    server.start()
    cores = os.sched_getaffinity(0)
    if len(cores) > 1:
        os.sched_setaffinity(0, cores - {min(cores)})
    url = f"http://127.0.0.1:{args.port}/answer"
    body = request_body(args.tokens)
    try:
        for _ in range(100):
            try:
                httpx.get(f"http://127.0.0.1:{args.port}/healthz", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        asyncio.run(client_loop(url, body, min(args.clients, 8), 2.0))  # warm-up
        front_pid = int(front_pid_file.read_text()) if front_pid_file is not None else None
        before = thread_cpu_s(server.pid or 0)
        front_before = thread_cpu_s(front_pid) if front_pid else {}
        spy = None
        if args.profile is not None:
            command = ["py-spy", "record", "-p", str(server.pid), "-f", "raw", "-o", str(args.profile), "-r", "200"]
            command += ["-d", str(int(args.duration)), "--threads", "--nonblocking"]
            spy = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        started = time.perf_counter()
        counts = asyncio.run(client_loop(url, body, args.clients, args.duration))
        elapsed = time.perf_counter() - started
        after = thread_cpu_s(server.pid or 0)
        front_after = thread_cpu_s(front_pid) if front_pid else {}
        if spy is not None:
            spy.wait()
    finally:
        server.terminate()
        server.join()
    answers = max(1, counts["answers"])
    per_answer = {name: round((after[name] - before.get(name, 0.0)) / answers * 1e6) for name in after}
    front_cpu = sum(front_after.values()) - sum(front_before.values())
    report = {
        "clients": args.clients,
        "answers_per_s": round(counts["answers"] / elapsed, 1),
        "lines": counts["lines"],
        "core_process_cpu_us_per_answer": sum(per_answer.values()),
        "api_process_cpu_us_per_answer": round(front_cpu / answers * 1e6) if front_pid_file else None,
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
