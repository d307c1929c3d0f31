"""The gateway's own cost per answer: the real gateway in front of an engine that costs nothing.

    python -m loadtest.bench_gateway --out $OUT --concurrency 16 64 128 --duration 15 --profile

The gateway is `kvstitch serve` in gateway mode (`KVSTITCH_ENGINES=URL`), served by uvicorn with the production
server options (`service.api.connections`: the guarded h11 protocol) and the production log level (a line per
request, written to `gateway.log` under --out), over the tiny model's shell (`service.devtools.tiny_model`: tokenizer,
template, key space) with the bundled MiniLM question embedder in a child process, the embedded Qdrant and the
in-process ingest worker: everything a gateway does per answer (retrieval, routing, the engine client, SSE, metrics,
logging) but the engine's work. Behind it a canned engine (`CannedEngine`, in its own process): `kvstitch engine`'s
internal API (`service.api.engine_app`, the same wire encoder) answering every question at once with `--tokens`
canned tokens, or one every `--token-interval-ms`.

Clients run in a third process (`loadtest.load`): one ingestion of a generated corpus, then per concurrency level an
untimed warm-up and a timed run. Per level: answers/s, tokens/s, client TTFT p50, errors, and the CPU each process
spent per answer (the gateway's split by thread, from /proc). With `--profile` py-spy samples the last level's timed
run (`loadtest.stack_sampler`): per gateway thread, its top functions in µs of CPU per answer.
Writes `report.json` and `profile.txt` under --out and prints the table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from loadtest import load
from loadtest.canned_engine import CANNED_TOKEN, CannedConfig, serve_canned_engine
from loadtest.proc_cpu import CpuSnapshot, cpu_snapshot, cpu_use
from loadtest.stack_sampler import PySpy, find_py_spy, sample_table
from service.api.app import create_app
from service.api.connections import ConnectionLimits, server_options
from service.kvcache.keys import KeySpace
from service.retrieval.batcher import RetrievalBatcher, RetrievalStats
from service.serving.server import Server
from service.settings import Settings
from workers.worker import in_process_worker

log = logging.getLogger("bench_gateway")
REPO = Path(__file__).resolve().parent.parent
READY_TIMEOUT_S = 300.0


# ---- the gateway (this process) -----------------------------------------------------------------------------


class GatewayThread:
    """uvicorn serving the gateway on a thread of its own, with `kvstitch serve`'s server options; `loop` is its
    event loop once it runs."""

    def __init__(self, app: Any, port: int) -> None:
        options = server_options(ConnectionLimits())
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="info", access_log=False, **options)
        self.server = uvicorn.Server(config)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name="gateway-loop", daemon=True)
        self.url = f"http://127.0.0.1:{port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.server.serve())

    def __enter__(self) -> GatewayThread:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)


def gateway_settings(args: argparse.Namespace, engine_url: str) -> Settings:
    return Settings(
        model=str(args.model),
        engines=engine_url,
        device="cpu",
        data_dir=args.data_dir,
        embedding_model=args.embedding_model,
        embedding_process="on",  # as on a GPU host (`auto` means on there): the question embedded in a child
        **({} if args.embedding_processes is None else {"embedding_processes": args.embedding_processes}),
        chunk_size=args.chunk_size,
        chunk_overlap=0,
        default_max_new_tokens=args.tokens,
        max_top_k=max(args.top_k, 1),
        gate_on_start=False,
        host="127.0.0.1",
        port=args.port,
    )


def wait_for(check: Any, what: str, timeout_s: float = READY_TIMEOUT_S) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise TimeoutError(f"{what} not ready after {timeout_s:.0f} s")


def gateway_ready(url: str) -> bool:
    try:
        state = httpx.get(f"{url}/readyz", timeout=5).json()
    except httpx.HTTPError:
        return False
    startup = state.get("checks", {}).get("startup")
    if startup not in (None, "loading", "ok"):
        raise RuntimeError(f"gateway start-up failed: {state}")
    return bool(state.get("ready"))


# ---- CPU accounting (loadtest.proc_cpu) ---------------------------------------------------------------------


def cpu_ms_per_answer(before: CpuSnapshot, after: CpuSnapshot, answers: int) -> dict[str, Any]:
    """Each process's CPU (and the gateway's per thread, by name) over a run, in ms per answer."""
    use = cpu_use(before, after, answers)
    processes = {role: (found or {}).get("ms_per_answer", 0.0) for role, found in use["processes"].items()}
    return {"processes": processes, "gateway_threads": {k: v["ms_per_answer"] for k, v in use["threads"].items()}}


def child_pids(clients: int) -> dict[str, list[int]]:
    """This process's live children by what they run (the question embedder's, the canned engine, the clients)."""
    children = {"clients": [clients]}
    for child in multiprocessing.active_children():
        if child.pid is not None and child.pid != clients:
            children.setdefault(child.name, []).append(child.pid)
    return children


# ---- the clients (a second process) -------------------------------------------------------------------------


def client_ingest(url: str, topics: int, sentences: int, seed: int) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)

    async def run() -> int:
        async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(load.REQUEST_TIMEOUT_S)) as client:
            return await load.ingest(client, load.corpus(topics, sentences, seed))

    return asyncio.run(run())


def client_drive(config: load.LoadConfig) -> tuple[list[load.Result], float]:
    logging.getLogger("httpx").setLevel(logging.WARNING)

    async def run() -> tuple[list[load.Result], float]:
        async with load.client_pools(config.url, config.concurrency) as clients:
            return await load.drive(clients, config)

    return asyncio.run(run())


def load_config(args: argparse.Namespace, url: str, clients: int, duration_s: float, requests: int) -> load.LoadConfig:
    return load.LoadConfig(
        url=url,
        out_dir=args.out,
        topics=args.topics,
        sentences_per_topic=args.sentences,
        concurrency=clients,
        duration_s=duration_s,
        max_requests=requests,
        modes=("turbo",),
        zipf_s=1.1,
        top_k=args.top_k,
        max_new_tokens=args.tokens,
        seed=args.seed + clients,
    )


# ---- runs ---------------------------------------------------------------------------------------------------


@dataclass
class LevelReport:
    concurrency: int
    answers: int
    errors: int
    refused: int
    duration_s: float
    answers_per_s: float
    tokens_per_s: float
    ttft_p50_ms: float
    complete: int  # answers whose streamed text is the canned answer, whole
    token_events_per_answer: float
    cpu_ms_per_answer: dict[str, Any] = field(default_factory=dict)
    retrieval: dict[str, float] = field(default_factory=dict)  # `retrieval_summary` of the timed run
    first_errors: list[str] = field(default_factory=list)


def retrieval_summary(before: RetrievalStats, after: RetrievalStats) -> dict[str, float]:
    """The retrieval batcher over a run: questions per round (the embedder's batch) and a question's mean ms
    waiting for the round before its own, embedding and searching."""
    questions = max(after.questions - before.questions, 1)
    rounds = max(after.rounds - before.rounds, 1)
    summary = {"questions_per_round": round(questions / rounds, 2)}
    for stage, seconds in after.seconds().items():
        summary[f"{stage}_ms"] = round((seconds - before.seconds()[stage]) * 1e3 / questions, 2)
    return summary


def level_report(
    clients: int,
    results: list[load.Result],
    duration_s: float,
    tokens: int,
    cpu: dict[str, Any],
    retrieval: dict[str, float],
) -> LevelReport:
    ok = [r for r in results if r.error is None]
    failed = [r for r in results if r.error is not None]
    ttft = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    expected = CANNED_TOKEN * tokens
    return LevelReport(
        concurrency=clients,
        answers=len(ok),
        errors=sum(not r.refused for r in failed),
        refused=sum(r.refused for r in failed),
        duration_s=round(duration_s, 3),
        answers_per_s=round(len(ok) / duration_s, 2),
        tokens_per_s=round(sum(r.output_tokens for r in ok) / duration_s, 1),
        ttft_p50_ms=round(load.percentile(ttft, 0.5), 2),
        complete=sum(r.output_tokens == tokens and r.text == expected for r in ok),
        token_events_per_answer=round(sum(r.token_events for r in ok) / max(len(ok), 1), 2),
        cpu_ms_per_answer=cpu,
        retrieval=retrieval,
        first_errors=[r.error for r in failed[:5] if r.error is not None],
    )


def run_level(
    args: argparse.Namespace,
    url: str,
    clients: int,
    pool: ProcessPoolExecutor,
    pids: dict[str, list[int]],
    retrieval: RetrievalBatcher,
    sample: bool,
) -> tuple[LevelReport, str | None]:
    """A warm-up, then a timed run: its report and, when `sample`, the profile of the timed run (py-spy's)."""
    pool.submit(client_drive, load_config(args, url, clients, args.warmup_s, args.max_requests)).result()
    spy = PySpy(args.py_spy, os.getpid(), args.duration, args.out / "py-spy.txt") if sample else None
    before, rounds_before = cpu_snapshot(pids), retrieval.stats()
    results, duration_s = pool.submit(
        client_drive, load_config(args, url, clients, args.duration, args.max_requests)
    ).result()
    after, rounds_after = cpu_snapshot(pids), retrieval.stats()
    answers = sum(r.error is None for r in results)
    cpu = cpu_ms_per_answer(before, after, answers)
    report = level_report(
        clients, results, duration_s, args.tokens, cpu, retrieval_summary(rounds_before, rounds_after)
    )
    log.info("%d clients: %.1f answers/s, %d errors", clients, report.answers_per_s, report.errors)
    if spy is None:
        return report, None
    profile = sample_table(spy.samples(60.0), report.cpu_ms_per_answer["gateway_threads"], args.profile_top)
    return report, f"{clients} clients, {answers} answers (py-spy ran beside them)\n\n{profile}"


@contextmanager
def canned_engine(args: argparse.Namespace, key_space: KeySpace) -> Iterator[str]:
    config = CannedConfig(asdict(key_space), args.tokens, args.token_interval_ms / 1e3)
    spawn = multiprocessing.get_context("spawn")
    process = spawn.Process(target=serve_canned_engine, args=(config, args.engine_port), name="canned-engine")
    process.start()
    url = f"http://127.0.0.1:{args.engine_port}"
    try:
        yield url
    finally:
        process.terminate()
        process.join(timeout=10)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The gateway over the canned engine, the corpus ingested, then each level (the last one sampled with
    --profile)."""
    engine_url = f"http://127.0.0.1:{args.engine_port}"
    gateway = Server(gateway_settings(args, engine_url), worker_factory=in_process_worker)
    pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
    with GatewayThread(create_app(gateway), args.port) as served:
        runtime = wait_for(lambda: gateway.runtime or gateway.startup_error, "the gateway's runtime")
        if isinstance(runtime, str):
            raise RuntimeError(f"gateway start-up failed: {runtime}")
        with canned_engine(args, runtime.store.key_space):
            wait_for(lambda: gateway_ready(served.url), "the gateway")
            chunks = pool.submit(client_ingest, served.url, args.topics, args.sentences, args.seed).result()
            log.info("ingested %d chunks", chunks)
            pids = {"gateway": [os.getpid()], **child_pids(next(iter(pool._processes)))}  # the pool's one worker
            last = len(args.concurrency) - 1
            runs = [
                run_level(args, served.url, clients, pool, pids, runtime.retrieval, args.profile and i == last)
                for i, clients in enumerate(args.concurrency)
            ]
    pool.shutdown()
    return {"chunks": chunks, "levels": [asdict(report) for report, _ in runs], "profile": runs[-1][1]}


def table(levels: list[dict[str, Any]]) -> str:
    head = "| clients | answers | errors | 503 | answers/s | tokens/s | TTFT p50 (ms) | gateway CPU ms/answer "
    head += "| token events/answer |"
    rows = [head, "|" + "---|" * 9]
    for level in levels:
        cpu = level["cpu_ms_per_answer"]["processes"]
        cells = [level["concurrency"], level["answers"], level["errors"], level["refused"], level["answers_per_s"]]
        cells += [
            level["tokens_per_s"],
            level["ttft_p50_ms"],
            cpu.get("gateway", "-"),
            level["token_events_per_answer"],
        ]
        rows.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(rows)


# ---- entry --------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="HF folder; default: the tiny qwen2, built")
    parser.add_argument("--embedding-model", default=None, help="default: the bundled MiniLM")
    parser.add_argument(
        "--embedding-processes", type=int, default=None, help="question-embedder children; default: the setting's"
    )
    parser.add_argument("--tokens", type=int, default=32, help="canned tokens per answer")
    parser.add_argument("--token-interval-ms", type=float, default=0.0, help="0: every token at once")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64, 128])
    parser.add_argument("--duration", type=float, default=15.0, help="seconds of each timed run")
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument("--max-requests", type=int, default=20_000)
    parser.add_argument("--topics", type=int, default=48)
    parser.add_argument("--sentences", type=int, default=20, help="sentences per topic document")
    parser.add_argument("--chunk-size", type=int, default=192, help="cap; the tiny model's context is 4K tokens")
    parser.add_argument("--top-k", type=int, default=16)
    parser.add_argument("--profile", action="store_true", help="sample the last level with py-spy (--py-spy)")
    parser.add_argument("--py-spy", default=None, help="the py-spy executable; default: the one on PATH")
    parser.add_argument("--profile-top", type=int, default=40)
    parser.add_argument("--port", type=int, default=8790, help="the gateway's port")
    parser.add_argument("--engine-port", type=int, default=8791, help="the canned engine's port")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-dir", type=Path, default=Path("/tmp/kvstitch-bench-gateway"))
    parser.add_argument("--out", type=Path, default=Path("loadtest-out/gateway"))
    args = parser.parse_args(argv)
    args.py_spy = find_py_spy(args.py_spy)
    if args.profile and args.py_spy is None:
        parser.error("--profile needs py-spy: pip install py-spy, or pass --py-spy PATH")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    # As `kvstitch serve`: INFO, a line per request (to a file here, not to the terminal).
    log_file = args.out / "gateway.log"
    logging.basicConfig(level=logging.INFO, filename=log_file, format="%(asctime)s %(name)s %(message)s")
    shutil.rmtree(args.data_dir, ignore_errors=True)
    if args.model is None:
        from service.devtools.tiny_model import build_tiny_model

        args.model = build_tiny_model("qwen2", args.data_dir / "tiny-qwen2")
    began = time.perf_counter()
    outcome = run(args)
    text = table(outcome["levels"])
    saved = {"args": {k: str(v) for k, v in vars(args).items()}, "wall_s": round(time.perf_counter() - began, 1)}
    profile = outcome.pop("profile")
    if profile is not None:
        (args.out / "profile.txt").write_text(profile, encoding="utf-8")
    (args.out / "report.json").write_text(json.dumps({**saved, **outcome, "table": text}, indent=2), encoding="utf-8")
    print(text)
    for level in outcome["levels"]:
        print(f"{level['concurrency']} clients, CPU ms per answer: {json.dumps(level['cpu_ms_per_answer'])}")
        print(f"{level['concurrency']} clients, retrieval: {json.dumps(level['retrieval'])}")
        for error in level["first_errors"]:
            print(f"error: {error}", file=sys.stderr)
    if profile is not None:
        print(profile)
    return 1 if any(level["errors"] for level in outcome["levels"]) else 0


if __name__ == "__main__":
    sys.exit(main())
