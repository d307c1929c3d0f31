"""A collection ingested with another tokenizer (a data dir kept across a model change) holds ids the model has no
embedding for: a question retrieving such a chunk gets a clear 500 naming the chunk and what to do, and the ids
never reach the device (on CUDA an id past the embedding table is an assert that ends the process)."""

from __future__ import annotations

from api_support import QUESTION, ingest
from app_server import MakeApp, server_of, wait_ready
from fastapi.testclient import TestClient

from service.packed_ids import pack_token_ids


def test_a_chunk_of_another_vocabulary_is_a_clear_error_not_a_device_fault(make_app: MakeApp) -> None:
    app = make_app()
    with TestClient(app) as client:
        wait_ready(app)
        assert ingest(client)["status"] == "done"
        runtime = server_of(app).runtime
        assert runtime is not None
        vocab = runtime.engine.spec.vocab_size
        collection = runtime.collection
        points, _ = collection._client.scroll(collection.name, limit=100, with_payload=True)
        foreign = pack_token_ids([5, vocab + 7, 9])
        collection._client.set_payload(collection.name, {"token_ids": foreign}, points=[p.id for p in points])

        reply = client.post("/ask", json={"question": QUESTION, "stream": False})

        assert reply.status_code == 500
        detail = reply.json()["detail"]
        assert f"token id {vocab + 7}, outside this model's vocabulary of {vocab}" in detail
        assert "ingest it again" in detail
        assert runtime.loop.waiting == 0  # its place in line was given back
