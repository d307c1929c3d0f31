"""An engine's API in a second process (`KVSTITCH_ENGINE_API_PROCESS`): the core's `CoreHost` and the API process's
`CoreLink` and `FrontAnswerRoute` over a real socket pair, against a core that answers as told. The route must give
what the in-process route gives (`test_fleet_answer_route.py`): the same lines, statuses and bodies, cancellation
when the gateway leaves. The processes themselves run in `test_fleet_engines.py` (its e2) and at the end here."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import httpx
import pytest
from engine_processes import ENGINE_ENV, ROOT
from test_fleet_answer_route import DONE, REQUEST, drive, status_and_body

from service.api import engine_answer
from service.api.engine_front import CoreLink, FrontAnswer, FrontAnswerRoute, _gathered
from service.devtools.ports import free_port
from service.errors import BusyError, InvalidRequestError, NotReadyError, UnavailableError
from service.facade import engine_link as link
from service.facade.engine import EngineAnswerRequest, WireChunk, event_line, parse_event, with_relays
from service.facade.types import ChatMessage, DoneEvent, TokenEvent
from service.serving.engine_core import CoreHost

Item = TokenEvent | Exception | None


class Session:
    """Emits its items from a thread of its own (as the engine thread does), `delay_s` after its start, then hangs
    until cancelled if told."""

    def __init__(self, items: list[Any], hang: bool, delay_s: float = 0.0) -> None:
        self.items, self.hang, self.delay_s = items, hang, delay_s
        self.started = time.perf_counter()
        self.cancelled = threading.Event()

    def start(self, listener: Callable[[Any], None]) -> None:
        def emit() -> None:
            time.sleep(self.delay_s)
            for item in self.items:
                listener(item)
            if self.hang:
                self.cancelled.wait(10)
                listener(None)

        threading.Thread(target=emit, daemon=True).start()

    def cancel(self) -> None:
        self.cancelled.set()


class Core:
    """`EngineServer`'s part that `CoreHost` serves: answers as told, a refusal, and the calls."""

    def __init__(
        self,
        items: list[Any] | None = None,
        hang: bool = False,
        refusal: Exception | None = None,
        vocab: int | Exception = 50,
        delay_s: float = 0.0,
    ) -> None:
        self.items, self.hang, self.refusal, self.vocab = items or [], hang, refusal, vocab
        self.delay_s = delay_s
        self.requests: list[EngineAnswerRequest] = []
        self.sessions: list[Session] = []

    def open_answer(self, request: EngineAnswerRequest, vocabulary_checked: bool = False) -> Session:
        assert vocabulary_checked, "the API process checks the vocabulary: the core must not check it again"
        self.requests.append(request)
        if self.refusal is not None:
            raise self.refusal
        self.sessions.append(Session(self.items, self.hang, self.delay_s))
        return self.sessions[-1]

    def readiness(self) -> dict[str, Any]:
        return {"ready": True, "checks": {"startup": "ok"}}

    def info(self) -> dict[str, Any]:
        return {"engine_id": "e9"}

    def load(self) -> dict[str, int]:
        return {"running": len(self.sessions), "waiting": 0}

    def tiers(self, limit: int) -> dict[str, Any]:
        raise NotReadyError(f"still loading (limit {limit})")

    def metrics_text(self) -> bytes:
        return b"kvstitch_up 1\n"

    def precompute_now(self, chunks: list[list[int]]) -> dict[str, int]:
        return {"gpu": len(chunks), "host": 0, "disk": 0, "miss": 0}

    def vocab_size(self) -> int:
        if isinstance(self.vocab, Exception):
            raise self.vocab
        return self.vocab


@pytest.fixture
def linked() -> Iterator[Callable[[Core], CoreLink]]:
    """A `CoreHost` serving the given core on one end of a socket pair (its reader on a thread), the `CoreLink` on
    the other; the link's own reader starts with `start()` inside the test's event loop."""
    hosts: list[tuple[CoreLink, threading.Thread]] = []

    def make(core: Core) -> CoreLink:
        core_end, front_end = socket.socketpair()
        host = CoreHost(core, Connection(core_end.detach()))  # type: ignore[arg-type]
        thread = threading.Thread(target=host.serve, daemon=True)
        thread.start()
        front = CoreLink(Connection(front_end.detach()))
        hosts.append((front, thread))
        return front

    yield make
    for front, thread in hosts:
        front.close()
        thread.join(5)
        assert not thread.is_alive(), "the core host did not stop when the API process closed its end"


async def post(front: CoreLink, body: bytes, disconnect_after_s: float | None = None) -> list[dict[str, Any]]:
    """The messages `FrontAnswerRoute` sends for `body`, the link's reader started in this event loop."""
    front.start()
    return await drive(FrontAnswerRoute(front), body, disconnect_after_s)


def test_an_answer_streams_the_cores_lines(linked: Callable[[Core], CoreLink]) -> None:
    """The core's lines as they were, but the done event's: the hops through the API process added as stages and
    to its TTFT (the core's answer starts its first token 20 ms after its start, and says its TTFT was 1 ms: the
    19 ms in between are the way out)."""
    core = Core([TokenEvent("a"), TokenEvent("b"), DONE, None], delay_s=0.02)
    status, headers, body = status_and_body(asyncio.run(post(linked(core), REQUEST.body())))

    assert status == 200 and headers[b"content-type"] == b"application/x-ndjson"
    *tokens, done = [parse_event(line) for line in body.splitlines()]
    assert tokens == [TokenEvent("a"), TokenEvent("b")] and isinstance(done, DoneEvent)
    relay_in, relay_out = done.timings_ms["relay_in"], done.timings_ms["relay_out"]
    assert 0.0 < relay_in < 1000.0 and 19.0 <= relay_out < 1000.0
    assert done.ttft_ms == pytest.approx(relay_in + DONE.ttft_ms + relay_out)
    assert dataclasses.replace(done, ttft_ms=DONE.ttft_ms, timings_ms=DONE.timings_ms) == DONE
    assert core.requests == [REQUEST]  # parsed in the API process as the in-process route parses it


def test_an_error_after_the_start_is_the_same_error_line(linked: Callable[[Core], CoreLink]) -> None:
    core = Core([TokenEvent("a"), RuntimeError("device lost"), None])
    status, _, body = status_and_body(asyncio.run(post(linked(core), REQUEST.body())))

    lines = body.splitlines()
    assert status == 200 and parse_event(lines[0]) == TokenEvent("a")
    assert json.loads(lines[1]) == {"event": "error", "message": "generation failed: RuntimeError: device lost"}


@pytest.mark.parametrize(
    ("body", "message"),
    [(b"not json", "not JSON"), (json.dumps({"question": "  "}).encode(), "question: blank")],
)
def test_a_bad_body_is_the_same_422(linked: Callable[[Core], CoreLink], body: bytes, message: str) -> None:
    core = Core([DONE, None])
    status, headers, sent = status_and_body(asyncio.run(post(linked(core), body)))

    assert status == 422 and headers[b"content-type"] == b"application/json"
    (detail,) = json.loads(sent)["detail"]
    assert detail["loc"] == ["body", "body"] and message in detail["msg"] and detail["type"] == "value_error"
    assert core.requests == []


def test_a_body_past_the_bound_is_a_413_and_never_reaches_the_core(
    linked: Callable[[Core], CoreLink], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine_answer, "MAX_BODY_BYTES", 64)
    core = Core([DONE, None])
    status, _, sent = status_and_body(asyncio.run(post(linked(core), b"x" * 65)))

    assert status == 413 and "larger than" in json.loads(sent)["detail"]
    assert core.requests == []


@pytest.mark.parametrize(
    ("refusal", "status", "detail"),
    [
        (BusyError("line full"), 503, "line full"),
        (NotReadyError("loading"), 503, "not ready: loading"),
        (UnavailableError("the KV index", "timed out"), 503, "the KV index is unreachable: timed out"),
    ],
)
def test_a_refusal_has_the_in_process_status(
    linked: Callable[[Core], CoreLink], refusal: Exception, status: int, detail: str
) -> None:
    got, headers, sent = status_and_body(asyncio.run(post(linked(Core(refusal=refusal)), REQUEST.body())))

    assert got == status and json.loads(sent) == {"detail": detail}
    assert (headers.get(b"retry-after") == b"2") == isinstance(refusal, BusyError)


def test_a_refused_field_names_itself(linked: Callable[[Core], CoreLink]) -> None:
    refusal = InvalidRequestError("chunks[0].token_ids", "ids of this model's vocabulary (below 8); got 9")
    status, _, sent = status_and_body(asyncio.run(post(linked(Core(refusal=refusal)), REQUEST.body())))

    (detail,) = json.loads(sent)["detail"]
    assert status == 422 and detail["loc"] == ["body", "chunks[0].token_ids"] and "below 8" in detail["msg"]


def test_ids_past_the_vocabulary_are_a_422_in_the_api_process(linked: Callable[[Core], CoreLink]) -> None:
    """The API process checks the ids against the vocabulary the core reports (the in-process route's 422), and
    the request never reaches the core; while the core loads, the question is refused as the core would."""
    core = Core([DONE, None], vocab=3)
    status, _, sent = status_and_body(asyncio.run(post(linked(core), REQUEST.body())))

    (detail,) = json.loads(sent)["detail"]
    assert status == 422 and detail["loc"] == ["body", "chunks[0].token_ids"]
    assert "below 3); got 3" in detail["msg"] and core.requests == []

    loading = Core([DONE, None], vocab=NotReadyError("loading"))
    status, _, sent = status_and_body(asyncio.run(post(linked(loading), REQUEST.body())))
    assert status == 503 and json.loads(sent) == {"detail": "not ready: loading"} and loading.requests == []


def test_a_request_crosses_the_link_whole_and_a_cut_one_is_refused() -> None:
    request = EngineAnswerRequest(
        "why é?",
        (
            WireChunk("c1", "d1", 0.5, "text", (1, 2, 3), {"title": "t"}, {"before": "b"}),
            WireChunk("c2", "d2", -1.0, "", (2**32 - 1,)),
            WireChunk("c3", "d1", 0.0, "x", tuple(range(700))),
        ),
        mode="naive",
        positions="composite",
        max_new_tokens=7,
        temperature=0.5,
        top_p=0.9,
        seed=11,
        stop=("\n", "END"),
        logprobs=2,
        recompute="top:0.1",
        history=(ChatMessage("user", "hi"), ChatMessage("assistant", "hello")),
        dropped=2,
    )
    message = link.answer_message(2**63, request)

    assert link.read_answer(message) == (2**63, request)
    with pytest.raises(link.LinkError, match="whole uint32"):
        link.read_answer(message[:-1])
    with pytest.raises(link.LinkError, match="does not match"):
        link.read_answer(message[:-4])
    with pytest.raises(link.LinkError):
        link.read_answer(message[:20])


def test_an_answer_message_the_core_cannot_read_is_refused_not_left_waiting() -> None:
    core_end, front_end = socket.socketpair()
    core = Core([DONE, None])
    host = CoreHost(core, Connection(core_end.detach()))  # type: ignore[arg-type]
    thread = threading.Thread(target=host.serve, daemon=True)
    thread.start()
    front = Connection(front_end.detach())
    try:
        front.send_bytes(link.answer_message(7, REQUEST)[:-1])  # the ids cut short

        reply = front.recv_bytes()
        answer_id, payload = link.split_id(reply)
        refusal = link.error_from_json(link.json_payload(payload))
        assert reply[:1] == link.REFUSED and answer_id == 7
        assert "whole uint32" in str(refusal) and core.requests == []
    finally:
        front.close()
        thread.join(5)


def test_a_gateway_that_goes_away_cancels_the_answer_in_the_core(linked: Callable[[Core], CoreLink]) -> None:
    core = Core([TokenEvent("a")], hang=True)
    sent = asyncio.run(post(linked(core), REQUEST.body(), disconnect_after_s=0.1))

    assert sent[0]["status"] == 200 and parse_event(sent[1]["body"]) == TokenEvent("a")
    assert core.sessions[0].cancelled.wait(5), "the core's session was never cancelled"


def test_calls_return_the_cores_values_and_errors(linked: Callable[[Core], CoreLink]) -> None:
    core = Core()
    front = linked(core)

    async def calls() -> tuple[Any, ...]:
        front.start()
        readiness = await asyncio.to_thread(front.readiness)
        metrics = await asyncio.to_thread(front.metrics_text)
        blocks = await front.precompute([[1, 2], [3]])
        try:
            await asyncio.to_thread(front.tiers, 7)
        except NotReadyError as err:
            return readiness, metrics, blocks, str(err)
        raise AssertionError("the core's NotReadyError did not cross the link")

    readiness, metrics, blocks, error = asyncio.run(calls())
    assert readiness == {"ready": True, "checks": {"startup": "ok"}}
    assert metrics == b"kvstitch_up 1\n" and blocks == {"gpu": 2, "host": 0, "disk": 0, "miss": 0}
    assert error == "still loading (limit 7)"


def test_lines_cross_in_one_message_and_a_cut_message_is_refused() -> None:
    lines = [(1, b'{"event":"token"}\n'), (2**63, b""), (3, b"x" * 70_000)]
    message = link.lines_message(lines)

    assert list(link.read_lines(message)) == lines
    with pytest.raises(link.LinkError):
        list(link.read_lines(message[:-1]))
    with pytest.raises(link.LinkError):
        list(link.read_lines(message[:5]))


def test_queued_lines_go_out_in_one_write_up_to_the_end() -> None:
    async def gathered() -> list[tuple[list[bytes], bool]]:
        queue: asyncio.Queue[bytes] = asyncio.Queue()
        for line in (b"b\n", b"c\n", b"", b"late\n"):
            queue.put_nowait(line)
        return [_gathered(b"a\n", queue), _gathered(b"", queue)]

    assert asyncio.run(gathered()) == [([b"a\n", b"b\n", b"c\n"], True), ([], True)]


def test_the_core_names_an_answers_start_in_its_opened_message() -> None:
    message = link.opened_message(7, 1234.5678)
    answer_id, payload = link.split_id(message)
    assert message[:1] == link.OPENED and answer_id == 7 and link.opened_started(payload) == 1234.5678
    assert link.opened_started(b"") is None  # a core that names none: no relay stages


def test_relays_go_into_a_done_line_only() -> None:
    done_line = event_line(DONE)
    relayed = parse_event(with_relays(done_line, 2.0, 10.0))
    assert isinstance(relayed, DoneEvent)
    assert relayed.timings_ms == {"relay_in": 2.0, "relay_out": 10.0 - DONE.ttft_ms}
    assert relayed.ttft_ms == 2.0 + 10.0  # from the arrival to the write
    early = parse_event(with_relays(done_line, 2.0, 0.5))  # written before the core's TTFT: clock noise, no hop
    assert isinstance(early, DoneEvent) and early.timings_ms["relay_out"] == 0.0 and early.ttft_ms == 2.0 + DONE.ttft_ms
    token_line = event_line(TokenEvent("a"))
    assert with_relays(token_line, 2.0, 10.0) == token_line


def test_errors_cross_as_their_own_class() -> None:
    for err in (BusyError("full"), NotReadyError("loading"), InvalidRequestError("top_p", "from 0 to 1")):
        back = link.error_from_json(link.error_json(err))
        assert type(back) is type(err) and str(back) == str(err)
    unavailable = link.error_from_json(link.error_json(UnavailableError("Qdrant", "refused")))
    assert isinstance(unavailable, UnavailableError) and str(unavailable) == "Qdrant is unreachable: refused"
    assert str(link.error_from_json(link.error_json(KeyError("x")))) == "KeyError: 'x'"


# ---- the two processes --------------------------------------------------------------------------------------


def test_sigterm_stops_both_processes_and_a_killed_core_takes_its_api_with_it(
    tiny_model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    def start(port: int, data: Path) -> subprocess.Popen[bytes]:
        env = {**os.environ, **ENGINE_ENV, "PYTHONPATH": str(ROOT), "KVSTITCH_ENGINE_API_PROCESS": "true"}
        env |= {"KVSTITCH_MODEL": str(tiny_model_dirs["llama"]), "KVSTITCH_DATA_DIR": str(data)}
        command = [sys.executable, "-m", "service", "engine", "--host", "127.0.0.1", "--port", str(port)]
        return subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def ready(port: int, core: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and core.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise AssertionError(f"the split engine never got ready (exit {core.poll()})")

    def refused(port: int, within_s: float) -> bool:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            try:
                httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1)
            except httpx.ConnectError:
                return True
            time.sleep(0.1)
        return False

    port = free_port()
    core = start(port, tmp_path / "a")
    try:
        ready(port, core)
        assert httpx.get(f"http://127.0.0.1:{port}/load", timeout=5).json() == {"running": 0, "waiting": 0}
        core.send_signal(signal.SIGTERM)
        assert core.wait(30) == 0
        assert refused(port, 5), "the API process outlived its core's clean stop"
    finally:
        core.kill()

    port = free_port()
    core = start(port, tmp_path / "b")
    try:
        ready(port, core)
        core.kill()
        core.wait(10)
        assert refused(port, 5), "the API process outlived its killed core"
    finally:
        core.kill()


def test_a_done_line_the_relays_cannot_read_goes_out_as_it_came(caplog: pytest.LogCaptureFixture) -> None:
    async def relayed() -> bytes:
        answer = FrontAnswer(CoreLink.__new__(CoreLink), 3, received_at=1.0)
        answer.core_started, answer.first_written_at = 1.5, 2.0
        return answer.relayed(b'{"event":"done","done":{"mode":"turbo"}}\n')

    assert asyncio.run(relayed()) == b'{"event":"done","done":{"mode":"turbo"}}\n'
    assert "without the expected fields" in caplog.text
