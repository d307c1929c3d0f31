"""Question embeddings in several child processes at once: a pool of `QueryEmbedProcess` children.

One child serves one batch at a time, so while it embeds a round of questions the next round waits for it, and the
retrieval thread's Qdrant search after each embedding leaves it idle. With N children the retrieval batcher runs up to
N rounds at once (`RetrievalBatcher(rounds=N)`): each call here takes an idle child, or waits for one, and a round's
search overlaps the next round's embedding. Each child runs its forward on `child_threads(N)` torch threads, the
machine's cores shared out between them, rather than N children each spinning threads over the same cores.

A child that dies fails only the call it was serving (`UnavailableError`, a 503) and is replaced at its next call,
as a lone child is; the others keep serving.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from service.errors import UnavailableError
from service.retrieval.embed_process import (
    COMPONENT,
    DEFAULT_REQUEST_TIMEOUT_S,
    DEFAULT_START_TIMEOUT_S,
    QueryEmbedProcess,
    child_threads,
)

MAX_PROCESSES = 8  # each child holds its own copy of the model (~100 MB for MiniLM) and its torch threads


class QueryEmbedPool:
    """`embed_queries` and `dimension` of an `Embedder`, served by `processes` children; `processes` calls at once."""

    def __init__(
        self,
        processes: int,
        model: str | None = None,
        device: str = "cpu",
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
    ) -> None:
        if not 1 <= processes <= MAX_PROCESSES:
            raise ValueError(f"processes must be 1 to {MAX_PROCESSES}, got {processes}")
        self.request_timeout_s = request_timeout_s
        self.children = _start_children(processes, model, device, start_timeout_s, request_timeout_s)
        dimensions = {child.dimension for child in self.children}
        if len(dimensions) != 1:  # one model folder: cannot happen unless it changed while they started
            self.close()
            raise RuntimeError(f"the question embedder processes started with dimensions {sorted(dimensions)}")
        self._dimension = dimensions.pop()
        self._idle: queue.SimpleQueue[QueryEmbedProcess] = queue.SimpleQueue()
        for child in self.children:
            self._idle.put(child)
        self._closed = threading.Event()

    @property
    def dimension(self) -> int:
        return self._dimension

    @property
    def pids(self) -> list[int | None]:
        """Each child's process id (None for one that is not running now: it restarts at its next call)."""
        return [child.pid for child in self.children]

    def embed_queries(self, texts: Sequence[str]) -> list[list[float]]:
        """The unit vectors of several questions, computed by an idle child (waits for one to be free)."""
        if not texts:
            return []
        if self._closed.is_set():
            raise UnavailableError(COMPONENT, "closed")
        try:
            # A child is busy for at most its request timeout, so a longer wait means none will come back.
            child = self._idle.get(timeout=self.request_timeout_s * 2)
        except queue.Empty:
            raise UnavailableError(COMPONENT, "no child process was free") from None
        try:
            return child.embed_queries(texts)
        finally:
            self._idle.put(child)

    def close(self) -> None:
        """Close every child (each waits for its call in flight, bounded); a second call does nothing."""
        self._closed.set()
        for child in self.children:
            child.close()


def _start_children(
    processes: int, model: str | None, device: str, start_timeout_s: float, request_timeout_s: float
) -> list[QueryEmbedProcess]:
    """`processes` children started side by side (each takes seconds to import torch and load the model); if one
    fails to start the others are closed and its error raised."""
    threads = child_threads(processes)

    def start(_: int) -> QueryEmbedProcess:
        return QueryEmbedProcess(model, device, start_timeout_s, request_timeout_s, threads=threads)

    with ThreadPoolExecutor(max_workers=processes, thread_name_prefix="embed-start") as starting:
        futures = [starting.submit(start, i) for i in range(processes)]
    started, failure = [], None
    for future in futures:
        try:
            started.append(future.result())
        except BaseException as err:
            failure = failure or err
    if failure is not None:
        for child in started:
            child.close()
        raise failure
    return started
