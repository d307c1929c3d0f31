"""The load test through the real HTTP gateway: a random Qwen2-7B-shaped engine on the GPU, clients in a second process.

    python -m loadtest.serve_random --out $OUT --concurrency 1 4 --duration 40

Builds the engine as `bench_prefill` does (random bf16 weights of the Qwen2-7B shape built on the device, with
Qwen's own vocabulary where installed, `loadtest.qwen_vocab`, else the tiny stand-in BPE, whose ~3x longer
questions `--vocabulary stand-in` keeps for comparison with earlier runs; `--model DIR` loads a folder instead),
creates the gateway with
`create_app(Server(settings, engine, worker_factory=in_process_worker))` and serves it with uvicorn on loopback in
a background thread: the real routes, start-up gate, in-process ingest worker, embedded Qdrant, SQLite KV index and
KV tiers. Once `/readyz` says ready, a second process (so the clients' work does not hold the server's GIL) drives
the server over HTTP with `loadtest.load`: one ingestion of a
generated corpus (chunks of `--chunk-size` tokens, no overlap), then per concurrency level an untimed warm-up (it
captures the CUDA graphs of the large context bucket) and a timed phase of Zipf-skewed questions with modes
alternating. With the defaults (chunks cut at sentence ends under a 640-token cap, ~500 tokens on average; top-k
16) every turbo question stitches about 8-9K tokens of context and every naive one prefills as many (a 512 cap
averages ~410: ~7K).

The random model's LM head is restricted to ids that stream text on their own (`stream_in_vocab`), so TTFT is
taken at the first token rather than after the whole decode.

Writes `report.json` (settings, machine, per-phase reports and every request), `table.md` and `ttft.png` under
--out, and prints the table last.

Where the time went (`loadtest.proc_cpu`, from /proc around each timed phase; `cpu` in report.json, the second
table of table.md): CPU ms per answer and cores busy (CPU seconds / wall seconds) of this process, the gateway's and
the engine's, split by thread group (`event_loop`: uvicorn's thread; `retrieval`: the batcher that embeds and
searches; `request_threads`: anyio's workers, each request's retrieval wait and preparation; `engine`: the
scheduler's thread, which launches the GPU's work; `other`: the rest, threads that ended included), of the question
embedder's child (on CUDA), of the clients' process and of any other child of this process; per process also its
busiest thread's cores. All of this process's Python threads share one GIL: their sum near 1.0 core, or the engine
thread alone near it, means the GIL or the scheduler's Python is the wall; everything well below means the run
waits (on the GPU, or on a queue).

`--profile`: py-spy (`loadtest.stack_sampler`; `--py-spy PATH`, else found on PATH, beside this Python or in a
`bin` folder of the import path, as `pip install --target` leaves it) samples this process over each pass's last
timed phase: per thread, its top functions in µs of CPU per answer, in `profile.txt` (raw stacks under py-spy/).
Without py-spy the run goes on, unprofiled, and the report says so.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import multiprocessing
import os
import platform
import shutil
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
import torch
import uvicorn

from loadtest import load
from loadtest.bench_prefill import build_engine
from loadtest.proc_cpu import Watched, cores, cpu_snapshot, cpu_use, group_cores, thread_deltas
from loadtest.qwen_vocab import installed_qwen_vocab
from loadtest.stack_sampler import NO_PY_SPY, find_py_spy, start_profiles
from service.api.app import create_app
from service.api.connections import ConnectionLimits, server_options
from service.engine.engine import StitchEngine
from service.serving.gc_pauses import set_young_threshold
from service.serving.server import Server
from service.settings import Settings
from workers.worker import in_process_worker

log = logging.getLogger("serve_random")
READY_TIMEOUT_S = 600.0
REPO = Path(__file__).resolve().parent.parent


def stream_in_vocab(engine: StitchEngine) -> int:
    """Zero the LM head's rows of every id that cannot stream text on its own (beyond the tokenizer's vocabulary,
    its special ids, EOS included, and byte pieces of an unfinished UTF-8 character); returns how many. The random
    Qwen2-7B shape has 152,064 output ids and the tiny stand-in BPE 384, so greedy ids would almost never decode to
    text: no `token` event would stream before the end and TTFT, which both the server and the client take at the
    first text, would include the whole decode; with Qwen's vocabulary a piece of a CJK character would hold its
    text back a step. With the rows zeroed, the largest logit is a streamable id (zero beats the maximum of the
    hundreds of remaining random logits but with negligible probability), and every answer is `max_new_tokens` long.
    The LM head keeps its shape, so its cost is unchanged."""
    tokenizer = engine.tokenizer
    weight = engine.model.hf.get_output_embeddings().weight
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    unfinished = [i for i, text in enumerate(texts) if not text or "\ufffd" in text]
    silenced = sorted(
        {*range(len(tokenizer), weight.shape[0]), *(int(i) for i in tokenizer.all_special_ids), *unfinished}
    )
    with torch.no_grad():
        weight[torch.tensor(silenced, device=weight.device)] = 0
    return len(silenced)


def chosen_vocabulary(choice: str) -> str:
    """`auto` means Qwen's vocabulary where it is installed (realistic question lengths), else the stand-in."""
    if choice != "auto":
        return choice
    if installed_qwen_vocab() is not None:
        return "qwen"
    log.warning("Qwen's vocabulary is not installed: the stand-in BPE makes questions ~3x longer (loadtest.qwen_vocab)")
    return "stand-in"


def make_settings(args: argparse.Namespace) -> Settings:
    return Settings(
        model=args.model or "random-qwen2-7b",
        device=args.device,
        data_dir=args.data_dir,
        embedding_model=str(args.embedding_model),
        embedding_device=args.embedding_device,
        chunk_size=args.chunk_size,
        chunk_overlap=0,
        gpu_cache_mb=args.gpu_cache_mb,
        host_cache_mb=args.host_cache_mb,
        default_max_new_tokens=args.max_new_tokens,
        max_top_k=max(args.top_k, 1),
        max_queue=max(16, 2 * max(args.concurrency)),
        gate_on_start=True,
        host="127.0.0.1",
        port=args.port,
    )


class BackgroundServer:
    """uvicorn serving the app on its own thread and event loop (it installs no signal handlers there)."""

    def __init__(self, app: Any, port: int) -> None:
        options = server_options(ConnectionLimits())  # `kvstitch serve`'s
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on", **options)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self.url = f"http://127.0.0.1:{port}"

    def __enter__(self) -> BackgroundServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)


def wait_ready(url: str) -> dict[str, Any]:
    """Poll /readyz until the gateway is ready; raise with its checks if start-up failed or never ended."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    state: dict[str, Any] = {}
    while time.monotonic() < deadline:
        try:
            state = httpx.get(f"{url}/readyz", timeout=5).json()
        except httpx.HTTPError:
            time.sleep(0.5)
            continue
        if state.get("ready"):
            return state
        startup = state.get("checks", {}).get("startup")
        if startup is not None and startup != "loading":
            raise RuntimeError(f"gateway start-up failed: {state}")
        time.sleep(0.5)
    raise TimeoutError(f"gateway not ready after {READY_TIMEOUT_S:.0f} s: {state}")


def phase_config(
    args: argparse.Namespace, url: str, concurrency: int, duration_s: float, requests: int
) -> load.LoadConfig:
    return load.LoadConfig(
        url=url,
        out_dir=args.out,
        topics=args.topics,
        sentences_per_topic=args.sentences,
        concurrency=concurrency,
        duration_s=duration_s,
        max_requests=requests,
        modes=tuple(args.modes),
        zipf_s=args.zipf,
        top_k=args.top_k,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed + concurrency,
    )


# ---- the clients (a second process: their SSE parsing must not share the server's GIL) -----------------------


def quiet_logging() -> None:
    """INFO, but not httpx's line per request (the clients ask hundreds a second; a fleet's gateway probes every
    engine twice a second)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)


def http_client(url: str, connections: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=connections + 2)
    return httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(load.REQUEST_TIMEOUT_S))


def clients_ingest(args: argparse.Namespace, url: str) -> tuple[int, float]:
    """In the clients' process: the corpus ingested through the gateway; its chunks and seconds."""
    quiet_logging()

    async def ingest() -> tuple[int, float]:
        async with http_client(url, 1) as client:
            began = time.perf_counter()
            chunks = await load.ingest(client, load.corpus(args.topics, args.sentences, args.seed))
            return chunks, time.perf_counter() - began

    return asyncio.run(ingest())


def clients_warm_up(args: argparse.Namespace, url: str, concurrency: int) -> tuple[int, list[str]]:
    """In the clients' process: a level's untimed warm-up (it captures the CUDA graphs of the large context
    bucket); the questions asked and the first errors."""
    quiet_logging()

    async def warm_up() -> tuple[int, list[str]]:
        async with load.client_pools(url, concurrency) as pools:
            config = phase_config(args, url, concurrency, args.warmup_s, args.warmup_requests)
            results, _ = await load.drive(pools, config)
        return len(results), [r.error for r in results if r.error][:5]

    return asyncio.run(warm_up())


def clients_timed(args: argparse.Namespace, url: str, concurrency: int) -> dict[str, Any]:
    """In the clients' process: a level's timed phase between two reads of the gateway's /metrics; its report."""
    quiet_logging()

    async def timed() -> dict[str, Any]:
        async with load.client_pools(url, concurrency) as pools:
            config = phase_config(args, url, concurrency, args.duration, args.max_requests)
            before_page = (await pools[0].get("/metrics")).text
            results, duration_s = await load.drive(pools, config)
            after_page = (await pools[0].get("/metrics")).text
        return phase_report(config, results, duration_s, before_page, after_page)

    return asyncio.run(timed())


def phase_report(
    config: load.LoadConfig, results: list[load.Result], duration_s: float, before_page: str, after_page: str
) -> dict[str, Any]:
    before, after = engine_seconds(before_page), engine_seconds(after_page)
    modes = [load.mode_report(m, [r for r in results if r.mode == m], duration_s) for m in config.modes]
    contexts = sorted(r.context_tokens for r in results if r.context_tokens)
    questions = sorted(r.question_tokens for r in results if r.context_tokens)
    log.info("concurrency %d: %d questions in %.1f s", config.concurrency, len(results), duration_s)
    return {
        "concurrency": config.concurrency,
        "duration_s": duration_s,
        "modes": [asdict(m) for m in modes],
        "context_tokens": {"min": contexts[0], "median": contexts[len(contexts) // 2], "max": contexts[-1]}
        if contexts
        else {},
        "question_tokens_median": questions[len(questions) // 2] if questions else 0,
        "stage_ms_median": _stage_medians(results),
        "engine_share": {k: round((after[k] - before.get(k, 0.0)) / duration_s, 3) for k in after},
        "gc_pauses": gc_pause_growth(before_page, after_page),
        "retrieval_ms_per_question": retrieval_split(before_page, after_page),
        "results": [asdict(r) for r in results],
    }


# ---- a pass over every level (this process: the server's) ----------------------------------------------------


def question_embedder_pids(server: Server) -> list[int]:
    """The pids of the children that embed the gateway's questions (none where they are embedded in its process)."""
    runtime = server.runtime
    pool = runtime.question_embedder if runtime is not None else None
    return [pid for pid in pool.pids if pid is not None] if pool is not None else []


def drive_pass(
    args: argparse.Namespace, url: str, clients: ProcessPoolExecutor, watched: Watched, ingest: bool, out: Path
) -> dict[str, Any]:
    """Ingest once (unless the corpus is already in: a second pass over the same server), then a warm-up and a
    timed phase per concurrency level, the last one profiled with --profile (py-spy's files under `out`)."""
    chunks, ingest_s = clients.submit(clients_ingest, args, url).result() if ingest else (0, 0.0)
    log.info("ingested %d chunks in %.1f s", chunks, ingest_s)
    phases, profile = [], None
    for index, concurrency in enumerate(args.concurrency):
        sample = args.profile and index == len(args.concurrency) - 1
        phase, text = run_phase(args, url, concurrency, clients, watched, sample, out)
        phases.append(phase)
        profile = text if text is not None else profile
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    return {
        "chunks": chunks,
        "ingest_s": ingest_s,
        "phases": phases,
        "metrics_tail": _kvstitch_lines(metrics),
        "profile": profile,
    }


def run_phase(
    args: argparse.Namespace,
    url: str,
    concurrency: int,
    clients: ProcessPoolExecutor,
    watched: Watched,
    profile: bool,
    out: Path,
) -> tuple[dict[str, Any], str | None]:
    """A warm-up, then a timed phase with each watched process's CPU read before and after it (`cpu`); with
    `profile` py-spy samples the gateway's process over the timed phase (the profile's text, else None)."""
    warm_requests, warm_errors = clients.submit(clients_warm_up, args, url, concurrency).result()
    spies = start_profiles(args.py_spy, {"gateway": os.getpid()}, out / "py-spy", profile)
    samplers = spies.sampler_pids if spies is not None else []
    before = cpu_snapshot(watched.roles(samplers))
    try:
        timed = clients.submit(clients_timed, args, url, concurrency).result()
    except BaseException:
        if spies is not None:
            spies.stop()
        raise
    after = cpu_snapshot(watched.roles(samplers))
    answers = sum(m["requests"] - m["errors"] - m["refused"] for m in timed["modes"])
    cpu = cpu_use(before, after, answers)
    log.info(
        "concurrency %d: cores busy %s", concurrency, {k: (v or {}).get("cores") for k, v in cpu["processes"].items()}
    )
    head = {"concurrency": concurrency, "duration_s": timed["duration_s"]}  # keys first, as before the split
    phase = {**head, "warmup_requests": warm_requests, "warmup_errors": warm_errors, **timed, "cpu": cpu}
    if spies is None:
        return phase, (NO_PY_SPY if profile else None)
    text = spies.report({"gateway": thread_deltas(before, after, "gateway")}, answers, args.profile_top)
    return phase, f"{concurrency} clients (py-spy ran beside them)\n\n{text}"


def engine_seconds(metrics: str) -> dict[str, float]:
    """`kvstitch_engine_seconds_total` by phase from a /metrics page."""
    return counter_by_label(metrics, "kvstitch_engine_seconds_total", "phase")


def gc_pauses(metrics: str) -> dict[str, tuple[float, int]]:
    """`kvstitch_gc_pause_seconds` by generation from a /metrics page: (total seconds, collections)."""
    seconds = counter_by_label(metrics, "kvstitch_gc_pause_seconds_sum", "generation")
    counts = counter_by_label(metrics, "kvstitch_gc_pause_seconds_count", "generation")
    return {g: (seconds[g], int(counts.get(g, 0))) for g in seconds}


def gc_pause_growth(before: str, after: str) -> dict[str, list[float]]:
    """The gateway's garbage-collector pauses between two /metrics pages (every thread waits through them), by
    generation: [seconds, collections]."""
    earlier = gc_pauses(before)
    grown = {}
    for generation, (seconds, count) in gc_pauses(after).items():
        seconds_before, count_before = earlier.get(generation, (0.0, 0))
        grown[generation] = [round(seconds - seconds_before, 3), count - count_before]
    return grown


def counter_by_label(metrics: str, name: str, label: str) -> dict[str, float]:
    """A labelled counter's samples from a /metrics page, by the value of `label`."""
    values = {}
    for line in metrics.splitlines():
        if line.startswith(name + "{"):
            labels, value = line.rsplit(" ", 1)
            values[labels.split(f'{label}="')[1].split('"')[0]] = float(value)
    return values


def counter(metrics: str, name: str) -> float:
    """An unlabelled counter's value from a /metrics page (0 when absent)."""
    for line in metrics.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def retrieval_split(before: str, after: str) -> dict[str, float]:
    """Mean ms a question spent per retrieval stage (wait, embed, search) between two /metrics pages, and the
    mean round size."""
    questions = counter(after, "kvstitch_retrieval_questions_total") - counter(
        before, "kvstitch_retrieval_questions_total"
    )
    rounds = counter(after, "kvstitch_retrieval_rounds_total") - counter(before, "kvstitch_retrieval_rounds_total")
    if questions <= 0:
        return {}
    spent_before = counter_by_label(before, "kvstitch_retrieval_seconds_total", "stage")
    spent = counter_by_label(after, "kvstitch_retrieval_seconds_total", "stage")
    split = {stage: round((s - spent_before.get(stage, 0.0)) / questions * 1e3, 2) for stage, s in spent.items()}
    return {**split, "round_size": round(questions / max(rounds, 1), 2)}


# Each pass: (overlapped decode steps, overlapped admissions); None keeps the server's setting.
OVERLAP_MODES: dict[str, tuple[bool, bool]] = {"on": (True, True), "decode": (True, False), "off": (False, False)}
OVERLAP_PASSES = {
    "auto": (None,),
    "on": ("on",),
    "off": ("off",),
    "decode": ("decode",),
    "both": ("on", "off"),
    "all": ("on", "decode", "off"),
}
# Questions prefilled in the decode step's forward (KVSTITCH_PREFILL_WITH_DECODE) per pass; None keeps the server's.
WITH_DECODE_PASSES: dict[str, tuple[bool | None, ...]] = {
    "auto": (None,),
    "on": (True,),
    "off": (False,),
    "both": (True, False),
}


def gc_passes(args: argparse.Namespace) -> list[tuple[str | None, bool | None, str | None, int | None]]:
    """`passes` once per `--gc-gen0` value (None: the server's threshold), the value's folder joined to theirs."""
    out = []
    for young in args.gc_gen0 or [None]:
        for level, piggyback, folder in passes(args.overlap, args.with_decode):
            if young is not None:
                folder = "-".join(n for n in (folder, f"gc{young}") if n)
            out.append((level, piggyback, folder, young))
    return out


def passes(overlap: str, with_decode: str) -> list[tuple[str | None, bool | None, str | None]]:
    """Every (overlap level, with-decode setting) pass and its report's folder (None: `--out` itself)."""
    out = []
    for level in OVERLAP_PASSES[overlap]:
        for piggyback in WITH_DECODE_PASSES[with_decode]:
            named = [level] if level is not None else []
            if piggyback is not None:
                named.append("with-decode" if piggyback else "apart")
            out.append((level, piggyback, "-".join(named) or None))
    return out


def _stage_medians(results: list[load.Result]) -> dict[str, dict[str, float]]:
    """Per mode, the median of each server stage time (the done events' timings_ms)."""
    out: dict[str, dict[str, float]] = {}
    for mode in sorted({r.mode for r in results}):
        stages: dict[str, list[float]] = {}
        for r in results:
            if r.mode == mode and r.error is None:
                for stage, ms in r.timings_ms.items():
                    stages.setdefault(stage, []).append(ms)
        out[mode] = {stage: round(load.percentile(v, 0.5), 2) for stage, v in stages.items()}
    return out


def _kvstitch_lines(metrics: str) -> list[str]:
    return [line for line in metrics.splitlines() if line.startswith("kvstitch_") and "_bucket" not in line]


def table(phases: list[dict[str, Any]]) -> str:
    head = (
        "| clients | mode | requests | errors | 503 | TTFT p50 | p95 | p99 (ms) | server TTFT p50 | p95 (ms) "
        "| TPOT p50 | p95 (ms) | tokens/s | gpu | host | disk | miss |"
    )
    rows = [head, "|" + "---|" * 17]
    for phase in phases:
        for m in phase["modes"]:
            t, s, d, kv = m["ttft_ms"], m["server_ttft_ms"], m["tpot_ms"], m["kv"]
            rows.append(
                f"| {phase['concurrency']} | {m['mode']} | {m['requests']} | {m['errors']} | {m['refused']} "
                f"| {t['p50']:.1f} | {t['p95']:.1f} | {t['p99']:.1f} | {s['p50']:.1f} | {s['p95']:.1f} "
                f"| {d['p50']:.2f} | {d['p95']:.2f} | {m['output_tokens_per_s']:.1f} "
                f"| {kv['gpu']} | {kv['host']} | {kv['disk']} | {kv['miss']} |"
            )
    return "\n".join(rows)


CPU_CAPTION = (
    "CPU per timed phase, in cores busy (CPU seconds / wall seconds); a process's busiest thread in brackets; "
    "ms per answer in report.json (`cpu`)"
)


def cpu_table(phases: list[dict[str, Any]]) -> str:
    """Per concurrency level: the gateway's CPU ms per answer, its thread groups' cores (its engine's scheduler
    thread among them), then each process's cores."""
    head = (
        "| clients | gateway ms/answer | event loop | retrieval | request threads | engine thread | gateway other "
        "| gateway | embedder | clients' process | other children |"
    )
    rows = [CPU_CAPTION, "", head, "|" + "---|" * 11]
    for phase in phases:
        use = phase.get("cpu")
        ms = ((use or {}).get("processes", {}).get("gateway") or {}).get("ms_per_answer")
        cells = [phase["concurrency"], "-" if ms is None else f"{ms:.1f}"]
        cells += [group_cores(use, g) for g in ("event_loop", "retrieval", "request_threads", "engine", "other")]
        cells += [cores(use, role) for role in ("gateway", "embedder", "clients", "other children")]
        rows.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(rows)


def plot(phases: list[dict[str, Any]], path: Path, title: str) -> Path:
    """Per concurrency level, TTFT over the run (a dot per question); and every phase's TTFT CDF, log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(phases) + 1, figsize=(5.5 * (len(phases) + 1), 4.5))
    cdf = axes[-1]
    for phase, over_time in zip(phases, axes[:-1], strict=True):
        for mode in sorted({r["mode"] for r in phase["results"]}, reverse=True):
            points = [(r["started_s"], r["ttft_ms"]) for r in phase["results"] if r["mode"] == mode and r["ttft_ms"]]
            if not points:
                continue
            over_time.scatter([p[0] for p in points], [p[1] for p in points], s=8, label=mode)
            values = sorted(p[1] for p in points)
            label = f"{mode}, {phase['concurrency']} client{'s' if phase['concurrency'] > 1 else ''}"
            cdf.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", label=label)
        over_time.set(
            xlabel="time since start (s)",
            ylabel="TTFT (ms)",
            title=f"TTFT per question, {phase['concurrency']} client(s)",
            yscale="log",
        )
    cdf.set(xlabel="TTFT (ms)", ylabel="fraction of questions", title="TTFT distribution", xscale="log")
    for ax in axes:
        ax.grid(alpha=0.3, which="both")
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def machine() -> dict[str, Any]:
    import transformers

    cuda = torch.cuda.is_available()
    return {
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder; default: random Qwen2-7B shape")
    parser.add_argument(
        "--vocabulary",
        default="auto",
        choices=["auto", "qwen", "stand-in"],
        help="the random model's tokenizer: Qwen's own vocabulary (loadtest.qwen_vocab), the tiny stand-in BPE, or "
        "auto: Qwen's where installed",
    )
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--embedding-model", type=Path, default=REPO / ".minilm16")
    parser.add_argument(
        "--embedding-device",
        default="cpu",
        help="the server's default (cpu): on the engine's GPU the embeddings queue behind its kernels (§10.8)",
    )
    parser.add_argument("--data-dir", type=Path, default=Path("/tmp/kvstitch-load"))
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--chunk-size", type=int, default=640, help="cap; sentence-aligned cuts average ~500")
    parser.add_argument("--topics", type=int, default=48)
    parser.add_argument("--sentences", type=int, default=66, help="sentences per topic document")
    parser.add_argument("--top-k", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--modes", nargs="+", default=["turbo", "naive"], choices=["turbo", "naive"])
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--duration", type=float, default=40.0, help="seconds of each timed phase")
    parser.add_argument("--max-requests", type=int, default=5000)
    parser.add_argument("--warmup-s", type=float, default=15.0)
    parser.add_argument("--warmup-requests", type=int, default=8)
    parser.add_argument("--gpu-cache-mb", type=int, default=4096)
    parser.add_argument("--host-cache-mb", type=int, default=12288)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("loadtest-out"))
    parser.add_argument(
        "--overlap",
        choices=sorted(OVERLAP_PASSES),
        default="auto",
        help="overlapped decode steps (KVSTITCH_OVERLAP_DECODE): the server's setting, on, off, decode (steps "
        "overlapped, each admission's first token read at once), or both (on, then off) / all (on, decode, off): "
        "every level once per pass in one server, a paired comparison; reports in on/, decode/, off/",
    )
    parser.add_argument(
        "--with-decode",
        choices=sorted(WITH_DECODE_PASSES),
        default="auto",
        help="questions prefilled in the running answers' decode step (KVSTITCH_PREFILL_WITH_DECODE): the "
        "server's setting, on, off, or both (paired passes in one server; start it with the setting on so its "
        "mixed-step graphs are captured); reports in with-decode/ and apart/ (joined to --overlap's names)",
    )
    parser.add_argument(
        "--gc-gen0",
        type=int,
        nargs="+",
        default=None,
        help="the gateway's youngest-generation GC threshold (KVSTITCH_GC_GEN0_THRESHOLD) per pass, in this order: "
        "every other pass once per value, in one server (paired); reports in gc<N>/ (joined to the others' names)",
    )
    parser.add_argument(
        "--profile", action="store_true", help="py-spy on the gateway's process over each pass's last level"
    )
    parser.add_argument("--py-spy", default=None, help="the py-spy executable; default: found (stack_sampler)")
    parser.add_argument("--profile-top", type=int, default=40, help="functions per thread and ranking")
    args = parser.parse_args(argv)
    if args.gc_gen0 is not None and min(args.gc_gen0) < 1:
        parser.error("--gc-gen0 thresholds must be positive")
    args.py_spy = find_py_spy(args.py_spy)
    quiet_logging()
    if args.profile and args.py_spy is None:
        log.warning("--profile: %s; the run goes on without it", NO_PY_SPY)
    if args.device == "cuda" and not torch.cuda.is_available():
        log.error("no CUDA device: pass --device cpu --model DIR for a smoke run")
        return 2
    shutil.rmtree(args.data_dir, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    settings = make_settings(args)

    began = time.perf_counter()
    engine = build_engine(args.model, torch.device(args.device), chosen_vocabulary(args.vocabulary))
    log.info("engine built in %.1f s (%s)", time.perf_counter() - began, engine.model.source)
    if args.model is None:
        log.info("zeroed %d LM-head rows the tokenizer cannot decode", stream_in_vocab(engine))
    gateway = Server(settings, engine, worker_factory=in_process_worker)
    outcomes = []
    with BackgroundServer(create_app(gateway), args.port) as server:
        readiness = wait_ready(server.url)
        log.info("ready after %.1f s: %s", time.perf_counter() - began, readiness["checks"])
        # The clients run in a separate process: in this one they would take the GIL from the server they load.
        with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as clients:
            watched = Watched(lambda: question_embedder_pids(gateway), clients.submit(os.getpid).result())
            for number, (name, with_decode, folder, young) in enumerate(gc_passes(args)):
                if young is not None:
                    set_young_threshold(young)
                scheduler = gateway.runtime.loop.scheduler if gateway.runtime is not None else None
                # Read by the engine thread at its next step; the server is idle between passes.
                if name is not None and scheduler is not None:
                    scheduler.overlap, scheduler.overlap_admissions = OVERLAP_MODES[name]
                if with_decode is not None and scheduler is not None:
                    scheduler.prefill_with_decode = with_decode
                out = args.out if folder is None else args.out / folder
                outcome = drive_pass(args, server.url, clients, watched, number == 0, out)
                used = name or ("on" if scheduler is not None and scheduler.overlap else "off")
                piggyback = scheduler is not None and scheduler.prefill_with_decode
                threshold = f", GC gen-0 threshold {gc.get_threshold()[0]}"
                outcomes.append((folder, f"{used}, questions with the decode step: {piggyback}{threshold}", outcome))
    errors = 0
    for folder, used, outcome in outcomes:
        out = args.out if folder is None else args.out / folder
        errors += report(args, out, engine, settings, readiness, outcome, used)
    return 1 if errors else 0


def report(
    args: argparse.Namespace,
    out: Path,
    engine: Any,
    settings: Settings,
    readiness: dict[str, Any],
    outcome: dict[str, Any],
    overlap: str,
) -> int:
    """Write one pass's report.json, table.md and plot into `out`, print its summary; returns its errors."""
    out.mkdir(parents=True, exist_ok=True)
    info = machine()
    text = table(outcome["phases"])
    cpu_text = cpu_table(outcome["phases"])
    profile = outcome.pop("profile", None)
    if profile is not None:
        (out / "profile.txt").write_text(profile + "\n", encoding="utf-8")
    title = (
        f"kvstitch gateway, {info['device']}, {engine.model.source}, top-k {args.top_k} x {args.chunk_size}-token "
        f"chunks, {args.max_new_tokens} new tokens"
    )
    png = plot(outcome["phases"], out / "ttft.png", title)
    saved = {
        "machine": info,
        "settings": settings.model_dump(mode="json"),
        "overlap_decode": overlap,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "readiness": readiness,
        **outcome,
        "table": text,
        "cpu_table": cpu_text,
    }
    (out / "report.json").write_text(json.dumps(saved, indent=2), encoding="utf-8")
    (out / "table.md").write_text(f"{text}\n\n{cpu_text}\n", encoding="utf-8")
    print(f"overlapped decode: {overlap}")
    print(f"{info}; ingested {outcome['chunks']} chunks in {outcome['ingest_s']:.1f} s; plot {png}")
    for line in outcome["metrics_tail"]:
        if line.startswith(("kvstitch_kv_hits_total", "kvstitch_ttft_seconds_count", "kvstitch_gate")):
            print(line)
    for phase in outcome["phases"]:
        print(
            f"clients {phase['concurrency']}: context tokens {phase['context_tokens']}; question tokens "
            f"{phase['question_tokens_median']}; stage medians (ms) "
            f"{phase['stage_ms_median']}; engine share {phase['engine_share']}; "
            f"retrieval ms per question {phase['retrieval_ms_per_question']}; "
            f"gc pauses (s, count) by generation {phase.get('gc_pauses')}"
        )
    print(text)
    print(cpu_text)
    return sum(m["errors"] for phase in outcome["phases"] for m in phase["modes"])


if __name__ == "__main__":
    sys.exit(main())
