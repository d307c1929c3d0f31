"""An engine's core process serving its API process (`KVSTITCH_ENGINE_API_PROCESS`): `CoreHost` over one link.

The core process holds the model and the engine thread; the API process (`api/engine_front.py`) holds the HTTP
server. Questions arrive parsed and checked by the API process (`engine_link.answer_message`) and are admitted
here as the in-process route admits them (`EngineServer.open_answer`). The engine thread hands each event to
`CoreHost`'s outbox, and one writer thread sends everything that gathered while it was away in one LINES message: a
decode step of a hundred answers costs this process one socket write, not a hundred HTTP writes and coroutine
wake-ups on an event loop that holds the GIL the engine thread launches with.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

from service.facade import engine_link as link
from service.facade.engine import EngineAnswerRequest, event_line, failure_line
from service.serving.answer_session import AnswerItem, AnswerSession
from service.serving.engine_server import EngineServer

log = logging.getLogger(__name__)

CALL_THREADS = 4  # a precompute waits for the engine loop: calls never wait behind each other or behind answers


class CoreHost:
    """Serves `server` to the API process at the other end of `conn` until that end closes."""

    def __init__(self, server: EngineServer, conn: Connection) -> None:
        self._server = server
        self._conn = conn
        self._send_lock = threading.Lock()
        self._outbox: list[tuple[int, AnswerItem]] = []
        self._outbox_ready = threading.Condition()
        self._sessions: dict[int, AnswerSession] = {}
        self._calls = ThreadPoolExecutor(CALL_THREADS, thread_name_prefix="engine-call")
        self._closed = False
        self._methods: dict[str, Callable[..., Any]] = {
            "readiness": server.readiness,
            "info": server.info,
            "load": server.load,
            "tiers": server.tiers,
            "metrics_text": lambda: server.metrics_text().decode(),
            "precompute": server.precompute_now,
            "vocab_size": server.vocab_size,
        }

    def serve(self) -> None:
        """Read the API process's messages until it closes its end (it exited or stopped)."""
        writer = threading.Thread(target=self._write_lines, name="engine-lines", daemon=True)
        writer.start()
        try:
            while True:
                try:
                    message = self._conn.recv_bytes()
                except (EOFError, OSError):
                    return
                try:
                    self._dispatch(message)
                except link.LinkError:
                    log.exception("a malformed message from the API process")
        finally:
            self._close()
            writer.join(timeout=5)

    def stop(self) -> None:
        """Ask the API process to stop (from a signal handler: the send waits for no lock of this thread)."""
        threading.Thread(target=self._send, args=(link.STOP,), name="engine-stop", daemon=True).start()

    # ---- from the API process ---------------------------------------------------------------------------------

    def _dispatch(self, message: bytes) -> None:
        kind = message[:1]
        if kind == link.ANSWER:
            self._open_message(message)
        elif kind == link.CANCEL:
            session = self._sessions.get(link.split_id(message)[0])
            if session is not None:
                session.cancel()
        elif kind == link.CALL:
            self._calls.submit(self._call, link.json_body(message))
        else:
            raise link.LinkError(f"unknown message kind {kind!r}")

    def _open_message(self, message: bytes) -> None:
        """An ANSWER message; one whose request cannot be read is refused (so the API process answers its gateway
        with an error rather than waiting for it), then raised to be logged."""
        answer_id = link.split_id(message)[0]
        try:
            request = link.read_answer(message)[1]
        except link.LinkError as err:
            self._refuse(answer_id, err)
            raise
        self._open(answer_id, request)

    def _open(self, answer_id: int, request: EngineAnswerRequest) -> None:
        """Admit a question as the in-process route does; OPENED, or REFUSED with the error."""
        try:
            session = self._server.open_answer(request, vocabulary_checked=True)
            self._sessions[answer_id] = session
            session.start(lambda item: self._post(answer_id, item))
        except Exception as err:
            self._sessions.pop(answer_id, None)
            self._refuse(answer_id, err)
            return
        self._send(link.opened_message(answer_id, session.started))

    def _refuse(self, answer_id: int, err: BaseException) -> None:
        self._send(link.with_id(link.REFUSED, answer_id, json.dumps(link.error_json(err)).encode()))

    def _call(self, body: Any) -> None:
        number = body.get("call") if isinstance(body, dict) else None
        try:
            method = self._methods[str(body["method"])]
            reply: dict[str, Any] = {"call": number, "result": method(*body.get("args", []))}
        except Exception as err:
            reply = {"call": number, "error": link.error_json(err)}
        self._send(link.json_message(link.RESULT, reply))

    # ---- to the API process -----------------------------------------------------------------------------------

    def _post(self, answer_id: int, item: AnswerItem) -> None:
        """An answer's event, error or end, from the engine thread: the writer sends it with whatever joins it."""
        with self._outbox_ready:
            self._outbox.append((answer_id, item))
            if len(self._outbox) == 1:
                self._outbox_ready.notify()

    def _write_lines(self) -> None:
        while True:
            with self._outbox_ready:
                while not self._outbox and not self._closed:
                    self._outbox_ready.wait()
                if not self._outbox:
                    return
                items, self._outbox = self._outbox, []
            if not self._send(link.lines_message([self._line(answer_id, item) for answer_id, item in items])):
                return

    def _line(self, answer_id: int, item: AnswerItem) -> tuple[int, bytes]:
        if item is None:
            self._sessions.pop(answer_id, None)
            return answer_id, b""
        if isinstance(item, BaseException):
            return answer_id, failure_line(item)
        return answer_id, event_line(item)

    def _send(self, message: bytes) -> bool:
        """False once the API process is gone."""
        try:
            with self._send_lock:
                self._conn.send_bytes(message)
            return True
        except OSError:
            return False

    def _close(self) -> None:
        with self._outbox_ready:
            self._closed = True
            self._outbox_ready.notify()
        for session in list(self._sessions.values()):
            session.cancel()  # nobody reads them any more
        self._calls.shutdown(wait=False, cancel_futures=True)
