"""`extract` in child processes: bounded in time and stoppable at any moment, whatever the file does to a parser.

The readers are C (Lexbor) and pure Python (pypdf) running on bytes a client sent: a hostile file can keep one
busy far out of proportion to its size, and neither can be interrupted from another thread. Here each file is read
in a child process (spawned, never forked: the serving process has CUDA and threads), which is killed when the
file's time is up (`ExtractTimeoutError`) or when the caller gives up (`stop()` turns true, e.g. its client left:
`ExtractCancelledError`). A killed child is simply not reused; a new one is spawned for the next file. At most
`processes` files are read at once; a call waits for a free child.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from service.formats.errors import ExtractError
from service.formats.extract import Extracted, extract

POLL_S = 0.1  # how soon a stop request or a deadline is noticed
START_TIMEOUT_S = 60.0  # a spawned interpreter importing the readers: under a second, more on a busy machine
READY = "ready"


class ExtractTimeoutError(ExtractError):
    """Reading the file took longer than allowed; the child reading it was killed."""


class ExtractCancelledError(Exception):
    """The caller asked to stop (`stop()` turned true); the child reading the file was killed."""


def _never() -> bool:
    return False


class IsolatedExtractor:
    """`extract(name, data)` run in a child process with a time limit per file."""

    def __init__(self, timeout_s: float, processes: int = 2) -> None:
        self.timeout_s = timeout_s
        self._slots = threading.BoundedSemaphore(processes)
        self._lock = threading.Lock()
        self._idle: list[_Child] = []
        self._closed = False

    def extract(self, name: str, data: bytes, stop: Callable[[], bool] = _never) -> Extracted:
        """The file's text as `extract` gives it; `ExtractError` (`ExtractTimeoutError` past the time limit) or
        `ExtractCancelledError` once `stop()` is true."""
        while not self._slots.acquire(timeout=POLL_S):
            if stop():
                raise ExtractCancelledError(name)
        try:
            child = self._take()
            try:
                result = child.run(name, data, self.timeout_s, stop)
            except BaseException:
                child.kill()
                raise
            self._give_back(child)
        finally:
            self._slots.release()
        if isinstance(result, str):
            raise ExtractError(result)
        return result

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for child in idle:
            child.kill()

    def _take(self) -> _Child:
        with self._lock:
            if self._closed:
                raise ExtractError("the file reader is closed (the service is stopping)")
            while self._idle:
                child = self._idle.pop()
                if child.alive():
                    return child
                child.kill()
        return _Child()

    def _give_back(self, child: _Child) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(child)
                return
        child.kill()


class _Child:
    """One spawned reader process and its end of the pipe."""

    def __init__(self) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, child_end = context.Pipe(duplex=True)
        self.process: BaseProcess = context.Process(
            target=serve_extracts, args=(child_end,), name="kvstitch-extract", daemon=True
        )
        self.process.start()
        child_end.close()  # only the child holds its end now: its death reads as EOF here
        # Its imports (the readers) happen before it says ready, so they never count against a file's time.
        try:
            ready = self.conn.poll(START_TIMEOUT_S) and self.conn.recv() == READY
        except EOFError:
            ready = False
        if not ready:
            self.kill()
            raise ExtractError(f"the file reader process did not start within {START_TIMEOUT_S:g} s")

    def run(self, name: str, data: bytes, timeout_s: float, stop: Callable[[], bool]) -> Extracted | str:
        """The child's answer: the extracted file, or the message of its `ExtractError`."""
        deadline = time.monotonic() + timeout_s
        self.conn.send((name, data))
        while not self.conn.poll(POLL_S):
            if stop():
                raise ExtractCancelledError(name)
            if time.monotonic() > deadline:
                raise ExtractTimeoutError(f"{name}: reading it took longer than {timeout_s:g} s")
        try:
            reply: Extracted | str = self.conn.recv()
        except EOFError:
            self.process.join(timeout=5)
            raise ExtractError(f"{name}: the reader stopped (exit code {self.process.exitcode})") from None
        return reply

    def alive(self) -> bool:
        return self.process.is_alive()

    def kill(self) -> None:
        self.conn.close()
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)
        with contextlib.suppress(ValueError):  # still running after SIGKILL: left to multiprocessing's exit handler
            self.process.close()


def serve_extracts(conn: Connection) -> None:
    """The child's main: read files until the parent's end of the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group; the parent ends the child
    conn.send(READY)
    while True:
        try:
            name, data = conn.recv()
        except (EOFError, OSError):
            return
        try:
            reply: Extracted | str = extract(name, data)
        except ExtractError as err:
            reply = str(err)
        except Exception as err:  # a reader's own bug must not end the child silently
            reply = f"{name}: cannot be read ({type(err).__name__}: {err})"
        conn.send(reply)
