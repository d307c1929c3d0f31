"""Question embeddings in a pool of child processes: the same vectors, in the same order, as one child and as the
in-process embedder, whichever child serves a call; calls served side by side; a dead child fails only its own
call and is replaced; the bounds; a clean close. One pool of two children is shared (each start costs seconds)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest
from pydantic import ValidationError
from test_retrieval_embed_process import QUESTIONS, alive, max_abs_diff, wait_dead

from service.errors import UnavailableError
from service.retrieval import embed_process
from service.retrieval.embed_pool import MAX_PROCESSES, QueryEmbedPool
from service.retrieval.embedder import Embedder
from service.settings import Settings

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pool() -> Iterator[QueryEmbedPool]:
    started = QueryEmbedPool(2)
    yield started
    started.close()


def test_the_pools_vectors_equal_the_in_process_embedders_in_order(pool: QueryEmbedPool, embedder: Embedder) -> None:
    expected = embedder.embed_queries(QUESTIONS)

    # Enough calls that both children serve some: each call's rows are its own texts', in its order.
    for start in range(len(QUESTIONS)):
        texts = QUESTIONS[start:] + QUESTIONS[:start]
        got = pool.embed_queries(texts)
        assert max_abs_diff(got, expected[start:] + expected[:start]) <= 1e-5

    assert pool.dimension == 384 and len(pool.children) == 2
    assert len(set(pool.pids)) == 2 and all(pid is not None and alive(pid) for pid in pool.pids)
    assert pool.embed_queries([]) == []


def test_concurrent_calls_run_on_different_children_and_each_gets_its_own_rows(
    pool: QueryEmbedPool, embedder: Embedder
) -> None:
    expected = {q: row for q, row in zip(QUESTIONS, embedder.embed_queries(QUESTIONS), strict=True)}
    served: list[int | None] = []
    results: dict[int, list[list[float]]] = {}
    original = embed_process.QueryEmbedProcess.embed_queries
    both_in = threading.Barrier(2, timeout=30)

    def held(child: embed_process.QueryEmbedProcess, texts: list[str]) -> list[list[float]]:
        served.append(child.pid)
        both_in.wait()  # passes only if the second call got a child while the first holds the other
        return original(child, texts)

    def call(i: int) -> None:
        results[i] = pool.embed_queries([QUESTIONS[i], QUESTIONS[-1 - i]])

    try:
        embed_process.QueryEmbedProcess.embed_queries = held  # type: ignore[method-assign]
        callers = [threading.Thread(target=call, args=(i,)) for i in range(2)]
        for caller in callers:
            caller.start()
        for caller in callers:
            caller.join(timeout=60)
    finally:
        embed_process.QueryEmbedProcess.embed_queries = original  # type: ignore[method-assign]

    assert sorted(served) == sorted(pool.pids)  # one call on each child, at once
    for i in range(2):
        assert max_abs_diff(results[i], [expected[QUESTIONS[i]], expected[QUESTIONS[-1 - i]]]) <= 1e-5


def test_a_child_killed_during_a_call_fails_that_call_only_and_is_replaced(
    pool: QueryEmbedPool, embedder: Embedder
) -> None:
    expected = embedder.embed_queries(QUESTIONS)
    victim = pool.children[0]
    pid = victim.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)  # frozen: a call it takes is sent but never answered
    failures: list[BaseException] = []

    def call() -> None:
        try:
            pool.embed_queries(QUESTIONS)
        except BaseException as err:
            failures.append(err)

    callers = [threading.Thread(target=call) for _ in range(2)]
    for caller in callers:
        caller.start()
    time.sleep(1.0)  # both calls hold a child; the frozen one's caller waits on its pipe
    os.kill(pid, signal.SIGKILL)
    for caller in callers:
        caller.join(timeout=30)
    wait_dead(pid)

    assert len(failures) == 1 and isinstance(failures[0], UnavailableError)
    assert f"pid {pid}) exited with code -9 during a request" in str(failures[0])
    assert victim.pid is None  # forgotten; restarted at its next call
    for _ in range(3):  # whichever child serves, the answer is right; the dead one comes back
        assert max_abs_diff(pool.embed_queries(QUESTIONS), expected) <= 1e-5
    assert victim.pid not in (None, pid)


def test_the_number_of_children_is_bounded() -> None:
    for wrong in (0, MAX_PROCESSES + 1):
        with pytest.raises(ValueError, match=f"processes must be 1 to {MAX_PROCESSES}, got {wrong}"):
            QueryEmbedPool(wrong)


@pytest.mark.parametrize(("cpus", "children", "threads"), [(2, 1, 2), (2, 2, 1), (16, 2, 4), (6, 4, 1), (1, 3, 1)])
def test_children_share_the_cores(monkeypatch: pytest.MonkeyPatch, cpus: int, children: int, threads: int) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: cpus)
    assert embed_process.child_threads(children) == threads


def test_close_ends_every_child_and_later_calls_are_refused() -> None:
    pool = QueryEmbedPool(2)
    pids = pool.pids
    assert all(pid is not None and alive(pid) for pid in pids)

    pool.close()

    assert not any(alive(pid) for pid in pids if pid is not None)
    with pytest.raises(UnavailableError, match="closed"):
        pool.embed_queries(QUESTIONS[:1])
    pool.close()  # idempotent


def test_the_setting_is_bounded_and_defaults_to_two_children() -> None:
    assert Settings.model_fields["embedding_processes"].default == 2
    for wrong in (0, MAX_PROCESSES + 1):
        with pytest.raises(ValidationError, match="embedding_processes"):
            Settings(embedding_processes=wrong)
    assert Settings(embedding_processes=MAX_PROCESSES).embedding_processes == MAX_PROCESSES
