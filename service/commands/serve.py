"""`kvstitch serve`: the gateway with everything it needs in one process (embedded default) or beside Redis; with
`--engines` it routes questions to engine processes, with `--gpus` it starts one engine per GPU first."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from service.commands.engine import DEFAULT_ENGINE_PORT, default_engine_id
from service.commands.logs import serving_logs
from service.settings import Settings

PR_SET_PDEATHSIG = 1  # prctl(2)
ENGINE_STOP_S = 15.0  # an engine asked to stop (SIGTERM) gets this long before it is killed


def serve(settings: Settings) -> int:
    import uvicorn

    from service.api.app import create_app
    from service.api.connections import ConnectionLimits, limit_log_floods, raise_fd_limit, server_options
    from service.serving.runtime import hold_data_dir
    from service.serving.server import Server
    from workers.worker import in_process_worker

    if not settings.model:
        print("error: no model: pass --model DIR_OR_HUB_ID or set KVSTITCH_MODEL")
        return 2
    # Before the port opens and the model loads: a data dir in use ends here with one line (DataDirInUseError,
    # reported by the CLI), not with a server answering 503 forever. Held until the process ends.
    data_dir_lock = hold_data_dir(settings)
    serving_logs()
    form = "embedded (local Qdrant and index)" if settings.embedded else "distributed (Redis)"
    if settings.gateway:
        form += f", gateway to the engines {settings.engines}"
    form += ", in-process ingest worker" if settings.worker_in_process else ", workers run as `kvstitch worker`"
    print(f"kvstitch serving {settings.model} on http://{settings.host}:{settings.port} — {form}", flush=True)
    app = create_app(Server(settings, worker_factory=in_process_worker))
    # SIGTERM: open requests get the shutdown timeout, then the runtime gives the worker as long to hand back its
    # job (`Runtime.close`), so the process is gone within about twice the setting whatever is running.
    limits = ConnectionLimits(
        settings.max_connections, settings.header_timeout_s, settings.body_timeout_s, settings.keep_alive_s
    )
    raise_fd_limit(limits)
    limit_log_floods()
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level="info",
        access_log=False,  # the app writes each request's line itself, with its id (service/api/request_id.py)
        timeout_graceful_shutdown=max(1, round(settings.shutdown_timeout_s)),
        **server_options(limits),
    )
    if data_dir_lock is not None:
        data_dir_lock.release()
    return 0


def parse_gpus(text: str) -> list[int]:
    """`--gpus 0,1,3` as device numbers; ValueError for anything else."""
    gpus = [int(part) for part in text.split(",") if part.strip()]
    if not gpus or any(not 0 <= g < 1024 for g in gpus) or len(set(gpus)) != len(gpus):
        raise ValueError(f"--gpus {text!r}: distinct device numbers, comma-separated")
    return gpus


def engine_environment(settings: Settings, gpu: int, port: int) -> dict[str, str]:
    """The environment of the engine on `gpu`: this one's settings, its device, id and data dir. With Redis the
    engines share the gateway's data dir (KV files named by the shared Redis index); without, each has its own
    (a SQLite index is one process's)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu), "KVSTITCH_MODEL": settings.model}
    env["KVSTITCH_DEVICE"] = settings.device
    data_dir = settings.data_dir if settings.redis_url else settings.data_dir / f"engine-gpu{gpu}"
    env["KVSTITCH_DATA_DIR"] = str(data_dir)
    env.pop("KVSTITCH_ENGINES", None)
    env.pop("KVSTITCH_ENGINE_URL", None)
    if settings.redis_url:
        env["KVSTITCH_ENGINE_ID"] = f"{default_engine_id(port)}-gpu{gpu}"
    else:
        env.pop("KVSTITCH_ENGINE_ID", None)
    if not settings.gate_on_start:
        env["KVSTITCH_GATE_ON_START"] = "false"
    return env


def start_engines(settings: Settings, gpus: list[int], base_port: int) -> list[tuple[str, subprocess.Popen[bytes]]]:
    """One `kvstitch engine` process per GPU on 127.0.0.1:BASE+N; (url, process) each."""
    started = []
    for gpu in gpus:
        port = base_port + gpu
        command = [sys.executable, "-m", "service", "engine", "--host", "127.0.0.1", "--port", str(port)]
        env = engine_environment(settings, gpu, port)
        process = subprocess.Popen(command, env=env, cwd=Path.cwd(), preexec_fn=_die_with_parent)
        started.append((f"http://127.0.0.1:{port}", process))
    return started


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM when the gateway dies, even by SIGKILL, so no engine outlives it."""
    if sys.platform == "linux":
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def stop_engines(engines: list[tuple[str, subprocess.Popen[bytes]]]) -> None:
    """SIGTERM every engine, wait for them together, then kill the ones still running."""
    for _, process in engines:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + ENGINE_STOP_S
    for _, process in engines:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def serve_gpus(settings: Settings, gpus_text: str, base_port: int | None) -> int:
    """`kvstitch serve --gpus 0,1`: an engine per GPU, this process their gateway; the engines stop with it."""
    try:
        gpus = parse_gpus(gpus_text)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    base = base_port if base_port is not None else DEFAULT_ENGINE_PORT
    if not 1 <= base <= 65535 - max(gpus):
        print(f"error: --engine-port {base}: the engines' ports must stay within 1-65535", file=sys.stderr)
        return 2
    engines = start_engines(settings, gpus, base)
    try:
        # The gateway answers and computes nothing: it keeps a shell of the model (tokenizer, keys; no weights).
        gateway = settings.model_copy(update={"engines": ",".join(url for url, _ in engines)})
        return serve(gateway)
    finally:
        stop_engines(engines)
