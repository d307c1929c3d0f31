"""Question embeddings in a child process, so the BERT forward never waits for the serving process's GIL.

On CPU a sentence-transformers forward is hundreds of small torch ops, each releasing and re-taking the GIL; in
the gateway the engine thread and the event loop hold it most of the time, so under load every op waits to take
it back and an embedding takes several times its own work (a GIL convoy). In a process of its own the forward has
a GIL to itself; the retrieval thread only blocks on a pipe (GIL released) and then runs the Qdrant search.

The child is started with the *spawn* context: the parent has CUDA and threads, which a fork would copy
half-initialized. Vectors come back as float32 bytes plus their shape, not as pickled lists of Python floats.
A child found dead before a call is replaced at once (that call pays the start-up); a child that dies during a
call fails that call with `UnavailableError` (a 503) and is replaced at the next call.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import threading
from collections.abc import Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import numpy as np
import torch

from service.errors import UnavailableError
from service.retrieval.embedder import Embedder

log = logging.getLogger(__name__)

COMPONENT = "the question embedder process"
DEFAULT_START_TIMEOUT_S = 180.0  # importing torch and sentence-transformers takes 8-15 s on 2 busy CPU cores
DEFAULT_REQUEST_TIMEOUT_S = 60.0  # a round of 64 questions takes well under a second; more means a hung child
DEFAULT_CLOSE_TIMEOUT_S = 10.0

# Messages. Parent → child: ("embed", [texts]) or ("exit",). Child → parent: ("ready", dimension) or
# ("failed", reason) once at start, then per request ("vectors", rows, dimension, float32 bytes) or ("error", why).
EMBED, EXIT = "embed", "exit"
READY, FAILED, VECTORS, ERROR = "ready", "failed", "vectors", "error"


class EmbedProcessError(RuntimeError):
    """The child could not start, or answered a request with an error (its own exception, or a bad message)."""


def child_threads(children: int = 1) -> int:
    """Torch threads of each of `children` children: a few cores each, never more than the machine has between
    them (one at least). An idle torch thread spins between the forward's hundreds of small ops, so threads beyond
    the free cores burn a core's time waiting for one that was descheduled."""
    return max(1, min(4, (os.cpu_count() or 1) // max(1, children)))


class QueryEmbedProcess:
    """`embed_queries` and `dimension` of an `Embedder` that runs in a child process; one request at a time."""

    def __init__(
        self,
        model: str | None = None,
        device: str = "cpu",
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
        threads: int | None = None,
    ) -> None:
        self.model = model
        self.device = device
        self.threads = threads if threads is not None else child_threads()
        if self.threads < 1:
            raise ValueError(f"threads must be positive, got {self.threads}")
        self.start_timeout_s = start_timeout_s
        self.request_timeout_s = request_timeout_s
        self._lock = threading.Lock()  # one request in flight: the pipe carries one exchange at a time
        self._closed = False
        self._process: BaseProcess | None = None
        self._conn: Connection | None = None
        self._dimension = self._start()

    @property
    def dimension(self) -> int:
        """Length of every vector the child returns (read from its model at start)."""
        return self._dimension

    @property
    def pid(self) -> int | None:
        """The current child's process id (None while none runs)."""
        return self._process.pid if self._process is not None else None

    def embed_queries(self, texts: Sequence[str]) -> list[list[float]]:
        """The unit vectors of several questions, computed in the child (`UnavailableError` if it dies)."""
        if not texts:
            return []
        with self._lock:
            if self._closed:
                raise UnavailableError(COMPONENT, "closed")
            if self._process is None or not self._process.is_alive():
                self._replace_dead_child()
            return self._exchange(list(texts))

    def close(self) -> None:
        """Ask the child to exit, wait for it, terminate it if it does not go; a second call does nothing."""
        self._closed = True
        # Waits for a request in flight (bounded); past that the child is stopped anyway and that call fails.
        locked = self._lock.acquire(timeout=self.request_timeout_s)
        try:
            self._stop_child()
        finally:
            if locked:
                self._lock.release()

    # ---- one exchange ---------------------------------------------------------------------------------------

    def _exchange(self, texts: list[str]) -> list[list[float]]:
        conn = self._conn
        assert conn is not None
        try:
            conn.send((EMBED, texts))
            if not conn.poll(self.request_timeout_s):  # blocks with the GIL released
                raise TimeoutError(f"no answer within {self.request_timeout_s:.0f} s")
            reply = conn.recv()
        except (OSError, EOFError, TimeoutError) as err:  # broken pipe, closed pipe, hung child
            reason = self._death_reason(err)
            self._stop_child(graceful=False)  # dead or hung: no goodbye; the next call starts a fresh child
            raise UnavailableError(COMPONENT, reason) from err
        return self._vectors_from(reply, len(texts))

    def _vectors_from(self, reply: Any, count: int) -> list[list[float]]:
        """The reply as rows of floats, checked against the request: one row of `dimension` per text."""
        if isinstance(reply, tuple) and len(reply) == 2 and reply[0] == ERROR:
            raise EmbedProcessError(f"{COMPONENT} failed: {reply[1]}")
        if not (isinstance(reply, tuple) and len(reply) == 4 and reply[0] == VECTORS):
            raise EmbedProcessError(f"{COMPONENT} sent an unexpected reply: {_short(reply)}")
        _, rows, dimension, payload = reply
        if (rows, dimension) != (count, self._dimension) or not isinstance(payload, bytes):
            raise EmbedProcessError(
                f"{COMPONENT} sent vectors of shape ({rows}, {dimension}) for {count} texts of dimension "
                f"{self._dimension}"
            )
        if len(payload) != count * self._dimension * 4:
            raise EmbedProcessError(f"{COMPONENT} sent {len(payload)} bytes for {count}x{self._dimension} floats")
        vectors: list[list[float]] = np.frombuffer(payload, dtype=np.float32).reshape(count, dimension).tolist()
        return vectors

    def _death_reason(self, err: BaseException) -> str:
        process = self._process
        if process is not None:
            # A child that just died: its exit code tells how (-9 = killed). Its threads may still be tearing down
            # (the exit code waits for the last one); a hung child has already had its request timeout.
            process.join(timeout=5)
            if process.exitcode is not None:
                return f"the child (pid {process.pid}) exited with code {process.exitcode} during a request"
        return f"{type(err).__name__}: {err}"

    # ---- the child's lifecycle ------------------------------------------------------------------------------

    def _start(self) -> int:
        """Spawn a child and wait for its ready message; its dimension, or `EmbedProcessError` with its reason."""
        context = multiprocessing.get_context("spawn")  # never fork: the parent has CUDA and threads
        parent_end, child_end = context.Pipe(duplex=True)
        process = context.Process(
            target=serve_embeddings,
            args=(child_end, self.model, self.device, self.threads),
            name="kvstitch-embed",
            daemon=True,  # ended by multiprocessing's exit handler if the parent exits without close()
        )
        process.start()
        child_end.close()  # only the child holds its end now: its death reads as EOF here
        self._process, self._conn = process, parent_end
        try:
            dimension = self._await_ready(parent_end, process)
        except BaseException:
            self._stop_child()
            raise
        log.info("question embedder running in child process %d (dimension %d)", process.pid, dimension)
        return dimension

    def _await_ready(self, conn: Connection, process: BaseProcess) -> int:
        try:
            if not conn.poll(self.start_timeout_s):
                raise EmbedProcessError(f"{COMPONENT} did not start within {self.start_timeout_s:.0f} s")
            message = conn.recv()
        except EOFError:
            process.join(timeout=5)
            raise EmbedProcessError(
                f"{COMPONENT} exited with code {process.exitcode} before it was ready (see its output above)"
            ) from None
        if isinstance(message, tuple) and len(message) == 2 and message[0] == READY and isinstance(message[1], int):
            return message[1]
        if isinstance(message, tuple) and len(message) == 2 and message[0] == FAILED:
            raise EmbedProcessError(f"{COMPONENT} failed to start: {message[1]}")
        raise EmbedProcessError(f"{COMPONENT} sent an unexpected first message: {_short(message)}")

    def _replace_dead_child(self) -> None:
        if self._process is not None:
            log.warning(
                "%s (pid %s) is gone (exit code %s); starting a new one", COMPONENT, self.pid, self._exit_code()
            )
        self._stop_child()
        try:
            dimension = self._start()
        except EmbedProcessError as err:  # an outage for this call (a 503); the next call tries again
            raise UnavailableError(COMPONENT, f"restart failed: {err}") from err
        if dimension != self._dimension:  # cannot happen with the same model folder; vectors would not fit Qdrant
            raise EmbedProcessError(f"{COMPONENT} restarted with dimension {dimension}, was {self._dimension}")

    def _exit_code(self) -> int | None:
        return self._process.exitcode if self._process is not None else None

    def _stop_child(self, graceful: bool = True) -> None:
        """Ask the child to exit (`graceful`), then terminate and kill it if it lingers; forget it either way."""
        process, conn = self._process, self._conn
        self._process, self._conn = None, None
        if conn is not None:
            if graceful:
                with contextlib.suppress(OSError):  # a dead child's pipe is broken: nothing to ask
                    conn.send((EXIT,))
            conn.close()
        if process is None:
            return
        if graceful:
            process.join(timeout=DEFAULT_CLOSE_TIMEOUT_S)
        for stop in (process.terminate, process.kill):
            if not process.is_alive():
                break
            log.warning("%s (pid %d) did not exit; stopping it with %s", COMPONENT, process.pid, stop.__name__)
            stop()
            process.join(timeout=DEFAULT_CLOSE_TIMEOUT_S)
        if not process.is_alive():
            process.close()  # frees its sentinel; a process that survived SIGKILL is left to the exit handler


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


# ---- the child ----------------------------------------------------------------------------------------------


def serve_embeddings(conn: Connection, model: str | None, device: str, threads: int) -> None:
    """The child's main: load the embedder, say ready with its dimension, then answer requests until told to
    exit or the parent goes away (its end of the pipe closes)."""
    # Ctrl-C reaches the whole process group; the parent's shutdown ends the child, a traceback here would not.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        embedder = _load_embedder(model, device, threads)
    except Exception as err:  # the parent raises it, with this reason, at start-up
        conn.send((FAILED, f"{type(err).__name__}: {err}"))
        return
    conn.send((READY, embedder.dimension))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return  # the parent is gone
        if isinstance(message, tuple) and message == (EXIT,):
            return
        conn.send(_answer(embedder, message))


def _load_embedder(model: str | None, device: str, threads: int) -> Embedder:
    torch.set_num_threads(threads)  # its own cores: the parent's threads are not competing for them here
    embedder = Embedder(model, device=device)
    embedder.warm_queries()  # CUDA graphs, or the first forward's lazy set-up (~200 ms): at start, not a user's
    embedder.embed_queries(["warm-up"])
    return embedder


def _answer(embedder: Embedder, message: Any) -> tuple[Any, ...]:
    """The reply to one request: its vectors as float32 bytes, or an error for a bad message or a failed forward."""
    texts = _texts_of(message)
    if texts is None:
        return (ERROR, f"bad request: expected ({EMBED!r}, [str, ...]), got {_short(message)}")
    try:
        vectors = np.asarray(embedder.embed_queries(texts), dtype=np.float32).reshape(len(texts), embedder.dimension)
    except Exception as err:  # reported to the caller; the child keeps serving
        return (ERROR, f"{type(err).__name__}: {err}")
    return (VECTORS, len(texts), embedder.dimension, vectors.tobytes())


def _texts_of(message: Any) -> list[str] | None:
    if not (isinstance(message, tuple) and len(message) == 2 and message[0] == EMBED):
        return None
    texts = message[1]
    if not (isinstance(texts, list) and texts and all(isinstance(text, str) for text in texts)):
        return None
    return texts
