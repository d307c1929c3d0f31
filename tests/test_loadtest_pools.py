"""The load generator's HTTP clients: a connection pool per 8 simulated clients, each client on one pool for the
whole run, every question asked once, and the pools closed after."""

from __future__ import annotations

import asyncio
import collections
import json
from pathlib import Path

import httpx

from loadtest import load

DONE = {"ttft_ms": 1.0, "output_tokens": 1, "kv": {}, "timings_ms": {"decode": 0.0}}
ANSWER = ('event: token\ndata: {"text": "hi"}\n\n' + f"event: done\ndata: {json.dumps(DONE)}\n\n").encode()


def test_simulated_clients_share_a_pool_per_eight_and_every_answer_is_read(tmp_path: Path) -> None:
    config = load.LoadConfig(
        "http://127.0.0.1:9", tmp_path, concurrency=20, duration_s=30, max_requests=60, modes=("turbo",)
    )
    served: collections.Counter[int] = collections.Counter()

    async def run() -> tuple[list[httpx.AsyncClient], list[load.Result]]:
        async with load.client_pools(config.url, config.concurrency) as clients:
            for i, client in enumerate(clients):

                async def answer(request: httpx.Request, pool: int = i) -> httpx.Response:
                    served[pool] += 1
                    await asyncio.sleep(0.001)  # the other clients run meanwhile, as over a socket
                    return httpx.Response(200, content=ANSWER, headers={"content-type": "text/event-stream"})

                client._transport = httpx.MockTransport(answer)
            results, _ = await load.drive(clients, config)
        return clients, results

    clients, results = asyncio.run(run())

    assert len(clients) == 3 and all(client.is_closed for client in clients)
    assert len(results) == 60 and all(r.error is None and r.text == "hi" for r in results)
    # 20 simulated clients over 3 pools in turn: 7, 7 and 6 of them; each pool serves its clients' questions.
    assert sum(served.values()) == 60 and set(served) == {0, 1, 2}
    assert served[2] < served[0] and served[2] < served[1]  # 6 clients against 7: fewer questions by the run's end


def test_gateway_pools_alternate_gateways_and_label_each_result_with_its_gateway(tmp_path: Path) -> None:
    urls = ["http://127.0.0.1:9", "http://127.0.0.1:10"]
    config = load.LoadConfig(urls[0], tmp_path, concurrency=20, duration_s=30, max_requests=60, modes=("turbo",))
    served: collections.Counter[str] = collections.Counter()

    async def run() -> tuple[list[httpx.AsyncClient], list[int], list[load.Result]]:
        async with load.gateway_pools(urls, config.concurrency) as (clients, labels):
            for client in clients:

                async def answer(request: httpx.Request) -> httpx.Response:
                    served[f"{request.url.host}:{request.url.port}"] += 1
                    await asyncio.sleep(0.001)
                    return httpx.Response(200, content=ANSWER, headers={"content-type": "text/event-stream"})

                client._transport = httpx.MockTransport(answer)
            results, _ = await load.drive(clients, config, labels)
        return clients, labels, results

    clients, labels, results = asyncio.run(run())

    # 10 simulated clients a gateway, 2 pools each, interleaved: client loop i asks gateway i mod 2.
    assert labels == [0, 1, 0, 1] and [str(c.base_url).rstrip("/") for c in clients] == [*urls, *urls]
    assert all(client.is_closed for client in clients)
    assert len(results) == 60 and all(r.error is None for r in results)
    by_label = collections.Counter(r.gateway for r in results)
    assert by_label == {0: served["127.0.0.1:9"], 1: served["127.0.0.1:10"]} and min(by_label.values()) > 0
