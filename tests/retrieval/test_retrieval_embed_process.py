"""Question embeddings in a child process: the same vectors as in-process, a dead child replaced, a clear start-up
error, a clean close, and when the runtime chooses a child. Each child start costs ~8 s on 2 cores (torch and
sentence-transformers imported afresh), so the tests share children where they can."""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from service.errors import UnavailableError
from service.retrieval.embed_process import EmbedProcessError, QueryEmbedProcess
from service.retrieval.embedder import Embedder, bundled_model_path
from service.serving.runtime import question_embedder_in_child

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "How do sea otters keep warm?",
    "Which year did the first moon landing happen?",
    "x",
    "A longer question about the stitching of precomputed KV caches of chunks and their rotary positions.",
]


def max_abs_diff(a: list[list[float]], b: list[list[float]]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for row_a, row_b in zip(a, b, strict=True) for x, y in zip(row_a, row_b, strict=True))


def alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting to be reaped), from /proc (Linux)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def live_embed_children() -> list[int]:
    """This process's children that run the embedder (multiprocessing's resource tracker left out)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z" and b"resource_tracker" not in cmdline:
            found.append(int(stat.parent.name))
    return found


def threads_left(pid: int) -> int:
    """Threads of a process not yet released: a killed process's leader is a zombie while its other threads
    (torch's) still tear down, and its parent can reap it only once they are gone."""
    try:
        return sum(1 for _ in Path(f"/proc/{pid}/task").iterdir())
    except FileNotFoundError:
        return 0


def wait_dead(pid: int, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while alive(pid) or threads_left(pid) > 1:
        assert time.monotonic() < deadline, f"process {pid} still alive"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def child() -> Iterator[QueryEmbedProcess]:
    embedder = QueryEmbedProcess()
    yield embedder
    embedder.close()


def test_the_childs_vectors_equal_the_in_process_embedders(child: QueryEmbedProcess, embedder: Embedder) -> None:
    expected = embedder.embed_queries(QUESTIONS)

    got = child.embed_queries(QUESTIONS)

    assert child.dimension == embedder.dimension == 384
    assert [len(row) for row in got] == [384] * len(QUESTIONS)
    assert max_abs_diff(got, expected) <= 1e-5
    assert max_abs_diff(child.embed_queries(QUESTIONS[1:2]), expected[1:2]) <= 1e-5  # a batch of one too
    assert child.embed_queries([]) == []


def test_a_bad_message_gets_an_error_reply_and_the_child_keeps_serving(
    child: QueryEmbedProcess, embedder: Embedder
) -> None:
    conn = child._conn
    assert conn is not None
    for bad in [("embed", "not a list"), ("embed", [1, 2]), ("embed", []), "embed", ("shutdown",)]:
        conn.send(bad)
        reply = conn.recv()
        assert reply[0] == "error" and "bad request" in reply[1]
    assert max_abs_diff(child.embed_queries(QUESTIONS[:1]), embedder.embed_queries(QUESTIONS[:1])) <= 1e-5


def test_a_reply_of_the_wrong_shape_is_refused(child: QueryEmbedProcess) -> None:
    with pytest.raises(EmbedProcessError, match=r"shape \(2, 384\) for 3 texts"):
        child._vectors_from(("vectors", 2, 384, b"\0" * 2 * 384 * 4), 3)
    with pytest.raises(EmbedProcessError, match="bytes for 1x384"):
        child._vectors_from(("vectors", 1, 384, b"\0" * 10), 1)
    with pytest.raises(EmbedProcessError, match="failed: boom"):
        child._vectors_from(("error", "boom"), 1)


def test_a_killed_child_is_replaced(embedder: Embedder) -> None:
    """Killed while idle: the next call starts a fresh child and succeeds (it pays the start-up). Killed during a
    call: that call fails with UnavailableError (a 503), and the call after it gets a fresh child."""
    expected = embedder.embed_queries(QUESTIONS)
    process = QueryEmbedProcess()
    try:
        first = process.pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        wait_dead(first)

        assert max_abs_diff(process.embed_queries(QUESTIONS), expected) <= 1e-5
        second = process.pid
        assert second is not None and second != first

        os.kill(second, signal.SIGSTOP)  # frozen: the request below is sent but never answered
        failures: list[BaseException] = []
        caller = threading.Thread(target=lambda: _call_into(process, failures))
        caller.start()
        time.sleep(1.0)  # the caller's send takes microseconds; it now waits on the pipe
        os.kill(second, signal.SIGKILL)
        caller.join(timeout=30)
        assert not caller.is_alive()
        assert len(failures) == 1 and isinstance(failures[0], UnavailableError)
        assert "question embedder process is unreachable" in str(failures[0])
        assert f"pid {second}) exited with code -9 during a request" in str(failures[0])
        assert process.pid is None  # the dead child is forgotten at once

        assert max_abs_diff(process.embed_queries(QUESTIONS), expected) <= 1e-5
        assert process.pid not in (None, first, second)
    finally:
        process.close()


def _call_into(process: QueryEmbedProcess, failures: list[BaseException]) -> None:
    try:
        process.embed_queries(QUESTIONS)
    except BaseException as err:
        failures.append(err)


def test_a_failed_restart_is_an_outage_for_that_call_and_the_next_call_tries_again(
    embedder: Embedder, tmp_path: Path
) -> None:
    folder = tmp_path / "minilm"
    shutil.copytree(bundled_model_path(), folder)
    process = QueryEmbedProcess(str(folder))
    try:
        pid = process.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        wait_dead(pid)
        folder.rename(tmp_path / "moved")

        with pytest.raises(UnavailableError, match="restart failed") as caught:
            process.embed_queries(QUESTIONS)
        assert str(folder) in str(caught.value)

        (tmp_path / "moved").rename(folder)
        assert max_abs_diff(process.embed_queries(QUESTIONS), embedder.embed_queries(QUESTIONS)) <= 1e-5
    finally:
        process.close()


def test_a_missing_model_folder_fails_at_start_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "no-model-here"
    before = live_embed_children()
    with pytest.raises(EmbedProcessError, match="failed to start") as caught:
        QueryEmbedProcess(str(missing))
    assert str(missing) in str(caught.value) and "not available offline" in str(caught.value)
    assert live_embed_children() == before  # the failed child is gone and reaped


def test_close_leaves_no_live_child_and_a_second_close_does_nothing() -> None:
    process = QueryEmbedProcess()
    pid = process.pid
    assert pid is not None and alive(pid) and pid in live_embed_children()

    process.close()

    assert process.pid is None
    assert not alive(pid) and pid not in live_embed_children()
    process.close()  # idempotent
    assert process.pid is None
    with pytest.raises(UnavailableError, match="closed"):
        process.embed_queries(QUESTIONS[:1])


@pytest.mark.parametrize(
    ("mode", "device", "in_child"),
    [
        ("auto", "cpu", False),
        ("auto", "cuda", True),
        ("on", "cpu", True),
        ("on", "cuda", True),
        ("off", "cpu", False),
        ("off", "cuda", False),
    ],
)
def test_auto_runs_a_child_only_for_an_engine_on_cuda(mode: str, device: str, in_child: bool) -> None:
    assert question_embedder_in_child(mode, torch.device(device)) is in_child
