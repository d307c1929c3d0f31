"""The fleet benchmark's clients over several processes (`--client-processes`): how a level's clients, seeds and
questions are split, each client's gateway and connection pool, its results' way back, and the CPU accounting of
every client process (the end-to-end run with two is in test_serve_fleet.py)."""

from __future__ import annotations

import asyncio
import os
import pickle
import subprocess
import sys
import threading
import time

import httpx
import pytest

from loadtest import load, serve_fleet
from loadtest.proc_cpu import cpu_snapshot
from loadtest.serve_fleet import SEED_STRIDE, ClientShare, FleetWatched, client_shares, parse_args, retrieval_split


def test_a_levels_clients_go_to_process_index_mod_k_with_their_gateways_seeds_and_questions() -> None:
    shares = client_shares(clients=10, processes=4, gateways=3, seed=16, max_requests=40)

    assert [s.clients for s in shares] == [(0, 4, 8), (1, 5, 9), (2, 6), (3, 7)]
    # Client j asks gateway j mod 3, as in one process: the labels are the global gateway indices.
    assert [s.gateways for s in shares] == [(0, 1, 2), (1, 2, 0), (2, 0), (0, 1)]
    assert [s.seed for s in shares] == [16 + i * SEED_STRIDE for i in range(4)]
    # One question each, the other 36 in proportion to the clients (3, 3, 2, 2 of 10), adding up to 40.
    assert [s.max_requests for s in shares] == [11, 12, 8, 9]
    assert [s.process for s in shares] == [0, 1, 2, 3]


def test_one_process_keeps_the_single_process_level_and_no_process_goes_without_a_client_or_a_question() -> None:
    assert client_shares(5, 1, 2, 64, 5000) == [ClientShare(0, (0, 1, 2, 3, 4), (0, 1, 0, 1, 0), 64, 5000)]
    assert client_shares(1, 4, 2, 7, 100) == [ClientShare(0, (0,), (0,), 7, 100)]
    # 2 questions for 4 clients: two processes, a question each.
    assert [(s.clients, s.max_requests) for s in client_shares(4, 4, 1, 0, 2)] == [((0, 2), 1), ((1, 3), 1)]
    uneven = client_shares(129, 4, 2, 0, 5000)
    assert [len(s.clients) for s in uneven] == [33, 32, 32, 32] and sum(s.max_requests for s in uneven) == 5000
    assert sorted(j for s in uneven for j in s.clients) == list(range(129))
    assert len({s.seed for s in uneven}) == 4
    with pytest.raises(ValueError, match="at least 1"):
        client_shares(4, 0, 1, 0, 10)


def test_the_option_defaults_to_four_processes_and_refuses_none() -> None:
    assert parse_args([]).client_processes == 4
    assert parse_args(["--client-processes", "1"]).client_processes == 1
    with pytest.raises(SystemExit):
        parse_args(["--client-processes", "0"])


def pools_of(clients: list[httpx.AsyncClient]) -> list[tuple[str, tuple[int, ...]]]:
    """Which loops share each HTTP client, and its gateway: the assignment, whatever the objects."""
    loops: dict[int, list[int]] = {}
    for i, client in enumerate(clients):
        loops.setdefault(id(client), []).append(i)
    by_id = {id(c): c for c in clients}
    return sorted((str(by_id[k].base_url), tuple(v)) for k, v in loops.items())


@pytest.mark.parametrize(("concurrency", "gateways"), [(1, 1), (20, 2), (17, 2), (128, 3), (2, 4)])
def test_one_share_pools_its_loops_as_the_single_process_gateway_pools_did(concurrency: int, gateways: int) -> None:
    urls = [f"http://127.0.0.1:{9 + g}" for g in range(gateways)]
    (share,) = client_shares(concurrency, 1, gateways, 0, 1000)

    async def both() -> tuple[list[httpx.AsyncClient], list[int], list[httpx.AsyncClient]]:
        async with load.gateway_pools(urls, concurrency) as (pools, labels):
            before = [pools[i % len(pools)] for i in range(concurrency)]  # `drive`'s loop i takes pool i mod P
            names = [labels[i % len(labels)] for i in range(concurrency)]
            async with load.assigned_pools(urls, share.gateways) as assigned:
                return before, names, assigned

    before, names, assigned = asyncio.run(both())

    assert list(share.gateways) == names
    assert len(assigned) == concurrency and pools_of(assigned) == pools_of(before)


def test_a_later_process_asks_each_clients_gateway_eight_clients_a_pool_at_most() -> None:
    urls = [f"http://127.0.0.1:{9 + g}" for g in range(3)]
    share = client_shares(100, 4, 3, 0, 1000)[1]  # clients 1, 5, 9, ...: gateways 1, 2, 0, 1, ...

    async def pooled() -> list[httpx.AsyncClient]:
        async with load.assigned_pools(urls, share.gateways) as assigned:
            return assigned

    assigned = asyncio.run(pooled())

    assert [str(c.base_url).rstrip("/") for c in assigned] == [urls[j % 3] for j in share.clients]
    assert all(len(loops) <= load.CLIENTS_PER_POOL for _, loops in pools_of(assigned))
    assert all(c.is_closed for c in assigned)


def test_results_come_back_from_a_client_process_whole() -> None:
    result = load.Result("turbo", 3, 1.25, ttft_ms=12.0, server_ttft_ms=9.5, output_tokens=4, gateway=2)
    result.kv = {"gpu": 3, "host": 1, "disk": 0, "miss": 0}
    result.timings_ms = {"retrieve": 2.5, "decode": 7.0}

    assert pickle.loads(pickle.dumps(result)) == result


def test_every_client_process_is_watched_as_the_clients_and_none_as_another_child() -> None:
    sleepers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(3)]
    try:
        pids = [p.pid for p in sleepers[:2]]
        watched = FleetWatched(embedder_pids=list, clients_pid=pids[0], client_pids=pids)

        roles = watched.roles()
        snapshot = cpu_snapshot(roles)
    finally:
        for sleeper in sleepers:
            sleeper.kill()
            sleeper.wait()

    assert roles["clients"] == pids and roles["gateway"] == os.getpid()
    others = roles["other children"]
    assert isinstance(others, list) and sleepers[2].pid in others and not set(pids) & set(others)
    assert set(snapshot.processes["clients"]) == set(pids)  # both counted, their CPU summed by `cpu_use`


def test_the_retrieval_split_is_the_mean_ms_a_question_by_stage() -> None:
    def page(wait: float, embed: float, search: float, questions: int) -> str:
        return (
            "# HELP kvstitch_retrieval_seconds_total x\n"
            f'kvstitch_retrieval_seconds_total{{stage="wait"}} {wait}\n'
            f'kvstitch_retrieval_seconds_total{{stage="embed"}} {embed}\n'
            f'kvstitch_retrieval_seconds_total{{stage="search"}} {search}\n'
            f"kvstitch_retrieval_questions_total {questions}.0\n"
        )

    split = retrieval_split(page(1.0, 2.0, 0.5, 10), page(1.1, 2.6, 0.7, 50))
    assert split == {"wait": 2.5, "embed": 15.0, "search": 5.0}
    assert retrieval_split(page(1.0, 2.0, 0.5, 10), page(1.0, 2.0, 0.5, 10)) == {}


def test_the_first_gateway_ingests_alone_and_the_replicas_side_by_side(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first gateway's ingest computes the corpus's KV: it ends before any replica's begins; the replicas'
    ingests (embedding and writing their own collections) then overlap."""
    spans: dict[str, tuple[float, float]] = {}
    running, most = [0], [0]
    lock = threading.Lock()

    def ingest(args: object, url: str) -> tuple[int, float]:
        began = time.perf_counter()
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.2)
        with lock:
            running[0] -= 1
        spans[url] = (began, time.perf_counter())
        return 40, 0.2

    monkeypatch.setattr(serve_fleet, "clients_ingest", ingest)
    chunks, seconds = serve_fleet.clients_ingest_all(parse_args([]), ["g0", "g1", "g2", "g3"])

    assert chunks == 40 and 0.4 <= seconds < 0.75  # the first, then the three at once (not 0.8 in turn)
    assert all(spans["g0"][1] <= spans[url][0] for url in ("g1", "g2", "g3"))
    assert most[0] == 3


def test_replicas_that_ingest_different_counts_stop_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    counts = {"g0": 40, "g1": 40, "g2": 39}
    monkeypatch.setattr(serve_fleet, "clients_ingest", lambda args, url: (counts[url], 0.0))
    with pytest.raises(RuntimeError, match=r"different chunk counts: \[40, 40, 39\]"):
        serve_fleet.clients_ingest_all(parse_args([]), ["g0", "g1", "g2"])
