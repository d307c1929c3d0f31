"""An engine's API process (`KVSTITCH_ENGINE_API_PROCESS`): the internal HTTP API, in front of the core process.

    python -m service.api.engine_front --fd N --host H --port P   (started by `kvstitch engine`, never by hand)

The core process (`serving/engine_core.py`) holds the model and the engine thread; this process serves the same
routes as the in-process engine (`engine_app.engine_api`) over `CoreLink`. `POST /answer` parses the gateway's body
and checks its chunks' ids against the model's vocabulary here, sends the core the request with its ids as raw
uint32, and writes the core's lines as they come (`FrontAnswerRoute`): the parsing and the HTTP work of every
running answer run here, on another GIL than the engine thread's. When the core process goes away
this process exits at once, so gateways see the engine gone as they would see a one-process engine die.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

from service.api.deps import http_error
from service.api.engine_answer import Message, Receive, Send, answer_request
from service.facade import engine_link as link
from service.facade.engine import (
    EngineAnswerRequest,
    check_vocabulary,
    parse_answer_body,
    with_relays,
)

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 30.0  # readiness, info, load, tiers, metrics: the core answers them off its engine thread
PRECOMPUTE_TIMEOUT_S = 600.0


class FrontAnswer:
    """One forwarded answer: its lines as the core sends them (an empty line is the end), and when it reached
    this process, started on the core and had its first line written from here (perf_counter: one clock for the
    two processes), for its done event's `relay_in` and `relay_out`."""

    def __init__(self, link_: CoreLink, answer_id: int, received_at: float) -> None:
        self.id = answer_id
        self.lines: asyncio.Queue[bytes] = asyncio.Queue()
        self.opened: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.ended = False
        self.received_at = received_at
        self.core_started: float | None = None
        self.first_written_at: float | None = None
        self._link = link_

    def relayed(self, line: bytes) -> bytes:
        """`line`, a done event's with this process's hops as stages (`with_relays`): to the core, from the body's
        arrival here to the answer's start there; back, from its first token there to its first line's write
        here."""
        if self.core_started is None or self.first_written_at is None:
            return line
        relay_in_ms = max(0.0, (self.core_started - self.received_at) * 1e3)
        try:
            return with_relays(line, relay_in_ms, (self.first_written_at - self.core_started) * 1e3)
        except (ValueError, KeyError, TypeError):  # the gateway reports the line as it is: only timings are lost
            log.exception("answer %d: a done line without the expected fields; sent as it came", self.id)
            return line

    def cancel(self) -> None:
        """The gateway went away: the core stops the answer, and the route's loop ends here (the core's last lines
        for it are dropped on arrival)."""
        if not self.ended:
            self.ended = True
            self._link.cancel(self.id)
            self.lines.put_nowait(b"")


class CoreLink:
    """The core process at the other end of `conn`, as the engine's routes use it (`EngineStatus`), and the
    answers forwarded to it. One reader thread takes the core's messages and hands a LINES message's lines to the
    event loop in one call."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self.on_stop: Callable[[], None] = lambda: None  # the server's graceful stop, once there is a server
        self._send_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._answers: dict[int, FrontAnswer] = {}  # streaming, or opening
        self._opening: dict[int, FrontAnswer] = {}  # waiting for OPENED or REFUSED
        self._calls: dict[int, concurrent.futures.Future[Any]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False
        self._vocab_size: int | None = None

    # ---- EngineStatus -------------------------------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        threading.Thread(target=self._read, name="core-link", daemon=True).start()

    def close(self) -> None:
        """Close the link: the core sees its end and stops (a shutdown, not a close alone: this process's reader
        thread sits in a read on the same socket, which a close would neither end nor let the core see)."""
        self._closing = True
        with contextlib.suppress(OSError), socket.socket(fileno=os.dup(self._conn.fileno())) as sock:
            sock.shutdown(socket.SHUT_RDWR)

    def readiness(self) -> dict[str, Any]:
        return self._call("readiness")  # type: ignore[no-any-return]

    def info(self) -> dict[str, Any]:
        return self._call("info")  # type: ignore[no-any-return]

    def load(self) -> dict[str, int]:
        return self._call("load")  # type: ignore[no-any-return]

    def tiers(self, limit: int) -> dict[str, Any]:
        return self._call("tiers", limit)  # type: ignore[no-any-return]

    def metrics_text(self) -> bytes:
        return str(self._call("metrics_text")).encode()

    async def precompute(self, chunks: Sequence[Sequence[int]]) -> dict[str, int]:
        future = self._submit("precompute", [list(ids) for ids in chunks])
        return await asyncio.wait_for(asyncio.wrap_future(future), PRECOMPUTE_TIMEOUT_S)

    # ---- answers ------------------------------------------------------------------------------------------------

    async def vocab_size(self) -> int:
        """The core's model's vocabulary, asked once it is loaded (`NotReadyError` before)."""
        if self._vocab_size is None:
            future = self._submit("vocab_size")
            self._vocab_size = int(await asyncio.wait_for(asyncio.wrap_future(future), CALL_TIMEOUT_S))
        return self._vocab_size

    async def open(self, request: EngineAnswerRequest, received_at: float) -> FrontAnswer:
        """The answer admitted by the core (`received_at`: when its body arrived here); the service error it
        refused with, raised, otherwise."""
        answer = FrontAnswer(self, next(self._ids), received_at)
        # Its lines may cross the OPENED message (the core's writer thread sends them): both places hold it.
        self._answers[answer.id] = self._opening[answer.id] = answer
        try:
            self._send(link.answer_message(answer.id, request))
            await answer.opened
        except BaseException:
            refused = answer.opened.done() and not answer.opened.cancelled() and answer.opened.exception() is not None
            if not refused:  # the gateway left (or the send failed) first: the core may still admit it
                self.cancel(answer.id)
            answer.ended = True
            self._answers.pop(answer.id, None)
            raise
        finally:
            self._opening.pop(answer.id, None)
        return answer

    def cancel(self, answer_id: int) -> None:
        self._answers.pop(answer_id, None)
        with contextlib.suppress(OSError):  # the core is gone: nothing runs there any more
            self._send(link.with_id(link.CANCEL, answer_id))

    # ---- the link -----------------------------------------------------------------------------------------------

    def _call(self, method: str, *args: Any) -> Any:
        return self._submit(method, *args).result(timeout=CALL_TIMEOUT_S)

    def _submit(self, method: str, *args: Any) -> concurrent.futures.Future[Any]:
        number = next(self._ids)
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._calls[number] = future
        try:
            self._send(link.json_message(link.CALL, {"call": number, "method": method, "args": list(args)}))
        except OSError as err:
            self._calls.pop(number, None)
            future.set_exception(link.error_from_json({"type": "NotReadyError", "message": f"engine core: {err}"}))
        return future

    def _send(self, message: bytes) -> None:
        with self._send_lock:
            self._conn.send_bytes(message)

    def _read(self) -> None:
        assert self._loop is not None
        loop = self._loop
        try:
            while True:
                message = self._conn.recv_bytes()
                kind = message[:1]
                if kind == link.LINES:
                    loop.call_soon_threadsafe(self._deliver, list(link.read_lines(message)))
                elif kind == link.OPENED:
                    answer_id, payload = link.split_id(message)
                    loop.call_soon_threadsafe(self._opened, answer_id, None, link.opened_started(payload))
                elif kind == link.REFUSED:
                    answer_id, payload = link.split_id(message)
                    refusal = link.error_from_json(link.json_payload(payload))
                    loop.call_soon_threadsafe(self._opened, answer_id, refusal)
                elif kind == link.RESULT:
                    self._result(link.json_body(message))
                elif kind == link.STOP:
                    loop.call_soon_threadsafe(self.on_stop)
                else:
                    raise link.LinkError(f"unknown message kind {kind!r}")
        except RuntimeError:
            if loop.is_closed():
                return  # this process's server ended first: nobody reads answers any more
            raise
        except (EOFError, OSError):
            if self._closing:
                return
            log.error("the engine core process went away: exiting")
        except link.LinkError:
            log.exception("a malformed message from the engine core: exiting")
        # At once, as the core went: gateways see this engine's connections fail as they would had it been one
        # process, and retry elsewhere each question that had not started streaming.
        os._exit(3)

    def _deliver(self, lines: list[tuple[int, bytes]]) -> None:
        for answer_id, line in lines:
            answer = self._answers.get(answer_id)
            if answer is None:
                continue  # cancelled here: its last lines crossed the cancel
            if not line:
                answer.ended = True
                del self._answers[answer_id]
            answer.lines.put_nowait(line)

    def _opened(self, answer_id: int, refusal: Exception | None, core_started: float | None = None) -> None:
        answer = self._opening.get(answer_id)
        if answer is None or answer.opened.done():
            return
        if refusal is None:
            answer.core_started = core_started
            answer.opened.set_result(None)
        else:
            answer.opened.set_exception(refusal)

    def _result(self, body: Any) -> None:
        number = body.get("call") if isinstance(body, dict) else None
        future = self._calls.pop(number, None) if isinstance(number, int) else None
        if future is None:
            return
        if "error" in body:
            future.set_exception(link.error_from_json(body["error"]))
        else:
            future.set_result(body.get("result"))


class FrontAnswerRoute:
    """`POST /answer` forwarded: the body parsed and checked here, as the in-process route parses and checks it
    (the same 422s), the request to the core, the core's lines to the gateway as they come (every line that arrived
    together in one write)."""

    def __init__(self, core: CoreLink) -> None:
        self._core = core

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        await answer_request(receive, send, self._admit)

    async def _admit(self, body: bytes) -> tuple[FrontAnswer, AsyncIterator[bytes]]:
        received_at = time.perf_counter()
        try:
            request = parse_answer_body(body)
            check_vocabulary([c.token_ids for c in request.chunks], await self._core.vocab_size())
            answer = await self._core.open(request, received_at)
        except Exception as err:
            raise http_error(err) from err
        return answer, _bodies(answer)


async def _bodies(answer: FrontAnswer) -> AsyncIterator[bytes]:
    """The answer's lines up to its end, every line already queued behind the first joined into one body (its
    done event's with the hops through this process, `FrontAnswer.relayed`)."""
    ended = False
    while not ended:
        lines, ended = _gathered(await answer.lines.get(), answer.lines)
        if lines:
            if answer.first_written_at is None:
                answer.first_written_at = time.perf_counter()
            yield b"".join(answer.relayed(line) for line in lines)


def _gathered(first: bytes, lines: asyncio.Queue[bytes]) -> tuple[list[bytes], bool]:
    """`first` and every line already queued behind it; whether the answer's end was among them."""
    if not first:
        return [], True
    parts = [first]
    while not lines.empty():
        line = lines.get_nowait()
        if not line:
            return parts, True
        parts.append(line)
    return parts, False


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from service.api.engine_app import engine_api, engine_server_options
    from service.facade.engine import ENGINE_KEEP_ALIVE_S

    parser = argparse.ArgumentParser(description="an engine's API process (started by `kvstitch engine`)")
    parser.add_argument("--fd", type=int, required=True, help="this end of the link to the core process")
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--graceful-s", type=int, default=30)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s %(message)s")
    core = CoreLink(Connection(args.fd))
    loop, http = engine_server_options()
    server = uvicorn.Server(
        uvicorn.Config(
            engine_api(core, FrontAnswerRoute(core)),
            host=args.host,
            port=args.port,
            log_level="info",
            access_log=False,
            timeout_keep_alive=ENGINE_KEEP_ALIVE_S,
            timeout_graceful_shutdown=args.graceful_s,
            loop=loop,
            http=http,
        )
    )
    core.on_stop = lambda: setattr(server, "should_exit", True)
    server.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
