"""The fleet benchmark through the real gateway over HTTP: one engine against N (one per GPU), and chunk-aware routing
against round-robin when the corpus's KV outgrows an engine's GPU tier (issue 28).

    python -m loadtest.serve_fleet --out $OUT --gpus 0,1 --phases scale --concurrency 16 64
    python -m loadtest.serve_fleet --out $OUT --gpus 0,1 --phases routing --redis redis://127.0.0.1:6379/0

Engines are separate processes, one per GPU (`CUDA_VISIBLE_DEVICES`): `python -m loadtest.random_engine`, a random
Qwen2-7B-shaped model drawn on the device (`--model DIR` loads a folder instead), serving `kvstitch engine`'s API.
The gateway runs in this process (uvicorn on a background thread, as `serve_random`'s), built from `Settings` in
gateway mode over a shell of the same model (`bench_prefill.random_qwen2_7b_shell` or `load_model_shell`): no
weights, no GPU, the engines' key space. Clients run in other processes (`loadtest.load`), so their work does not
hold the gateway's GIL: `--client-processes K` (default 4) of them, started once; a level's clients split over them
(client j in process j mod K, each process with its own question seed and its share of `--max-requests`), their
timed runs started at one instant and their results merged into one report (the engines' /metrics read here,
before and after). `--gateways N` adds N - 1 gateway processes over the same engines on the next ports
(`loadtest.fleet_gateways`: each with its own embedded Qdrant, the corpus ingested into each, as the fleet's
Kubernetes Deployment runs several gateway pods over one Qdrant server); client i asks through gateway i mod N.

Phases (`--phases`), each a series of configurations, each configuration a fresh gateway over some of the engines
with its own Qdrant collection: the corpus is ingested into it (the gateway has each chunk's KV computed on the
engine it belongs to), then per concurrency level an untimed warm-up and a timed run of Zipf-skewed questions.

- `scale`: all engines, then the first alone, chunk-aware (engines' GPU tier `--gpu-cache-mb`). The issue's
  target: 2 engines >= 1.9x one engine's tokens/s at 64 clients.
- `routing`: all engines, chunk-aware then round-robin (`KVSTITCH_FLEET_ROUTING`), with a GPU tier of
  `--routing-gpu-cache-mb` each, smaller than the corpus's KV: GPU-tier hit ratio and TTFT p50/p99 of both. Routing
  sees where chunks sit only through Redis (the engines publish their tier moves there): without `--redis`
  chunk-aware routing goes by load, ties to the chunk's ingestion engine, and the comparison says little.

With `--redis` the engines and the gateway share one data dir and KV index (one host); without, each engine keeps its
KV files under DATA_DIR/engine-N. Engines restart between phases when their GPU tiers differ.

`--engine-env-b KEY=VALUE ...` repeats the scale phase with the engines restarted with those settings too: an A/B
pair in one run (one lease, one machine), in the report as "1 engine, KEY=VALUE". The B engines keep the A engines'
data dirs, so they find the corpus's KV files on disk instead of computing them at ingestion; each level's warm-up
fills their GPU tier as it filled A's. `--engine-code-b DIR` does the same with engines run from another source tree
(`git archive COMMIT service workers loadtest | tar x -C DIR`; the gateway stays this tree's, so the engine API must
not differ): two versions of the engine in one lease, where two leases of one machine kind differ by more than most
changes do.

Per configuration and concurrency: tokens/s, TTFT p50/p95/p99 (client), errors, 503s, requests per engine and the
engines' GPU-tier hit ratio (from each engine's /metrics: blocks served per tier), and the hit ratio the answers'
`done` events report. Writes `report.json` and `table.md` under --out, and prints the table.

Where the time went (`loadtest.proc_cpu`, from /proc around each timed run; `cpu` in report.json, the second table
of table.md): CPU ms per answer and cores busy (CPU seconds / wall seconds) of the gateway's process, split by thread
group (`event_loop`: uvicorn's thread; `retrieval`: the batcher that embeds and searches; `request_threads`: anyio's
workers, each request's retrieval wait, preparation and routing; `other`: the rest, threads that ended included), of
the question embedder's child (on CUDA: `embedding_process` on), of each engine process of the configuration
(`engine-N`), of the client processes (`clients`, summed) and of any other child of the gateway's process; per
process also its busiest thread's cores. Python threads share their process's GIL: a gateway whose event loop, or
whose Python threads together, sit near 1.0 core is bound by it; an engine whose busiest thread is near 1.0 has a
saturated scheduler; all of them well below 1.0 means the run waits (on the GPU, or on a queue). Client processes
near 1.0 each (`clients` near K cores, its busiest thread near 1.0) would make the clients the wall.

    python -m loadtest.serve_fleet --out $OUT --gpus 0,1 --phases scale --concurrency 64 --profile

`--profile`: py-spy (`loadtest.stack_sampler`; `--py-spy PATH`, else found on PATH, beside this Python or in a
`bin` folder of the import path, as `pip install --target` leaves it) samples the gateway's process and the
configuration's first engine over each configuration's last timed level: per thread, its top functions in µs of
CPU per answer, in `profile.txt` (raw stacks under py-spy/). Without py-spy the runs go on, unprofiled, and the
report says so. The sampling slows what it samples (the gateway and the engine thread are CPU-bound under load), so
the tables mark a profiled level "(py-spy)": take headline figures from a run without `--profile`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import torch

from loadtest import load
from loadtest.fleet_gateways import (
    MAX_GATEWAYS,
    Configuration,
    GatewayReplicas,
    gateway_server,
)
from loadtest.proc_cpu import Watched, cores, cpu_snapshot, cpu_use, group_cores, thread_deltas
from loadtest.serve_random import (
    BackgroundServer,
    chosen_vocabulary,
    clients_ingest,
    machine,
    phase_config,
    question_embedder_pids,
    quiet_logging,
    wait_ready,
)
from loadtest.stack_sampler import NO_PY_SPY, find_py_spy, start_profiles
from service.api.app import create_app
from service.retrieval.embedder import Embedder

log = logging.getLogger("serve_fleet")
REPO = Path(__file__).resolve().parent.parent
ENGINE_READY_TIMEOUT_S = 600.0
ENGINE_STOP_S = 20.0
TIERS = ("gpu", "host", "disk", "miss")


# ---- engines ------------------------------------------------------------------------------------------------


class EngineGroup:
    """The engine processes of one or more phases (one per `--gpus` entry), started together; `stop` ends them."""

    def __init__(
        self,
        args: argparse.Namespace,
        gpu_cache_mb: int,
        redis_prefix: str | None,
        extra_env: tuple[tuple[str, str], ...] = (),
        code: str | None = None,
    ) -> None:
        self.urls: list[str] = []
        self.processes: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []
        self.gpu_cache_mb = gpu_cache_mb
        self.extra_env = extra_env
        self.code = code
        tree = Path(code) if code else REPO  # the source tree the engines run
        for index, gpu in enumerate(args.gpus):
            port = args.engine_port + index
            variant = "-b" if extra_env or code else ""
            log_path = args.out / f"engine-{index}-gpu{gpu_cache_mb}mb{variant}.log"
            command = [sys.executable, "-m", "loadtest.random_engine", "--host", "127.0.0.1", "--port", str(port)]
            command += ["--device", args.device, "--vocabulary", args.vocabulary_used]
            command += ["--model", args.model] if args.model else []
            env = engine_environment(args, index, gpu, gpu_cache_mb, redis_prefix, tree) | dict(extra_env)
            with log_path.open("wb") as out:
                self.processes.append(subprocess.Popen(command, env=env, cwd=tree, stdout=out, stderr=out))
            self.urls.append(f"http://127.0.0.1:{port}")
            self.logs.append(log_path)

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for url, process, log_path in zip(self.urls, self.processes, self.logs, strict=True):
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"engine {url} exited: {log_path.read_text(errors='replace')[-3000:]}")
                try:
                    if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"engine {url} not ready: {log_path.read_text(errors='replace')[-3000:]}")
                time.sleep(0.5)

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        deadline = time.monotonic() + ENGINE_STOP_S
        for process in self.processes:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def engine_environment(
    args: argparse.Namespace,
    index: int,
    gpu: int,
    gpu_cache_mb: int,
    redis_prefix: str | None,
    tree: Path = REPO,
) -> dict[str, str]:
    """Engine `index`'s environment: its GPU, tiers, queue and data dir; with Redis its id, the shared data dir and
    the run's key prefix; `tree`, the source tree it imports first. `--engine-env` entries go last."""
    env = {k: v for k, v in os.environ.items() if k not in ("KVSTITCH_ENGINES", "KVSTITCH_ENGINE_URL")}
    env.update(
        {
            # The repo first, then whatever the caller added (on the GPU machine: the carried wheels' folder).
            "PYTHONPATH": os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH", "")) if p),
            "KVSTITCH_GPU_CACHE_MB": str(gpu_cache_mb),
            "KVSTITCH_HOST_CACHE_MB": str(args.host_cache_mb),
            "KVSTITCH_MAX_QUEUE": str(max(16, 2 * max(args.concurrency + args.routing_concurrency))),
            "KVSTITCH_DEFAULT_MAX_NEW_TOKENS": str(args.max_new_tokens),
            "KVSTITCH_DATA_DIR": str(args.data_dir if redis_prefix else args.data_dir / f"engine-{index}"),
        }
    )
    if args.device == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    if redis_prefix is not None:
        env.update({"KVSTITCH_REDIS_URL": args.redis, "KVSTITCH_REDIS_PREFIX": redis_prefix})
        env["KVSTITCH_ENGINE_ID"] = f"engine{index}-gpu{gpu}"
    else:
        env.pop("KVSTITCH_REDIS_URL", None)
        env.pop("KVSTITCH_ENGINE_ID", None)
    env.update(args.engine_env)
    return env


# ---- the clients (further processes) ------------------------------------------------------------------------

# A client process's question seed: the level's seed plus this times its number (process 0 keeps the level's seed,
# so one process asks what the single clients' process asked; the stride keeps the others off the seeds of other
# levels, which differ by a concurrency).
SEED_STRIDE = 1_000_003
START_LEAD_S = 0.5  # the timed run starts this long after its processes are handed their shares
LATE_START_S = 0.1  # a process that starts later than this is logged
READY_TIMEOUT_S = 300.0  # for every client process to have started (spawned: each imports torch and the service)

_ready: Any = None  # in a client process: the barrier every client process meets at `client_pid`


@dataclass(frozen=True)
class ClientShare:
    """One client process's part of a level: the clients whose global index is its number modulo the processes
    used (`clients`; client j asks gateway j mod N, as `load.gateway_pools` interleaves them), each one's gateway,
    its question seed and its share of the questions."""

    process: int
    clients: tuple[int, ...]
    gateways: tuple[int, ...]
    seed: int
    max_requests: int


def client_shares(clients: int, processes: int, gateways: int, seed: int, max_requests: int) -> list[ClientShare]:
    """A level's clients split over at most `processes` processes: as evenly as possible, none without a client or
    a question (1 client: 1 process); the questions one each, the rest in proportion to the clients (they add up
    to `max_requests`)."""
    if min(clients, processes, gateways, max_requests) < 1:
        raise ValueError("clients, processes, gateways and max_requests must be at least 1")
    used = min(processes, clients, max_requests)
    members = [tuple(range(i, clients, used)) for i in range(used)]
    extra = max_requests - used
    requests, given, done = [], 0, 0
    for share in members:
        given += len(share)
        requests.append(1 + extra * given // clients - done)
        done += requests[-1] - 1
    return [
        ClientShare(i, share, tuple(j % gateways for j in share), seed + i * SEED_STRIDE, n)
        for i, (share, n) in enumerate(zip(members, requests, strict=True))
    ]


def start_clients(count: int) -> tuple[ProcessPoolExecutor, list[int]]:
    """`count` client processes (spawned: no CUDA or threads inherited from the gateway's) and their pids. They are
    started here, all of them: a task for each that waits for the others at a barrier, so that every level's timed
    run finds `count` idle processes, one to each share."""
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(count)
    pool = ProcessPoolExecutor(max_workers=count, mp_context=context, initializer=client_init, initargs=(barrier,))
    try:
        pids = [f.result() for f in [pool.submit(client_pid, READY_TIMEOUT_S) for _ in range(count)]]
    except BaseException:
        pool.shutdown(cancel_futures=True)
        raise
    if len(set(pids)) != count:
        pool.shutdown()
        raise RuntimeError(f"{count} client processes expected, found {sorted(set(pids))}")
    return pool, pids


def client_init(barrier: Any) -> None:
    global _ready
    _ready = barrier


def client_pid(timeout_s: float) -> int:
    """In a client process: its pid, once every client process has started."""
    _ready.wait(timeout_s)
    return os.getpid()


def clients_ingest_all(args: argparse.Namespace, urls: list[str]) -> tuple[int, float]:
    """In a client process: the corpus ingested through every gateway replica (each has its own embedded Qdrant);
    the first one's chunks and the seconds all took. The first gateway goes alone, so that the engines compute
    the corpus's KV once; the others, which find it stored, chunk, embed and write their collections side by side
    (one after another they took most of a large corpus's device time)."""
    began = time.perf_counter()
    chunks = [clients_ingest(args, urls[0])[0]]
    with ThreadPoolExecutor(max_workers=max(1, len(urls) - 1), thread_name_prefix="ingest") as replicas:
        chunks += [count for count, _ in replicas.map(lambda url: clients_ingest(args, url), urls[1:])]
    if len(set(chunks)) != 1:
        raise RuntimeError(f"the gateway replicas ingested different chunk counts: {chunks}")
    return chunks[0], time.perf_counter() - began


def share_config(args: argparse.Namespace, urls: list[str], share: ClientShare, duration_s: float) -> load.LoadConfig:
    config = phase_config(args, urls[0], len(share.clients), duration_s, share.max_requests)
    return replace(config, seed=share.seed)


def level_shares(args: argparse.Namespace, urls: list[str], clients: int, max_requests: int) -> list[ClientShare]:
    """The level's shares over `--client-processes` processes, from the level's seed (`phase_config`'s)."""
    seed = phase_config(args, urls[0], clients, args.duration, max_requests).seed
    return client_shares(clients, args.client_processes, len(urls), seed, max_requests)


def clients_warm_up_all(
    args: argparse.Namespace, urls: list[str], clients: int, pool: ProcessPoolExecutor
) -> tuple[int, list[str]]:
    """A level's untimed warm-up over every replica, its clients split over the client processes; the questions
    asked and the first errors."""
    shares = level_shares(args, urls, clients, args.warmup_requests)
    futures = [pool.submit(clients_warm_up_share, args, urls, share) for share in shares]
    outcomes = [f.result() for f in futures]
    return sum(asked for asked, _ in outcomes), [e for _, errors in outcomes for e in errors][:5]


def clients_warm_up_share(args: argparse.Namespace, urls: list[str], share: ClientShare) -> tuple[int, list[str]]:
    """In a client process: its share of a level's warm-up; the questions and the first errors."""
    quiet_logging()

    async def warm_up() -> tuple[int, list[str]]:
        async with load.assigned_pools(urls, share.gateways) as pools:
            config = share_config(args, urls, share, args.warmup_s)
            results, _ = await load.drive(pools, config, share.gateways)
        return len(results), [r.error for r in results if r.error][:5]

    return asyncio.run(warm_up())


def clients_timed(
    args: argparse.Namespace, urls: list[str], engine_urls: list[str], clients: int, pool: ProcessPoolExecutor
) -> dict[str, Any]:
    """A level's timed run over every gateway replica, its clients split over the client processes, all of them
    starting at one instant, between two reads of the engines' /metrics (`run_report` of their results merged)."""
    shares = level_shares(args, urls, clients, args.max_requests)
    before = asyncio.run(engine_pages([*engine_urls, urls[0]]))
    scraped = time.perf_counter()
    start_at = time.time() + START_LEAD_S
    futures = [pool.submit(clients_timed_share, args, urls, share, start_at) for share in shares]
    outcomes = [f.result() for f in futures]
    after = asyncio.run(engine_pages([*engine_urls, urls[0]]))
    window_s = time.perf_counter() - scraped
    (gateway_before, gateway_after), before, after = (before[-1], after[-1]), before[:-1], after[:-1]
    late = max(late_s for _, _, late_s in outcomes)
    if late > LATE_START_S:
        log.warning("%d clients: a client process started its timed run %.2f s late", clients, late)
    results = sorted((r for results, _, _ in outcomes for r in results), key=lambda r: r.started_s)
    duration_s = max(duration for _, duration, _ in outcomes)
    run = run_report(clients, results, duration_s, engine_urls, before, after, len(urls), window_s)
    run["client_processes"] = len(shares)
    run["gateway_retrieval_ms"] = retrieval_split(gateway_before, gateway_after)
    run["requests_per_client_process"] = [len(results) for results, _, _ in outcomes]
    return run


def clients_timed_share(
    args: argparse.Namespace, urls: list[str], share: ClientShare, start_at: float
) -> tuple[list[load.Result], float, float]:
    """In a client process: its share of a level's timed run, started at `start_at` (`time.time()`); its results
    (`started_s` from that start, `gateway` the global replica index), the seconds it ran and how late it began."""
    quiet_logging()

    async def timed() -> tuple[list[load.Result], float, float]:
        async with load.assigned_pools(urls, share.gateways) as pools:
            config = share_config(args, urls, share, args.duration)
            await asyncio.sleep(max(0.0, start_at - time.time()))
            late_s = time.time() - start_at
            results, duration_s = await load.drive(pools, config, share.gateways)
        return results, duration_s, late_s

    return asyncio.run(timed())


async def engine_pages(urls: list[str]) -> list[str]:
    async with httpx.AsyncClient(timeout=10) as client:
        return [(await client.get(f"{url}/metrics")).text for url in urls]


def run_report(
    clients: int,
    results: list[load.Result],
    duration_s: float,
    engine_urls: list[str],
    before: list[str],
    after: list[str],
    gateways: int = 1,
    window_s: float | None = None,
) -> dict[str, Any]:
    """One timed run: all modes together, then each; per engine the answers it gave and the blocks it served by
    tier over the run (the deltas of its /metrics); per gateway replica the questions asked through it. `window_s`:
    the seconds between the two reads of /metrics, which the engine threads' phase shares are taken over (the
    counters' deltas cover the lead before the clients start too); the clients' run without it."""
    overall = load.mode_report("all", results, duration_s)
    engines: dict[str, dict[str, Any]] = {}
    for url, earlier, later in zip(engine_urls, before, after, strict=True):
        blocks = grown(earlier, later, "kvstitch_kv_blocks_total", "tier")
        answers = sum(grown(earlier, later, "kvstitch_ttft_seconds_count", "mode").values())
        engines[url] = {"answers": int(answers), "blocks": {t: int(blocks.get(t, 0)) for t in TIERS}}
        # The engine thread's share of the run by phase (idle, admit, prefill, decode, emit): where a slow level's
        # time went, inside the engine.
        phases = grown(earlier, later, "kvstitch_engine_seconds_total", "phase")
        over = window_s or duration_s
        engines[url]["thread_share"] = {p: round(v / over, 3) for p, v in phases.items()} if over else {}
        # Questions prefilled riding in decode steps or apart: whether arrivals stall the running answers.
        prefills = grown(earlier, later, "kvstitch_question_prefills_total", "how")
        engines[url]["question_prefills"] = {how: int(n) for how, n in prefills.items()}
        # Their tokens and the rider buckets' padding: compute every running answer waited for.
        riders = grown(earlier, later, "kvstitch_rider_tokens_total", "kind")
        engines[url]["rider_tokens"] = {kind: int(n) for kind, n in riders.items()}
    served = {t: sum(e["blocks"][t] for e in engines.values()) for t in TIERS}
    modes = sorted({r.mode for r in results})
    return {
        "concurrency": clients,
        "duration_s": duration_s,
        **{k: v for k, v in asdict(overall).items() if k != "mode"},
        "gpu_hit_ratio_done": hit_ratio(overall.kv, "gpu"),
        "host_hit_ratio_done": hit_ratio(overall.kv, "host"),
        "gpu_hit_ratio_engines": hit_ratio(served, "gpu"),
        "engines": engines,
        "requests_per_gateway": [sum(r.gateway == g for r in results) for g in range(gateways)],
        "modes": [asdict(load.mode_report(m, [r for r in results if r.mode == m], duration_s)) for m in modes],
    }


def grown(earlier: str, later: str, name: str, label: str) -> dict[str, float]:
    """A counter's growth between two /metrics pages, by one label's value."""
    before = summed_by_label(earlier, name, label)
    return {k: v - before.get(k, 0.0) for k, v in summed_by_label(later, name, label).items()}


def summed_by_label(page: str, name: str, label: str) -> dict[str, float]:
    """A counter's samples summed by one label (other labels, as the TTFT histogram's positions, added up)."""
    values: dict[str, float] = {}
    for line in page.splitlines():
        if line.startswith(name + "{"):
            labels, value = line.rsplit(" ", 1)
            key = labels.split(f'{label}="')[1].split('"')[0]
            values[key] = values.get(key, 0.0) + float(value)
    return values


def retrieval_split(earlier: str, later: str) -> dict[str, float]:
    """The first gateway's retrieval between two of its /metrics pages: ms a question spent by stage (wait for the
    round before its own, embed, search; `RetrievalStats`), where a lone question's TTFT goes before the engine."""
    seconds = grown(earlier, later, "kvstitch_retrieval_seconds_total", "stage")
    questions = _counter(later, "kvstitch_retrieval_questions_total") - _counter(
        earlier, "kvstitch_retrieval_questions_total"
    )
    return {stage: round(s * 1e3 / questions, 2) for stage, s in seconds.items()} if questions > 0 else {}


def _counter(page: str, name: str) -> float:
    """An unlabelled sample's value on a /metrics page (0 when absent)."""
    return next((float(line.rsplit(" ", 1)[1]) for line in page.splitlines() if line.startswith(name + " ")), 0.0)


def hit_ratio(kv: dict[str, int], tier: str) -> float | None:
    """The share of chunk blocks served from `tier` (None for none served)."""
    total = sum(kv.get(t, 0) for t in TIERS)
    return round(kv.get(tier, 0) / total, 4) if total else None


# ---- phases -------------------------------------------------------------------------------------------------


def configurations(args: argparse.Namespace) -> list[Configuration]:
    every = tuple(range(len(args.gpus)))
    plan = []
    if "scale" in args.phases:
        # All engines first: their ingestion spreads the chunks over them (each on its owner), where after one
        # engine's it would find every chunk on that engine and the others would start cold.
        scale = [Configuration("scale", "1 engine", (0,), "chunk-aware")]
        if len(every) > 1:
            scale.insert(0, Configuration("scale", f"{len(every)} engines", every, "chunk-aware"))
        plan += scale
        if args.engine_env_b or args.engine_code_b:  # the same again, every engine B's: an A/B pair in one lease
            labels = [f"{key}={value}" for key, value in args.engine_env_b]
            labels += [f"code {Path(args.engine_code_b).name}"] if args.engine_code_b else []
            b = {"engine_env": tuple(args.engine_env_b), "engine_code": args.engine_code_b}
            plan += [replace(c, name=f"{c.name}, {' '.join(labels)}", **b) for c in scale]
    if "routing" in args.phases:
        # Both on the same engines, one after the other: --routing-first says which goes first, so that a second
        # run in the other order shows what the order itself (tiers warmed by the first) gives the second.
        policies = ["chunk-aware", "round-robin"]
        policies.sort(key=lambda name: name != args.routing_first)
        plan += [Configuration("routing", name, every, name) for name in policies]
    return plan


@dataclass
class FleetWatched(Watched):
    """`Watched` with every client process under `clients` (their CPU summed; the busiest thread of any of them),
    none of them among `other children`."""

    client_pids: list[int] = field(default_factory=list)

    def roles(self, samplers: Iterable[int] = ()) -> dict[str, int | list[int] | None]:
        roles = super().roles([*samplers, *self.client_pids])
        roles["clients"] = list(dict.fromkeys([self.clients_pid, *self.client_pids]))
        return roles


def run_configuration(
    args: argparse.Namespace,
    config: Configuration,
    group: EngineGroup,
    number: int,
    redis_prefix: str | None,
    embedder: Embedder,
    clients: ProcessPoolExecutor,
    client_pids: list[int],
) -> dict[str, Any]:
    urls = [group.urls[i] for i in config.engines]
    concurrency = args.concurrency if config.phase == "scale" else args.routing_concurrency
    gateway = gateway_server(args, config, urls, number, redis_prefix, embedder)
    began = time.perf_counter()
    with (
        BackgroundServer(create_app(gateway), args.port) as server,
        GatewayReplicas(args, config, urls, number, redis_prefix, args.gateways) as replicas,
    ):
        wait_ready(server.url)
        replicas.wait_ready()
        gateways = [server.url, *replicas.urls]
        log.info(
            "%s / %s: %d gateways ready over %s in %.1f s",
            config.phase,
            config.name,
            len(gateways),
            urls,
            time.perf_counter() - began,
        )
        chunks, ingest_s = clients.submit(clients_ingest_all, args, gateways).result()
        log.info("ingested %d chunks in %.1f s", chunks, ingest_s)
        watched = FleetWatched(
            embedder_pids=lambda: question_embedder_pids(gateway),
            clients_pid=client_pids[0],
            client_pids=client_pids,
            engines={f"engine-{i}": group.processes[i].pid for i in config.engines},
            ignored={process.pid for process in group.processes},  # the configuration's others sit idle
            replicas=lambda: replicas.pids,
        )
        runs, profile = [], None
        for index, clients_count in enumerate(concurrency):
            sample = args.profile and index == len(concurrency) - 1
            run, text = run_level(args, gateways, urls, clients_count, clients, watched, sample)
            runs.append(run)
            profile = text if text is not None else profile
        fleet = gateway.fleet
        unplaced = fleet.unplaced if fleet is not None else 0
    return {
        "phase": config.phase,
        "name": config.name,
        "routing": config.routing,
        "engines": urls,
        "gateways": args.gateways,
        "gpu_cache_mb": group.gpu_cache_mb,
        "unplaced_chunks": unplaced,
        "chunks": chunks,
        "ingest_s": ingest_s,
        "runs": runs,
        "profile": profile,
    }


def run_level(
    args: argparse.Namespace,
    gateways: list[str],
    engine_urls: list[str],
    clients_count: int,
    clients: ProcessPoolExecutor,
    watched: Watched,
    profile: bool,
) -> tuple[dict[str, Any], str | None]:
    """A warm-up, then a timed run with each watched process's CPU read before and after it (`cpu`); with `profile`
    py-spy samples the gateway and the first engine over the timed run (the profile's text, else None)."""
    asked, errors = clients_warm_up_all(args, gateways, clients_count, clients)
    log.info("%d clients: warm-up of %d questions, errors %s", clients_count, asked, errors)
    first_engine = dict(list(watched.engines.items())[:1])
    spies = start_profiles(args.py_spy, {"gateway": os.getpid(), **first_engine}, args.out / "py-spy", profile)
    samplers = spies.sampler_pids if spies is not None else []
    before = cpu_snapshot(watched.roles(samplers))
    try:
        run = clients_timed(args, gateways, engine_urls, clients_count, clients)
    except BaseException:
        if spies is not None:
            spies.stop()
        raise
    after = cpu_snapshot(watched.roles(samplers))
    run["profiled"] = spies is not None  # py-spy beside a run costs its processes CPU: its figures are not headlines
    answers = run["requests"] - run["errors"] - run["refused"]
    run["cpu"] = cpu_use(before, after, answers)
    busy = {role: (found or {}).get("cores") for role, found in run["cpu"]["processes"].items()}
    log.info(
        "%d clients: %d questions in %.1f s; cores busy %s", clients_count, run["requests"], run["duration_s"], busy
    )
    # The headline in the log too: a run cut short after this level (a time limit) still shows its figures.
    log.info(
        "%d clients: %.1f tokens/s, TTFT p50 %.1f / p99 %.1f ms, errors %d, GPU hits %s",
        clients_count,
        run["output_tokens_per_s"],
        run["ttft_ms"]["p50"],
        run["ttft_ms"]["p99"],
        run["errors"],
        run["gpu_hit_ratio_done"],
    )
    log.info(
        "%d clients: server stages p50 (ms) %s", clients_count, {k: round(v, 1) for k, v in run["stage_ms"].items()}
    )
    log.info("%d clients: first gateway's retrieval, mean ms a question %s", clients_count, run["gateway_retrieval_ms"])
    for url, engine in run["engines"].items():
        log.info(
            "%d clients: %s thread share %s, questions prefilled %s, rider tokens %s",
            clients_count,
            url,
            engine["thread_share"],
            engine["question_prefills"],
            engine.get("rider_tokens", {}),
        )
    if spies is None:
        return run, (NO_PY_SPY if profile else None)
    seconds = {role: thread_deltas(before, after, role) for role in spies.pids}
    text = spies.report(seconds, answers, args.profile_top)
    return run, f"{clients_count} clients (py-spy ran beside them)\n\n{text}"


def run_all(args: argparse.Namespace, redis_prefix: str | None) -> list[dict[str, Any]]:
    """Every configuration in order; engines (re)started where the GPU tier a phase asks for changes."""
    outcomes: list[dict[str, Any]] = []
    began_all = time.perf_counter()
    group: EngineGroup | None = None
    embedder = Embedder(args.embedding_model, device=args.embedding_device)
    # The client processes for every configuration (spawned: no CUDA or threads inherited from the gateway's).
    clients, client_pids = start_clients(args.client_processes)
    try:
        for number, config in enumerate(configurations(args)):
            tier = args.gpu_cache_mb if config.phase == "scale" else args.routing_gpu_cache_mb
            engines = (tier, config.engine_env, config.engine_code)
            if group is None or (group.gpu_cache_mb, group.extra_env, group.code) != engines:
                if group is not None:
                    group.stop()
                began = time.perf_counter()
                group = EngineGroup(args, tier, redis_prefix, config.engine_env, config.engine_code)
                group.wait_ready(args.engine_ready_timeout_s)
                log.info(
                    "%d engines ready (GPU tier %d MiB) in %.1f s", len(group.urls), tier, time.perf_counter() - began
                )
            outcome = run_configuration(args, config, group, number, redis_prefix, embedder, clients, client_pids)
            outcomes.append(outcome)
            write_report(args, outcomes, began_all, final=False)
    finally:
        clients.shutdown()
        if group is not None:
            group.stop()
    return outcomes


# ---- report -------------------------------------------------------------------------------------------------


def table(outcomes: list[dict[str, Any]]) -> str:
    head = (
        "| phase | gateway over | clients | requests | errors | 503 | tokens/s | TTFT p50 | p95 | p99 (ms) "
        "| GPU hits (done) | host hits (done) | GPU hits (engines) | answers per engine |"
    )
    rows = [head, "|" + "---|" * 14]
    for outcome in outcomes:
        for run in outcome["runs"]:
            t = run["ttft_ms"]
            per_engine = " / ".join(str(e["answers"]) for e in run["engines"].values())
            cells = [
                outcome["phase"],
                gateway_over(outcome),
                clients_cell(run),
                run["requests"],
                run["errors"],
                run["refused"],
                f"{run['output_tokens_per_s']:.1f}",
                *(f"{t[q]:.1f}" for q in ("p50", "p95", "p99")),
                percent(run["gpu_hit_ratio_done"]),
                percent(run["host_hit_ratio_done"]),
                percent(run["gpu_hit_ratio_engines"]),
                per_engine,
            ]
            rows.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(rows)


def clients_cell(run: dict[str, Any]) -> str:
    """A level's clients, marked where py-spy sampled beside the run (its figures then lower than unprofiled)."""
    return f"{run['concurrency']} (py-spy)" if run.get("profiled") else str(run["concurrency"])


def gateway_over(outcome: dict[str, Any]) -> str:
    """The configuration's name, with its gateway processes where there are several."""
    gateways = outcome.get("gateways", 1)
    return outcome["name"] if gateways == 1 else f"{outcome['name']}, {gateways} gateways"


CPU_CAPTION = (
    "CPU per timed run, in cores busy (CPU seconds / wall seconds); a process's busiest thread in brackets; "
    "ms per answer in report.json (`cpu`)"
)


def cpu_table(outcomes: list[dict[str, Any]]) -> str:
    """Per configuration and concurrency: the gateway's CPU ms per answer, its thread groups' cores, then each
    process's cores (the engines in --gpus order)."""
    head = (
        "| phase | gateway over | clients | gateway ms/answer | event loop | retrieval | request threads "
        "| gateway other | gateway | embedder | gateway replicas | replica embedders | engines | clients' process "
        "| other children |"
    )
    rows = [CPU_CAPTION, "", head, "|" + "---|" * 15]
    for outcome in outcomes:
        for run in outcome["runs"]:
            use = run.get("cpu")
            gateway = (use or {}).get("processes", {}).get("gateway") or {}
            engines = sorted((r for r in (use or {}).get("processes", {}) if r.startswith("engine-")), key=engine_index)
            ms = gateway.get("ms_per_answer")
            cells = [outcome["phase"], gateway_over(outcome), clients_cell(run), "-" if ms is None else f"{ms:.1f}"]
            cells += [group_cores(use, g) for g in ("event_loop", "retrieval", "request_threads", "other")]
            cells += [cores(use, "gateway"), cores(use, "embedder")]
            cells += [cores(use, "gateway replicas"), cores(use, "replica embedders")]
            cells += [" / ".join(cores(use, e) for e in engines)]
            cells += [cores(use, "clients"), cores(use, "other children")]
            rows.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(rows)


def engine_index(role: str) -> int:
    return int(role.removeprefix("engine-"))


def percent(ratio: float | None) -> str:
    return "-" if ratio is None else f"{100 * ratio:.1f}%"


def summary(outcomes: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's two comparisons: tokens/s of all engines over one per concurrency; chunk-aware against
    round-robin (GPU hit ratio, TTFT p50/p99) per concurrency."""
    by_name = {(o["phase"], o["name"]): {r["concurrency"]: r for r in o["runs"]} for o in outcomes}
    out: dict[str, Any] = {}
    scale = [runs for (phase, name), runs in by_name.items() if phase == "scale"]
    if len(scale) == 2:
        many, one = scale
        out["scale_tokens_per_s_ratio"] = {
            c: round(many[c]["output_tokens_per_s"] / one[c]["output_tokens_per_s"], 3)
            for c in one
            if c in many and one[c]["output_tokens_per_s"] > 0
        }
    aware, robin = by_name.get(("routing", "chunk-aware")), by_name.get(("routing", "round-robin"))
    if aware and robin:
        out["routing"] = {
            c: {
                policy: {
                    "gpu_hit_ratio": runs[c]["gpu_hit_ratio_done"],
                    "host_hit_ratio": runs[c]["host_hit_ratio_done"],
                    "ttft_p50_ms": runs[c]["ttft_ms"]["p50"],
                    "ttft_p99_ms": runs[c]["ttft_ms"]["p99"],
                }
                for policy, runs in (("chunk-aware", aware), ("round-robin", robin))
            }
            for c in aware
            if c in robin
        }
    return out


def write_report(args: argparse.Namespace, outcomes: list[dict[str, Any]], began: float, final: bool = True) -> int:
    """report.json and table.md under --out (after every configuration, so a run stopped at its time limit keeps
    what it measured); the final call prints the summary and the table. Returns the errors counted."""
    text = table(outcomes)
    cpu_text = cpu_table(outcomes)
    saved = {
        "machine": machine(),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "wall_s": round(time.perf_counter() - began, 1),
        "summary": summary(outcomes),
        "configurations": outcomes,
        "table": text,
        "cpu_table": cpu_text,
    }
    (args.out / "report.json").write_text(json.dumps(saved, indent=2, default=str), encoding="utf-8")
    (args.out / "table.md").write_text(f"{text}\n\n{cpu_text}\n", encoding="utf-8")
    profiles = [f"## {o['phase']} / {o['name']}: {o['profile']}" for o in outcomes if o.get("profile")]
    if profiles:
        (args.out / "profile.txt").write_text("\n\n".join(profiles) + "\n", encoding="utf-8")
    if final:
        print(json.dumps(saved["summary"], indent=2))
        print(text)
        print(cpu_text)
    return sum(run["errors"] for o in outcomes for run in o["runs"])


# ---- entry --------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder for engines and gateway; default: random Qwen2-7B")
    parser.add_argument("--vocabulary", default="auto", choices=["auto", "qwen", "stand-in"])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--gpus", default="0,1", help="one engine per entry (CUDA_VISIBLE_DEVICES; on cpu a count)")
    parser.add_argument("--phases", nargs="+", default=["scale", "routing"], choices=["scale", "routing"])
    parser.add_argument("--redis", default=None, help="redis:// URL: engines publish their tiers (routing needs it)")
    parser.add_argument("--engine-port", type=int, default=8100, help="engine N listens on this + N")
    parser.add_argument("--port", type=int, default=8765, help="the gateway's port (replica N's: this + N)")
    parser.add_argument(
        "--gateways", type=int, default=1, help=f"gateway processes over the engines (1-{MAX_GATEWAYS}; default 1)"
    )
    parser.add_argument("--engine-env", nargs="*", default=[], metavar="KEY=VALUE", help="extra engine settings")
    parser.add_argument(
        "--engine-env-b",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="run the scale phase again with engines restarted with these settings too (an A/B pair in one run)",
    )
    parser.add_argument(
        "--engine-code-b",
        default=None,
        metavar="DIR",
        help="run the scale phase again with engines from this source tree (another commit's `git archive`): "
        "two versions of the engine compared in one run",
    )
    parser.add_argument("--engine-ready-timeout-s", type=float, default=ENGINE_READY_TIMEOUT_S)
    parser.add_argument("--embedding-model", default=None, help="default: the bundled MiniLM")
    parser.add_argument("--embedding-device", default="cpu")
    parser.add_argument("--data-dir", type=Path, default=Path("/tmp/kvstitch-fleet"))
    parser.add_argument("--chunk-size", type=int, default=640, help="cap; sentence-aligned cuts average ~500")
    parser.add_argument("--topics", type=int, default=48)
    parser.add_argument("--sentences", type=int, default=66, help="sentences per topic document")
    parser.add_argument("--top-k", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--modes", nargs="+", default=["turbo"], choices=["turbo", "naive"])
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64], help="the scale phase's levels")
    parser.add_argument("--routing-first", default="chunk-aware", choices=["chunk-aware", "round-robin"])
    parser.add_argument("--routing-concurrency", type=int, nargs="+", default=[64])
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of each timed run")
    parser.add_argument("--max-requests", type=int, default=5000, help="questions of a timed run, all clients")
    parser.add_argument(
        "--client-processes",
        type=int,
        default=4,
        help="processes the clients of a level are split over (1: all in one, as before; default 4)",
    )
    parser.add_argument("--warmup-s", type=float, default=10.0)
    parser.add_argument("--warmup-requests", type=int, default=64)
    parser.add_argument("--gpu-cache-mb", type=int, default=4096, help="engines' GPU tier in the scale phase")
    parser.add_argument(
        "--routing-gpu-cache-mb", type=int, default=1024, help="engines' GPU tier in the routing phase (< corpus KV)"
    )
    parser.add_argument("--host-cache-mb", type=int, default=12288)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("loadtest-out/fleet"))
    parser.add_argument(
        "--profile", action="store_true", help="py-spy on the gateway and engine 0 over each configuration's last level"
    )
    parser.add_argument("--py-spy", default=None, help="the py-spy executable; default: found (stack_sampler)")
    parser.add_argument("--profile-top", type=int, default=40, help="functions per thread and ranking")
    args = parser.parse_args(argv)
    args.py_spy = find_py_spy(args.py_spy)
    args.gpus = [int(g) for g in args.gpus.split(",") if g.strip()]
    if not 1 <= args.gateways <= MAX_GATEWAYS:
        parser.error(f"--gateways takes 1-{MAX_GATEWAYS}")
    if args.client_processes < 1:
        parser.error("--client-processes takes 1 or more")
    if len(args.gpus) < 2 and "routing" in args.phases:
        parser.error("--phases routing needs at least two engines (--gpus)")
    for name in ("engine_env", "engine_env_b"):
        pairs = [item.partition("=") for item in getattr(args, name)]
        if any(not key or not sep for key, sep, _ in pairs):
            parser.error(f"--{name.replace('_', '-')} takes KEY=VALUE entries")
        setattr(args, name, [(key, value) for key, _, value in pairs])
    args.engine_env = dict(args.engine_env)
    if (args.engine_env_b or args.engine_code_b) and "scale" not in args.phases:
        parser.error("--engine-env-b and --engine-code-b repeat the scale phase: add it to --phases")
    if args.engine_code_b is not None:
        tree = Path(args.engine_code_b).resolve()
        if not (tree / "service").is_dir() or not (tree / "loadtest" / "random_engine.py").is_file():
            parser.error(f"--engine-code-b {tree}: no service/ and loadtest/random_engine.py there")
        args.engine_code_b = str(tree)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_logging()
    # `timeout` stops the run with SIGTERM: unwound as an exit, the engines are stopped and the report kept.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.device == "cuda" and torch.cuda.device_count() < max(args.gpus) + 1:
        log.error("--gpus %s: only %d CUDA devices", args.gpus, torch.cuda.device_count())
        return 2
    if args.profile and args.py_spy is None:
        log.warning("--profile: %s; the runs go on without it", NO_PY_SPY)
    if "routing" in args.phases and args.redis is None:
        log.warning("no --redis: the gateway sees no engine's tiers, so chunk-aware routing goes by load alone")
    args.vocabulary_used = chosen_vocabulary(args.vocabulary) if args.model is None else "stand-in"
    shutil.rmtree(args.data_dir, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    redis_prefix = f"fleetbench-{uuid.uuid4().hex[:12]}" if args.redis else None
    began = time.perf_counter()
    try:
        outcomes = run_all(args, redis_prefix)
    finally:
        if redis_prefix is not None:
            forget_prefix(args.redis, redis_prefix)
    return 1 if write_report(args, outcomes, began) else 0


def forget_prefix(url: str, prefix: str) -> None:
    """Delete the run's keys from Redis (its KV index, tier moves, queue)."""
    import redis

    connection = redis.Redis.from_url(url)
    try:
        keys = list(connection.scan_iter(match=f"{prefix}:*", count=1000))
        for start in range(0, len(keys), 1000):
            connection.delete(*keys[start : start + 1000])
    finally:
        connection.close()


if __name__ == "__main__":
    sys.exit(main())
