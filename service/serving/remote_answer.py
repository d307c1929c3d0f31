"""An answer made on an engine process, as the gateway's HTTP layer sees every answer (`service.facade.AnswerStream`).

`open` routes the retrieved question (`Fleet.choose`) and posts it to the engine; the engine admits it or refuses
before the first byte, so a refusal (busy, not ready) or a connection that fails sends it to the next engine the
router picks, the failed one excluded: every refusal is raised from `open`, before the HTTP layer sends a status.
Iterating reads the engine's JSON lines. Until the first token arrives nothing has reached the client, so an engine
that dies then (connection reset, end of stream without `done`) costs only a retry on another engine; once a token
went out, the answer ends with an `UnavailableError` naming the engine, which /ask and /v1 send as an error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Sequence

import httpx

from service.errors import BusyError, InvalidRequestError, UnavailableError
from service.facade.engine import GATEWAY_KEEP_ALIVE_S, EngineAnswerRequest, EngineStreamError, parse_event
from service.facade.types import AnswerEvent, DoneEvent, Source, TokenEvent
from service.fleet.routing import ChunkRef
from service.metrics import Metrics
from service.serving.answer_session import observe_done
from service.serving.fleet_gateway import Fleet, NoEngineError, Routed

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 2.0
# An answer may wait in an engine's line and decode for minutes; a silent engine past this is taken for dead.
READ_TIMEOUT_S = 300.0
# The end of an answer's body after its done event: on the same write, or just after it.
END_OF_BODY_TIMEOUT_S = 0.5

# httpcore's pool checks every idle connection it holds (a poll and a getpeername call each) at every request and
# every response's end: one pool of a connection per answer in flight costs the event loop O(answers) per answer.
# Questions take the clients in turn, so each pool holds a share of the connections.
CLIENT_POOLS = 16
JSON_BODY = {"content-type": "application/json"}

_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, list[httpx.AsyncClient]] = weakref.WeakKeyDictionary()
_turns = itertools.count()


def engine_client() -> httpx.AsyncClient:
    """One of the running event loop's clients to the engines (their connections belong to that loop), in turn."""
    loop = asyncio.get_running_loop()
    clients = _clients.get(loop)
    if clients is None:
        timeout = httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
        limits = httpx.Limits(max_connections=None, keepalive_expiry=GATEWAY_KEEP_ALIVE_S)
        clients = _clients[loop] = [httpx.AsyncClient(timeout=timeout, limits=limits) for _ in range(CLIENT_POOLS)]
    return clients[next(_turns) % len(clients)]


class _RetryError(Exception):
    """The engine failed before the answer started: route again."""


class RemoteAnswer:
    """One question routed to an engine; iterated once."""

    def __init__(
        self,
        fleet: Fleet,
        metrics: Metrics,
        request: EngineAnswerRequest,
        chunks: Sequence[ChunkRef],
        sources: list[Source],
        started: float,
        retrieve_ms: float,
    ) -> None:
        self._fleet = fleet
        self._metrics = metrics
        self._request = request
        # Encoded here, on the caller's worker thread: the token ids of every chunk take a millisecond to encode,
        # which the event loop would spend at each post (and each retry).
        self._body = request.body()
        self._chunks = chunks
        self._sources = sources
        self._started = started
        self._retrieve_ms = retrieve_ms
        self._tried: list[str] = []
        self._routed: Routed | None = None
        self._response: httpx.Response | None = None
        self._done: DoneEvent | None = None
        self._iterated = False
        self._cancelled = False
        self._first_token_at: float | None = None
        self._closing: asyncio.Task[None] | None = None  # kept: the loop holds tasks only weakly

    @property
    def sources(self) -> list[Source]:
        return self._sources

    @property
    def dropped(self) -> int:
        return self._request.dropped

    @property
    def done(self) -> DoneEvent | None:
        return self._done

    @property
    def engine(self) -> str | None:
        """The id of the engine answering (the last one tried)."""
        return self._routed.decision.engine if self._routed is not None else None

    # ---- opening ----------------------------------------------------------------------------------------------

    async def open(self) -> None:
        """Route and post until an engine admits the question; the refusals of `Facade.answer` otherwise."""
        busy = 0
        while True:
            try:
                routed = self._fleet.choose(self._chunks, exclude=self._tried)
            except NoEngineError as err:
                if busy and busy == len(self._tried):
                    raise BusyError(f"every engine is busy; retry shortly ({err})") from err
                raise UnavailableError("the engines", err) from err
            self._tried.append(routed.url)
            if len(self._tried) > 1:
                self._fleet.reroutes += 1
                self._metrics.fleet_reroutes.inc()
            try:
                self._response = await self._post(routed)
            except _RetryError as err:
                busy += "busy" in str(err)
                continue
            self._routed = routed
            self._metrics.observe_route(routed.decision)
            return

    async def _post(self, routed: Routed) -> httpx.Response:
        client = engine_client()
        request = client.build_request("POST", f"{routed.url}/answer", content=self._body, headers=JSON_BODY)
        try:
            response = await client.send(request, stream=True)
        except httpx.TransportError as err:
            self._fleet.finished(routed.url)
            self._fleet.mark_failed(routed.url, f"{type(err).__name__}: {err}")
            raise _RetryError(str(err)) from err
        if response.status_code == 200:
            return response
        body = (await response.aread()).decode(errors="replace")[:500]
        await response.aclose()
        self._fleet.finished(routed.url)
        if response.status_code == 422:
            raise InvalidRequestError("question", f"the engine refused it: {body}")
        if response.status_code == 503:
            raise _RetryError(f"busy or not ready: {body}")
        self._fleet.mark_failed(routed.url, f"status {response.status_code}: {body}")
        raise _RetryError(f"status {response.status_code}")

    # ---- iterating --------------------------------------------------------------------------------------------

    def __aiter__(self) -> AsyncIterator[AnswerEvent]:
        if self._iterated:
            raise RuntimeError("an answer stream is iterated once")
        self._iterated = True
        return self._events()

    async def _events(self) -> AsyncIterator[AnswerEvent]:
        streaming = False
        try:
            while True:
                try:
                    async for event in self._read():
                        streaming = True
                        yield event
                    return
                except _RetryError as err:
                    if streaming:
                        raise UnavailableError(f"engine {self.engine}", f"it failed mid-answer ({err})") from err
                    log.warning("engine %s failed before answering (%s); routing the question again", self.engine, err)
                    await self.open()
        finally:
            await self._close()

    async def _read(self) -> AsyncIterator[AnswerEvent]:
        """The events of the current engine's answer; `_RetryError` when its connection fails or ends early."""
        assert self._response is not None and self._routed is not None
        routed = self._routed
        try:
            # Closed on the way out, so its reader task is gone before the response is closed.
            async with contextlib.aclosing(_arrived_lines(self._response)) as arrived:
                async for lines in arrived:
                    events, failure = _parsed(lines)
                    for event in merged_tokens(events):
                        if isinstance(event, DoneEvent):
                            yield self._finish(event)
                            await _read_to_the_end(arrived)
                            return
                        if self._first_token_at is None:
                            self._first_token_at = time.perf_counter()
                        yield event
                    if isinstance(failure, EngineStreamError):
                        raise RuntimeError(f"engine {routed.decision.engine}: {failure}") from failure
                    if failure is not None:
                        raise failure
        except httpx.HTTPError as err:
            await self._drop(routed, f"{type(err).__name__}: {err}")
            raise _RetryError(f"{type(err).__name__}: {err}") from err
        await self._drop(routed, "the answer ended without a done event")
        raise _RetryError("the answer ended without a done event")

    async def _drop(self, routed: Routed, why: str) -> None:
        self._fleet.mark_failed(routed.url, why)
        await self._close()

    def _finish(self, done: DoneEvent) -> DoneEvent:
        """The engine's done event with the gateway's view of the time: TTFT from the request's arrival here, and
        `transport`, the part of it neither retrieval here nor the engine's own TTFT (its arrival there to its first
        token read there) accounts for: the post, the engine's API process and the first token's way back (a
        failed attempt before a retry included). Without it the stages would not add up to what the client saw."""
        ttft_ms = (self._first_token_at - self._started) * 1e3 if self._first_token_at else done.ttft_ms
        transport_ms = max(0.0, ttft_ms - self._retrieve_ms - done.ttft_ms) if self._first_token_at else 0.0
        timings = {**done.timings_ms, "retrieve": self._retrieve_ms, "transport": transport_ms}
        done = dataclasses.replace(done, ttft_ms=ttft_ms, timings_ms=timings)
        self._done = done
        observe_done(self._metrics, done)
        return done

    async def _close(self) -> None:
        response, self._response = self._response, None
        if response is not None:
            await response.aclose()
            if self._routed is not None:
                self._fleet.finished(self._routed.url)

    def cancel(self) -> None:
        """Close the engine connection (the engine cancels the answer when it sees the client gone)."""
        self._cancelled = True
        if self._response is None:
            return
        with contextlib.suppress(RuntimeError):  # no loop running: nothing to close on
            self._closing = asyncio.get_running_loop().create_task(self._close())


async def _arrived_lines(response: httpx.Response) -> AsyncGenerator[list[bytes], None]:
    """The response's non-empty lines, in the batches that arrived together (a last line without its newline
    included). The body's HTTP chunks (one per engine event) are read by a task of their own as they arrive, so
    those that were already in the socket when this iteration woke come as one batch: httpx hands them over one
    chunk, and one wake-up, at a time."""
    arrived: asyncio.Queue[bytes | Exception | None] = asyncio.Queue()
    reader = asyncio.create_task(_read_body(response, arrived))
    pending = b""
    try:
        while True:
            items = [await arrived.get()]
            while not arrived.empty():
                items.append(arrived.get_nowait())
            *lines, pending = (pending + b"".join(i for i in items if isinstance(i, bytes))).split(b"\n")
            batch = [line for line in lines if line.strip()]
            if batch:
                yield batch
            if isinstance(items[-1], Exception):
                raise items[-1]
            if items[-1] is None:
                break
    finally:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
    if pending.strip():
        yield [pending]


async def _read_to_the_end(arrived: AsyncIterator[list[bytes]]) -> None:
    """What follows the done event (the body's last chunk), so that closing the response gives its connection back
    to the pool: httpcore drops a connection whose response was closed unread, and the next answer then pays a new
    TCP connection on both sides. An engine that sends more than that, or not at once, or fails now, only loses
    the connection: the answer is whole."""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(END_OF_BODY_TIMEOUT_S):
            async for lines in arrived:
                log.warning("engine sent %d lines after its done event; ignored", len(lines))
                return


async def _read_body(response: httpx.Response, arrived: asyncio.Queue[bytes | Exception | None]) -> None:
    """Every chunk of the body into `arrived`, then None, or the error that ended the reading."""
    try:
        async for data in response.aiter_bytes():
            arrived.put_nowait(data)
    except Exception as err:
        arrived.put_nowait(err)
        return
    arrived.put_nowait(None)


def _parsed(lines: Sequence[bytes]) -> tuple[list[AnswerEvent], Exception | None]:
    """The events of the lines up to the first that fails to parse or is an `error` line, and that failure."""
    events: list[AnswerEvent] = []
    for line in lines:
        try:
            events.append(parse_event(line))
        except (EngineStreamError, ValueError) as err:
            return events, err
    return events, None


def merged_tokens(events: Sequence[AnswerEvent]) -> list[AnswerEvent]:
    """Consecutive token events as one (their texts and log-probabilities joined, in order). Tokens that reached the
    gateway together leave it together: one SSE event and one send apiece instead of one per token, which is what a
    gateway that fell behind its engines spends its time on; a token is never held back to wait for another."""
    merged: list[AnswerEvent] = []
    for event in events:
        last = merged[-1] if merged else None
        if isinstance(event, TokenEvent) and isinstance(last, TokenEvent):
            merged[-1] = TokenEvent(last.text + event.text, last.logprobs + event.logprobs)
        else:
            merged.append(event)
    return merged
