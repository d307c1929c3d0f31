"""The embedded gateway's answers leave nothing behind: once `/ask` answered, no request, no answer session and no
chunk KV block fetched for it is alive, by reference counting alone (the cyclic collector off: a long-running server
runs a full collection rarely, so what only it would free stays on the device meanwhile).

The answer sessions of `kvstitch serve` are those of `kvstitch engine` (tests/fleet/test_fleet_engine_memory.py):
each answer's session and request referenced each other, which kept every answer's chunk KV until a full collection.
"""

from __future__ import annotations

from api_support import QUESTION, ingest
from app_server import MakeApp, server_of, wait_ready
from fastapi.testclient import TestClient
from gc_alive import AliveSince, alive

from service.engine.batch_request import BatchRequest
from service.engine.kv_layout import KVBlock
from service.kvcache.tiers import Tier
from service.serving.answer_session import AnswerSession

ANSWERS = 6


def test_answers_leave_no_request_or_chunk_kv_alive(make_app: MakeApp, no_collector: None) -> None:
    app = make_app()  # no GPU tier (gpu_cache_mb=0): every answer's blocks are copied for it
    with TestClient(app) as client:
        wait_ready(app)
        ingest(client)
        runtime = server_of(app).runtime
        assert runtime is not None
        first = client.post("/ask", json={"question": QUESTION, "stream": False, "top_k": 2, "max_new_tokens": 4})
        assert first.status_code == 200, first.text
        runtime.store.flush()  # the disk writer holds computed blocks until written
        runtime.loop.call(lambda: None)
        blocks = AliveSince(KVBlock)
        hits = sum(runtime.store.stats().hits.values())

        for n in range(ANSWERS):
            body = {"question": QUESTION, "stream": n % 2 == 0, "top_k": 2, "max_new_tokens": 4}
            reply = client.post("/ask", json=body)
            assert reply.status_code == 200, reply.text
        runtime.loop.call(lambda: None)  # the engine thread's turn that ended the last answer is over

        assert sum(runtime.store.stats().hits.values()) - hits == 2 * ANSWERS
        assert runtime.store.stats().hits[Tier.GPU] == 0
        assert alive(BatchRequest) == []
        assert alive(AnswerSession) == []
        assert blocks.new() == []
