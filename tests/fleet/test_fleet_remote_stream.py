"""How the gateway reads an engine's JSON lines: tokens that arrived together leave as one event, none waits for
another, a line cut across reads is whole, an error line still lets the tokens before it out, and a finished
answer's connection is kept for the next."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import httpx
import pytest
import uvicorn

from loadtest.canned_engine import CANNED_TOKEN, CannedConfig, CannedEngine
from service.api.engine_app import create_engine_app
from service.devtools.ports import free_port
from service.facade.engine import (
    ENGINE_KEEP_ALIVE_S,
    GATEWAY_KEEP_ALIVE_S,
    EngineAnswerRequest,
    EngineStreamError,
    WireChunk,
    error_line,
    event_line,
)
from service.facade.types import AnswerEvent, DoneEvent, Logprob, TokenEvent
from service.fleet.routing import ChunkRef
from service.kvcache.keys import KeySpace
from service.metrics import Metrics
from service.serving.fleet_gateway import Fleet
from service.serving.remote_answer import (
    CLIENT_POOLS,
    RemoteAnswer,
    _arrived_lines,
    _clients,
    _parsed,
    engine_client,
    merged_tokens,
)
from service.settings import Settings

DONE = DoneEvent("turbo", "reordered", 1.0, 3, "length", {}, {"gpu": 1}, "abc", 10, 5)


def body(parts: Sequence[bytes], pause_s: float) -> httpx.Response:
    async def chunks() -> AsyncIterator[bytes]:
        for part in parts:
            if pause_s:
                await asyncio.sleep(pause_s)
            yield part

    return httpx.Response(200, content=chunks())


def batches(parts: Sequence[bytes], pause_s: float = 0.0) -> list[list[bytes]]:
    async def read() -> list[list[bytes]]:
        return [batch async for batch in _arrived_lines(body(parts, pause_s))]

    return asyncio.run(read())


def test_consecutive_tokens_merge_with_their_log_probabilities_in_order() -> None:
    a, b = Logprob("a", -0.1, b"a"), Logprob("b", -0.2, b"b")
    events: list[AnswerEvent] = [TokenEvent("a", (a,)), TokenEvent("b", (b,)), TokenEvent("c"), DONE]

    assert merged_tokens(events) == [TokenEvent("abc", (a, b)), DONE]
    assert merged_tokens([DONE]) == [DONE]
    assert merged_tokens([]) == []


def test_lines_that_arrived_together_come_as_one_batch() -> None:
    lines = [event_line(TokenEvent(t)) for t in "abc"] + [event_line(DONE)]

    together = batches(lines)
    apart = batches(lines, pause_s=0.02)

    assert together == [[line.rstrip(b"\n") for line in lines]]
    assert apart == [[line.rstrip(b"\n")] for line in lines]


def test_a_line_cut_across_reads_is_read_whole_and_a_last_line_needs_no_newline() -> None:
    line = event_line(TokenEvent("hello"))

    cut = batches([line[:5], line[5:] + b"\n" + line.rstrip(b"\n")], pause_s=0.02)

    assert cut == [[line.rstrip(b"\n")], [line.rstrip(b"\n")]]


def test_a_read_error_ends_the_lines_after_the_ones_before_it() -> None:
    async def failing() -> AsyncIterator[bytes]:
        yield event_line(TokenEvent("a"))
        await asyncio.sleep(0.02)
        raise httpx.ReadError("engine gone")

    async def read() -> tuple[list[list[bytes]], str]:
        seen = []
        try:
            async for batch in _arrived_lines(httpx.Response(200, content=failing())):
                seen.append(batch)
        except httpx.ReadError as err:
            return seen, str(err)
        return seen, ""

    seen, error = asyncio.run(read())

    assert seen == [[event_line(TokenEvent("a")).rstrip(b"\n")]] and error == "engine gone"


def test_an_error_line_keeps_the_tokens_before_it() -> None:
    events, failure = _parsed([event_line(TokenEvent("a")).strip(), error_line("out of memory"), b"{}"])

    assert events == [TokenEvent("a")]
    assert isinstance(failure, EngineStreamError) and str(failure) == "out of memory"
    assert isinstance(_parsed([b"not json"])[1], ValueError)


def test_the_request_json_keeps_every_field() -> None:
    """`to_json` builds the body by hand (no `asdict`): it must still hold each field of the request."""
    request = EngineAnswerRequest("why?", ())

    assert set(request.to_json()) == set(EngineAnswerRequest.__dataclass_fields__)


class AnswerClients:
    """ASGI middleware: the client port of every POST /answer (one port per TCP connection)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.ports: list[int] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/answer":
            self.ports.append(scope["client"][1])
        await self.app(scope, receive, send)


@contextlib.contextmanager
def served_canned_engine(token_interval_s: float = 0.0) -> Iterator[tuple[str, AnswerClients, KeySpace]]:
    """The benchmark's canned engine (`kvstitch engine`'s app, 3 tokens an answer, one every `token_interval_s`) on a
    thread of its own."""
    space = KeySpace("fp", "tpl", "float32")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    canned = CannedEngine(CannedConfig(dataclasses.asdict(space), 3, token_interval_s), url)
    counted = AnswerClients(create_engine_app(canned))
    config = uvicorn.Config(
        counted, host="127.0.0.1", port=port, log_level="warning", timeout_keep_alive=ENGINE_KEEP_ALIVE_S
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the canned engine did not start"
        time.sleep(0.02)
    try:
        yield url, counted, space
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture
def canned_engine() -> Iterator[tuple[str, AnswerClients, KeySpace]]:
    with served_canned_engine() as served:
        yield served


def test_answers_in_turn_reuse_the_gateways_connections_to_the_engine(
    canned_engine: tuple[str, AnswerClients, KeySpace],
) -> None:
    """An answer's body is read to its end after the done event, so its connection goes back to its client's pool:
    3 answers per pool in turn open one connection per pool, not one per answer."""
    url, counted, space = canned_engine
    fleet = Fleet(Settings(engines=url, _env_file=None), space)  # type: ignore[call-arg]
    fleet.probe()
    request = EngineAnswerRequest("why?", (WireChunk("c", "d", 1.0, "text", (1, 2, 3)),))
    answers = 3 * CLIENT_POOLS

    async def ask_in_turn() -> list[list[AnswerEvent]]:
        got = []
        for _ in range(answers):
            remote = RemoteAnswer(fleet, Metrics(), request, [ChunkRef("k", 3)], [], time.perf_counter(), 0.0)
            await remote.open()
            got.append([event async for event in remote])
        for client in _clients.pop(asyncio.get_running_loop(), []):
            await client.aclose()
        return got

    events = asyncio.run(ask_in_turn())
    fleet.close()

    assert all(e[-1].answer == CANNED_TOKEN * 3 for e in events if isinstance(e[-1], DoneEvent))
    assert [type(e[-1]) for e in events] == [DoneEvent] * answers
    assert len(counted.ports) == answers
    assert len(set(counted.ports)) == CLIENT_POOLS
    assert [s.running for s in fleet.engines()] == [0]  # every answer gave its place back


def test_the_done_events_transport_is_the_gateways_ttft_less_retrieval_and_the_engines_own_ttft() -> None:
    """The gateway's done event adds `transport`: its TTFT (from the question's arrival at the gateway) less its
    retrieval and less the engine's reported TTFT (here the canned engine's 30 ms before its first token), so the
    stages add up to what the client saw. The question arrived 50 ms before the post, 20 of them retrieving."""
    with served_canned_engine(token_interval_s=0.03) as (url, _, space):
        fleet = Fleet(Settings(engines=url, _env_file=None), space)  # type: ignore[call-arg]
        fleet.probe()
        request = EngineAnswerRequest("why?", (WireChunk("c", "d", 1.0, "text", (1, 2, 3)),))

        async def ask() -> list[AnswerEvent]:
            started = time.perf_counter() - 0.05
            remote = RemoteAnswer(fleet, Metrics(), request, [ChunkRef("k", 3)], [], started, 20.0)
            await remote.open()
            events = [event async for event in remote]
            for client in _clients.pop(asyncio.get_running_loop(), []):
                await client.aclose()
            return events

        events = asyncio.run(ask())
        fleet.close()

    done = events[-1]
    assert isinstance(done, DoneEvent)
    engine_ttft = done.ttft_ms - done.timings_ms["retrieve"] - done.timings_ms["transport"]
    assert done.timings_ms["retrieve"] == 20.0
    assert 29.0 <= engine_ttft < 200.0  # the canned engine's own: its 30 ms sleep (timer granularity aside)
    assert done.timings_ms["transport"] >= 29.0  # the 30 ms between the arrival and the post, at least
    assert done.ttft_ms >= 50.0 + engine_ttft - 1.0


def test_the_gateway_retires_an_idle_engine_connection_before_the_engine_closes_it() -> None:
    """A connection the engine closes for idleness just as the gateway reuses it fails that question's post (and takes
    the engine out of routing): the gateway's idle expiry is below the engine server's keep-alive."""

    async def expiry() -> float:
        client = engine_client()
        try:
            seconds: float = client._transport._pool._keepalive_expiry  # type: ignore[attr-defined]
            return seconds
        finally:
            for each in _clients.pop(asyncio.get_running_loop(), []):
                await each.aclose()

    assert asyncio.run(expiry()) == GATEWAY_KEEP_ALIVE_S <= ENGINE_KEEP_ALIVE_S / 2
