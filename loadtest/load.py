"""HTTP load generator: ingest a generated corpus, then ask Zipf-skewed questions at a given concurrency.

    python -m loadtest.load --url http://127.0.0.1:8000 --topics 50 --concurrency 8 --duration 60 \
        --max-requests 2000 --modes turbo naive --out loadtest-out

It generates `--topics` documents (one made-up subject each, with distinct sentences), ingests them through
`POST /ingest` and waits for the job, then runs `--concurrency` clients for `--duration` seconds or
`--max-requests` questions, whichever ends first. Each question is about one topic drawn with a Zipf law (rank r
has weight 1/r^s), so a few topics are hot (their KV moves up to the memory tiers) and the tail stays cold; modes
alternate request by request so every mode sees the same load. Each `/ask` stream is read to its end.

Per mode it reports TTFT p50/p95/p99 as the client saw it (request sent → first `token` event) and as the
server measured it (`done.ttft_ms`), time per output token, output tokens per second, errors, refusals (503) and
KV tier hits summed over the `done` events; a Markdown table on stdout, `report.json` and `ttft.png` under --out.
Time per output token is the server's decode time per token after the first: a `token` event carries whatever
text is complete (several tokens, or none), so the client cannot time single tokens.
Loopback only: it refuses any other host, so a typo cannot load someone else's server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from service.commands.ask import SseDecoder

LOOPBACK = {"127.0.0.1", "localhost", "::1", "[::1]"}
MAX_REQUESTS_CAP = 100_000
MAX_DURATION_S = 3600.0
INGEST_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 120.0
TIERS = ("gpu", "host", "disk", "miss")

_SYLLABLES = ("ka", "lo", "mi", "ren", "tu", "vos", "zel", "pra", "quin", "dor", "fen", "gal", "hux", "jor", "nim")
_VERBS = ("migrates", "glows", "nests", "ferments", "erodes", "hums", "drifts", "crystallizes", "blooms", "rusts")
_PLACES = ("north shore", "salt flats", "old quarry", "river delta", "high moor", "glass caves", "pine ridge")
_SEASONS = ("spring", "summer", "autumn", "winter", "the wet season", "the dry season")


@dataclass(frozen=True)
class LoadConfig:
    url: str
    out_dir: Path
    topics: int = 50
    sentences_per_topic: int = 12
    concurrency: int = 4
    duration_s: float = 30.0
    max_requests: int = 500
    modes: tuple[str, ...] = ("turbo", "naive")
    zipf_s: float = 1.1
    top_k: int = 5
    max_new_tokens: int = 32
    seed: int = 0
    api_key: str | None = None

    def __post_init__(self) -> None:
        host = urlsplit(self.url).hostname
        if host is None or (host not in LOOPBACK and f"[{host}]" not in LOOPBACK):
            raise ValueError(f"the load generator only targets loopback (127.0.0.1, localhost, ::1), not {host!r}")
        if not 1 <= self.max_requests <= MAX_REQUESTS_CAP:
            raise ValueError(f"max_requests must be within 1..{MAX_REQUESTS_CAP}")
        if not 0 < self.duration_s <= MAX_DURATION_S:
            raise ValueError(f"duration_s must be within (0, {MAX_DURATION_S}]")
        if self.concurrency < 1 or self.topics < 1 or not self.modes:
            raise ValueError("concurrency, topics and modes must be at least 1")


@dataclass
class Result:
    """One question as the client saw it; `ttft_ms` is None when no token arrived."""

    mode: str
    topic: int
    started_s: float  # since the load phase began
    ttft_ms: float | None = None
    server_ttft_ms: float | None = None
    tpot_ms: float | None = None
    output_tokens: int = 0
    total_ms: float = 0.0
    kv: dict[str, int] = field(default_factory=dict)
    context_tokens: int = 0  # the done event's: tokens of context the answer saw (stitched or prefilled)
    question_tokens: int = 0  # the done event's prompt tokens beyond the context (instruction tail + question)
    timings_ms: dict[str, float] = field(default_factory=dict)  # the done event's server stage times
    text: str = ""  # the answer as its token events streamed it
    token_events: int = 0  # each carries whatever text was ready: one token, several, or none
    error: str | None = None
    refused: bool = False
    gateway: int = 0  # which gateway replica it asked (`drive`'s labels)


@dataclass
class ModeReport:
    mode: str
    requests: int
    errors: int
    refused: int
    ttft_ms: dict[str, float]  # p50, p95, p99 as the client saw it
    server_ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]  # p50, p95
    output_tokens_per_s: float
    kv: dict[str, int]
    first_errors: list[str]
    # p50 of each server stage (the done event's `timings_ms`: queue, engine_wait, retrieve, prefill, ...), so a
    # TTFT that grows with load says where it waits
    stage_ms: dict[str, float] = field(default_factory=dict)


@dataclass
class LoadReport:
    config: dict[str, Any]
    ingest_s: float
    chunks: int
    duration_s: float
    modes: list[ModeReport]
    table: str = ""
    plot: str = ""


# ---- workload ---------------------------------------------------------------------------------------------


def topic_name(index: int) -> str:
    """A made-up word per topic (distinct for every index), so retrieval has one clear best document."""
    word, n = [], index + 1
    while n:
        n, digit = divmod(n - 1, len(_SYLLABLES))
        word.append(_SYLLABLES[digit])
    return "".join(reversed(word)) + "ite"


def corpus(topics: int, sentences: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    documents = []
    for t in range(topics):
        name = topic_name(t)
        lines = [
            f"The {name} {rng.choice(_VERBS)} near the {rng.choice(_PLACES)} in {rng.choice(_SEASONS)}, "
            f"about {rng.randint(2, 900)} of them at a time, record {t}-{s}."
            for s in range(sentences)
        ]
        documents.append({"id": f"topic-{t}", "text": f"# {name}\n\n" + " ".join(lines), "metadata": {"topic": t}})
    return documents


def question(topic: int) -> str:
    return f"Where and when does the {topic_name(topic)} appear?"


def zipf_weights(topics: int, s: float) -> list[float]:
    return [1.0 / (rank**s) for rank in range(1, topics + 1)]


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


# ---- HTTP ---------------------------------------------------------------------------------------------------


async def sse(lines: AsyncIterator[str]) -> AsyncIterator[tuple[str, str]]:
    """(event, data) pairs of a text/event-stream body, as they arrive (the CLI's own decoder)."""
    decoder = SseDecoder()
    async for line in lines:
        event = decoder.feed(line)
        if event is not None:
            yield event
    last = decoder.finish()
    if last is not None:
        yield last


async def ingest(client: httpx.AsyncClient, documents: list[dict[str, Any]]) -> int:
    """Submit the corpus as one job and wait for it; the number of chunks stored."""
    reply = await client.post("/ingest", json={"documents": documents})
    reply.raise_for_status()
    job_id = reply.json()["job_id"]
    deadline = time.monotonic() + INGEST_TIMEOUT_S
    while time.monotonic() < deadline:
        status = (await client.get(f"/ingest/{job_id}")).json()
        if status["status"] == "done":
            return int(status["chunks"])
        if status["status"] == "failed":
            raise RuntimeError(f"ingest job {job_id} failed: {status['error']}")
        await asyncio.sleep(0.2)
    raise TimeoutError(f"ingest job {job_id} did not finish in {INGEST_TIMEOUT_S:.0f} s")


async def ask(client: httpx.AsyncClient, config: LoadConfig, result: Result) -> None:
    body = {
        "question": question(result.topic),
        "mode": result.mode,
        "top_k": config.top_k,
        "max_new_tokens": config.max_new_tokens,
        "stream": True,
    }
    sent = time.perf_counter()
    first: float | None = None
    try:
        async with client.stream("POST", "/ask", json=body) as reply:
            if reply.status_code != 200:
                result.refused = reply.status_code == 503
                result.error = f"HTTP {reply.status_code}: {(await reply.aread())[:200]!r}"
                return
            async for event, data in sse(reply.aiter_lines()):
                if event == "token":
                    first = first or time.perf_counter()
                    result.text += json.loads(data)["text"]
                    result.token_events += 1
                elif event == "error":
                    result.error = f"error event: {data[:200]}"
                elif event == "done":
                    done = json.loads(data)
                    result.server_ttft_ms = float(done["ttft_ms"])
                    result.output_tokens = int(done["output_tokens"])
                    result.kv = {tier: int(done["kv"].get(tier, 0)) for tier in TIERS}
                    result.context_tokens = int(done.get("context_tokens", 0))
                    result.question_tokens = int(done.get("prompt_tokens", 0)) - result.context_tokens
                    result.timings_ms = {k: float(v) for k, v in done.get("timings_ms", {}).items() if v is not None}
                    # The server's decode time, as kvstitch_time_per_output_token_seconds: the client cannot time
                    # tokens, since a token event carries whatever text is complete (several tokens, or none).
                    if result.output_tokens > 1:
                        result.tpot_ms = float(done["timings_ms"]["decode"]) / (result.output_tokens - 1)
    except httpx.HTTPError as err:
        result.error = f"{type(err).__name__}: {err}"
    finally:
        result.total_ms = (time.perf_counter() - sent) * 1e3
    if result.error is None and result.server_ttft_ms is None:
        result.error = "the stream ended without a done event"
    if first is not None:
        result.ttft_ms = (first - sent) * 1e3


async def run_load(config: LoadConfig) -> LoadReport:
    """Ingest, load, report (table, JSON and plot under `config.out_dir`)."""
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    async with client_pools(config.url, config.concurrency, headers) as clients:
        began = time.perf_counter()
        chunks = await ingest(clients[0], corpus(config.topics, config.sentences_per_topic, config.seed))
        ingest_s = time.perf_counter() - began
        results, duration_s = await drive(clients, config)
    report = LoadReport(
        config={k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items() if k != "api_key"},
        ingest_s=ingest_s,
        chunks=chunks,
        duration_s=duration_s,
        modes=[mode_report(mode, [r for r in results if r.mode == mode], duration_s) for mode in config.modes],
    )
    report.table = table(report)
    config.out_dir.mkdir(parents=True, exist_ok=True)
    report.plot = str(plot(results, config.out_dir / "ttft.png"))
    (config.out_dir / "report.json").write_text(json.dumps(asdict(report), indent=2), encoding="utf-8")
    return report


CLIENTS_PER_POOL = 8  # simulated clients sharing one HTTP connection pool


@contextlib.asynccontextmanager
async def client_pools(
    url: str, concurrency: int, headers: dict[str, str] | None = None
) -> AsyncIterator[list[httpx.AsyncClient]]:
    """HTTP clients for `drive`, one per CLIENTS_PER_POOL simulated clients, each keeping all its connections. One
    pool for every client costs the load generator O(connections) at each request and response end (httpcore scans
    its whole pool): 5-10 ms of CPU an answer at 128 clients, which caps a one-process load generator near 100-200
    answers/s and, on a small machine, takes the server's cores."""
    size = CLIENTS_PER_POOL + 2  # httpx keeps 20 idle connections by default: answers ending together reconnected
    limits = httpx.Limits(max_connections=size, max_keepalive_connections=size)
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S)
    pools = -(-concurrency // CLIENTS_PER_POOL)
    clients = [httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=timeout) for _ in range(pools)]
    try:
        yield clients
    finally:
        for client in clients:
            await client.aclose()


@contextlib.asynccontextmanager
async def gateway_pools(
    urls: Sequence[str], concurrency: int, headers: dict[str, str] | None = None
) -> AsyncIterator[tuple[list[httpx.AsyncClient], list[int]]]:
    """`client_pools` for each of several gateway replicas, interleaved so that `drive`'s client loop i asks
    gateway i mod N (as a Service spreads connections over its pods), with each pool's gateway index as its label."""
    per_gateway = -(-concurrency // len(urls))
    async with contextlib.AsyncExitStack() as stack:
        pools = [await stack.enter_async_context(client_pools(url, per_gateway, headers)) for url in urls]
        order = [(j, g) for j in range(max(len(p) for p in pools)) for g in range(len(pools)) if j < len(pools[g])]
        yield [pools[g][j] for j, g in order], [g for _, g in order]


@contextlib.asynccontextmanager
async def assigned_pools(
    urls: Sequence[str], gateways: Sequence[int], headers: dict[str, str] | None = None
) -> AsyncIterator[list[httpx.AsyncClient]]:
    """`drive`'s clients when each client loop's gateway is given: loop i asks `urls[gateways[i]]`. One entry per
    loop (so `drive`'s loop i takes entry i; pass `gateways` as its labels), the k-th loop of a gateway on its
    pool k mod P, P pools for each gateway asked (`client_pools` of the busiest gateway's loops). For
    gateways[i] == i mod N this is `gateway_pools`' assignment, pool for pool."""
    counts = [sum(g == index for g in gateways) for index in range(len(urls))]
    per_gateway = max(counts, default=0)
    async with contextlib.AsyncExitStack() as stack:
        pools = {
            g: await stack.enter_async_context(client_pools(url, per_gateway, headers))
            for g, url in enumerate(urls)
            if counts[g]
        }
        ranks = [0] * len(urls)
        assigned = []
        for g in gateways:
            assigned.append(pools[g][ranks[g] % len(pools[g])])
            ranks[g] += 1
        yield assigned


async def drive(
    client: httpx.AsyncClient | Sequence[httpx.AsyncClient], config: LoadConfig, labels: Sequence[int] = ()
) -> tuple[list[Result], float]:
    """The load phase alone (the corpus already ingested): every question's result and the seconds it ran. Given
    several clients, client loop i asks through client i mod N; each result names the gateway it asked: its
    client's entry in `labels` (`gateway_pools`' gateway of each pool), 0 without labels (one gateway)."""
    clients = [client] if isinstance(client, httpx.AsyncClient) else list(client)
    names = list(labels) or [0] * len(clients)
    rng = random.Random(config.seed)
    weights = zipf_weights(config.topics, config.zipf_s)
    # Drawn up front from one seeded generator, so a run's sequence of questions is reproducible.
    plan = [
        (config.modes[i % len(config.modes)], rng.choices(range(config.topics), weights)[0])
        for i in range(config.max_requests)
    ]
    results: list[Result] = []
    start = time.perf_counter()
    deadline = start + config.duration_s

    async def client_loop(index: int) -> None:
        while time.perf_counter() < deadline and len(results) < len(plan):
            mode, topic = plan[len(results)]
            result = Result(mode, topic, time.perf_counter() - start, gateway=names[index])
            results.append(result)  # claimed before awaiting, so no two clients take the same slot
            await ask(clients[index], config, result)

    await asyncio.gather(*(client_loop(i % len(clients)) for i in range(config.concurrency)))
    return results, time.perf_counter() - start


# ---- report -------------------------------------------------------------------------------------------------


def mode_report(mode: str, results: list[Result], duration_s: float) -> ModeReport:
    """One mode's percentiles, throughput, errors and tier hits over its results."""
    ok = [r for r in results if r.error is None]
    failed = [r for r in results if r.error is not None]
    ttft = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    server = [r.server_ttft_ms for r in ok if r.server_ttft_ms is not None]
    tpot = [r.tpot_ms for r in ok if r.tpot_ms is not None]
    return ModeReport(
        mode=mode,
        requests=len(results),
        errors=sum(not r.refused for r in failed),
        refused=sum(r.refused for r in failed),
        ttft_ms={f"p{int(q * 100)}": percentile(ttft, q) for q in (0.5, 0.95, 0.99)},
        server_ttft_ms={f"p{int(q * 100)}": percentile(server, q) for q in (0.5, 0.95, 0.99)},
        tpot_ms={f"p{int(q * 100)}": percentile(tpot, q) for q in (0.5, 0.95)},
        output_tokens_per_s=sum(r.output_tokens for r in ok) / duration_s if duration_s > 0 else 0.0,
        kv={tier: sum(r.kv.get(tier, 0) for r in ok) for tier in TIERS},
        first_errors=[r.error for r in failed[:5] if r.error is not None],
        stage_ms=stage_medians(ok),
    )


def stage_medians(results: list[Result]) -> dict[str, float]:
    """Each server stage's p50 over the results that report it."""
    stages = sorted({stage for r in results for stage in r.timings_ms})
    return {stage: percentile([r.timings_ms[stage] for r in results if stage in r.timings_ms], 0.5) for stage in stages}


def table(report: LoadReport) -> str:
    head = (
        "| mode | requests | errors | 503 | TTFT p50 | p95 | p99 (ms) | server TTFT p50 (ms) | TPOT p50 | p95 (ms) "
        "| tokens/s | gpu | host | disk | miss |"
    )
    rows = [head, "|" + "---|" * 15]
    for m in report.modes:
        t, s, d = m.ttft_ms, m.server_ttft_ms, m.tpot_ms
        rows.append(
            f"| {m.mode} | {m.requests} | {m.errors} | {m.refused} | {t['p50']:.1f} | {t['p95']:.1f} | {t['p99']:.1f} "
            f"| {s['p50']:.1f} | {d['p50']:.2f} | {d['p95']:.2f} | {m.output_tokens_per_s:.1f} | "
            + " | ".join(str(m.kv[tier]) for tier in TIERS)
            + " |"
        )
    return "\n".join(rows)


def plot(results: list[Result], path: Path) -> Path:
    """TTFT over the run (each question a dot) and its distribution (CDF), per mode."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and in CI
    import matplotlib.pyplot as plt

    fig, (over_time, cdf) = plt.subplots(1, 2, figsize=(12, 4.5))
    for mode in sorted({r.mode for r in results}):
        points = [(r.started_s, r.ttft_ms) for r in results if r.mode == mode and r.ttft_ms is not None]
        if not points:
            continue
        over_time.scatter([p[0] for p in points], [p[1] for p in points], s=8, label=mode)
        values = sorted(p[1] for p in points)
        cdf.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", label=mode)
    over_time.set(xlabel="time since start (s)", ylabel="TTFT (ms)", title="TTFT per question")
    cdf.set(xlabel="TTFT (ms)", ylabel="fraction of questions", title="TTFT distribution")
    for axes in (over_time, cdf):
        axes.grid(alpha=0.3)
        axes.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--topics", type=int, default=50)
    parser.add_argument("--sentences", type=int, default=12, help="sentences per topic document")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of load after ingestion")
    parser.add_argument("--max-requests", type=int, default=500)
    parser.add_argument("--modes", nargs="+", default=["turbo", "naive"], choices=["turbo", "naive"])
    parser.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the topic choice")
    parser.add_argument("--top-k", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--out", type=Path, default=Path("loadtest-out"))
    args = parser.parse_args(argv)
    try:
        config = LoadConfig(
            url=args.url,
            out_dir=args.out,
            topics=args.topics,
            sentences_per_topic=args.sentences,
            concurrency=args.concurrency,
            duration_s=args.duration,
            max_requests=args.max_requests,
            modes=tuple(args.modes),
            zipf_s=args.zipf,
            top_k=args.top_k,
            max_new_tokens=args.max_new_tokens,
            seed=args.seed,
            api_key=args.api_key,
        )
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    report = asyncio.run(run_load(config))
    print(f"ingested {report.chunks} chunks in {report.ingest_s:.1f} s; load ran {report.duration_s:.1f} s")
    print(report.table)
    print(f"plot: {report.plot}; report: {config.out_dir / 'report.json'}")
    for mode in report.modes:
        for error in mode.first_errors:
            print(f"{mode.mode}: {error}", file=sys.stderr)
    return 1 if any(m.errors for m in report.modes) else 0


if __name__ == "__main__":
    raise SystemExit(main())
