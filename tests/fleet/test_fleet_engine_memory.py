"""An engine process's answers leave nothing behind: once answered, no request, no answer session and no chunk KV
block fetched for them is alive, by reference counting alone (the collector off, as good as it is in a long-running
server: a full collection waits for hundreds of thousands of new objects).

Through the engine's own app (`create_engine_app` over `EngineServer`): each answer's chunks are host-tier hits
copied for it (no GPU tier keeps them). Answer sessions used to reference their requests and be referenced back by
the requests' callbacks and their own listener, cycles that kept every answer's chunk KV on the device until a full
collection: an H200 engine with a 1 GiB GPU tier ran out of memory after a few hundred answers.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient
from gc_alive import AliveSince, alive

from service.api.engine_app import create_engine_app
from service.engine.batch_request import BatchRequest
from service.engine.engine import StitchEngine
from service.engine.gate import synthetic_ids
from service.engine.kv_layout import KVBlock
from service.kvcache.tiers import Tier
from service.serving.answer_session import AnswerSession
from service.serving.engine_server import EngineServer
from service.settings import Settings

CHUNKS = 10
READS = 4
ANSWERS = 12


def answer_body(chunks: list[list[int]], n: int) -> dict[str, Any]:
    reads = [(n + i) % CHUNKS for i in range(READS)]
    return {
        "question": f"question {n}?",
        "max_new_tokens": 3,
        "chunks": [{"id": f"c{c}", "doc_id": "d", "score": 1.0, "text": "t", "token_ids": chunks[c]} for c in reads],
    }


def test_answered_requests_leave_no_chunk_kv_alive(
    get_engine: Callable[[str, str], StitchEngine], tiny_model_dirs: dict[str, Path], tmp_path: Path, no_collector: None
) -> None:
    engine = get_engine("qwen2", "cpu")
    settings = Settings(
        model=str(tiny_model_dirs["qwen2"]),
        data_dir=tmp_path / "engine",
        device="cpu",
        gpu_cache_mb=0,  # no GPU tier: every block of every answer is copied for it from the host tier
        host_cache_mb=8,
        disk_cache_mb=64,
        # The collector as this test process has it: a ready engine would freeze the heap and raise the threshold.
        gc_freeze=False,
        gc_gen0_threshold=gc.get_threshold()[0],
        gate_on_start=False,
    )
    server = EngineServer(settings, "e1", "http://127.0.0.1:9", engine)
    chunks = synthetic_ids(engine, [24] * CHUNKS, seed=9)
    with TestClient(create_engine_app(server)) as client:
        assert server.started.wait(120) and server.ready, server.startup_error
        runtime = server.runtime
        assert runtime is not None
        warm = client.post("/precompute", json={"chunks": chunks})
        assert warm.status_code == 200 and warm.json()["miss"] == CHUNKS
        runtime.store.flush()  # the disk writer holds computed blocks until written
        engine.prefix_block  # noqa: B018 (computed once, kept by the engine)
        blocks = AliveSince(KVBlock)

        for n in range(ANSWERS):
            reply = client.post("/answer", json=answer_body(chunks, n))
            assert reply.status_code == 200 and '"done"' in reply.text, reply.text[-500:]
        runtime.loop.call(lambda: None)  # the engine thread's turn that ended the last answer is over

        assert runtime.store.stats().hits[Tier.HOST] == ANSWERS * READS
        assert alive(BatchRequest) == []
        assert alive(AnswerSession) == []
        assert blocks.new() == []
