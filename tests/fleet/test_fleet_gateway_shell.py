"""A gateway without weights and without Redis: it loads its model as a shell (parameters on the meta device), keys
chunks in the engines' key space, has ingestion's chunk KV computed on the engine each chunk belongs to, and answers
through the engines (two CPU engine processes of the tiny model, each with its own data dir)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from engine_processes import EngineProcess, ingest, start_engines, wait_ready
from fastapi.testclient import TestClient

from service.api.app import create_app
from service.devtools.ports import free_port
from service.engine.model import load_model
from service.fleet.routing import owner
from service.kvcache.keys import model_fingerprint
from service.retrieval.embedder import Embedder
from service.serving.runtime import engines_dtype, open_engine, open_gateway_model
from service.serving.server import Server
from service.settings import Settings
from workers.worker import in_process_worker

pytestmark = pytest.mark.slow

DOCS = [
    {"id": f"doc{n}", "text": f"Fact {n}: the {word} lighthouse was painted {colour} in the year {1900 + n}."}
    for n, (word, colour) in enumerate(
        [("northern", "red"), ("harbour", "white"), ("island", "green"), ("cliff", "blue"), ("river", "grey")]
    )
]


def test_a_gateway_model_is_a_shell_keyed_as_the_loaded_model(tiny_model_dirs: dict[str, Path]) -> None:
    folder = tiny_model_dirs["qwen2"]
    settings = Settings(model=str(folder), engines="http://127.0.0.1:1", device="cpu", _env_file=None)  # type: ignore[call-arg]

    shell = open_gateway_model(settings)

    assert not shell.has_weights
    assert {p.device.type for p in shell.hf.parameters()} == {"meta"}
    assert model_fingerprint(shell) == model_fingerprint(load_model(folder, device="cpu"))
    assert shell.spec.dtype is torch.float32
    # The engines' dtype comes from their device setting, without a GPU here: cuda means bfloat16.
    assert engines_dtype(settings.model_copy(update={"device": "cuda"})) is torch.bfloat16
    assert engines_dtype(settings.model_copy(update={"device": "cuda", "dtype": "float16"})) is torch.float16
    # The shell is a serving gateway's alone: a worker or `kvstitch ingest` of the same settings computes KV.
    assert not open_engine(settings, gateway=True).model.has_weights
    assert open_engine(settings).model.has_weights


@pytest.fixture(scope="module")
def engines(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dirs: dict[str, Path]
) -> Iterator[list[EngineProcess]]:
    root = tmp_path_factory.mktemp("shell-fleet")
    model = str(tiny_model_dirs["qwen2"])
    specs = [
        (f"e{n}", free_port(), {"KVSTITCH_MODEL": model, "KVSTITCH_DATA_DIR": str(root / f"e{n}")}) for n in (1, 2)
    ]
    started = start_engines(specs, root)
    wait_ready(started)
    try:
        yield started
    finally:
        for engine in started:
            engine.stop()


def test_ingestion_computes_each_chunk_on_its_engine_and_the_gateway_answers_through_them(
    engines: list[EngineProcess], tiny_model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    settings = Settings(
        model=str(tiny_model_dirs["qwen2"]),
        data_dir=tmp_path / "gateway",
        engines=",".join(e.url for e in engines),
        device="cpu",
        chunk_size=48,
        chunk_overlap=0,
        max_new_tokens_limit=64,
        default_max_new_tokens=4,
        _env_file=None,  # type: ignore[call-arg]
    )
    server = Server(settings, embedder=Embedder(), worker_factory=in_process_worker)
    with TestClient(create_app(server)) as client:
        assert server.started.wait(120) and server.ready, server.startup_error
        runtime, fleet = server.runtime, server.fleet
        assert runtime is not None and fleet is not None
        assert not runtime.engine.model.has_weights
        assert runtime.store.host.pool.capacity_bytes == 0  # no memory tier: it serves no KV
        ids = sorted(e.engine_id for e in engines)
        assert sorted(str(s.engine_id) for s in fleet.engines() if s.routable) == ids  # one key space

        ingest(client, DOCS)

        template = runtime.engine.template
        keys = {
            d["id"]: runtime.store.key_of(template.chunk_block(runtime.search(d["text"], 1)[0].token_ids)) for d in DOCS
        }
        held = {e.engine_id: set(_held_keys(e.url)) for e in engines}
        for key in keys.values():
            holder = owner(key, ids)
            assert key in held[holder] and all(key not in k for e, k in held.items() if e != holder)
        assert fleet.unplaced == 0

        reply = client.post("/ask", json={"question": DOCS[0]["text"], "top_k": 1, "stream": False})
        assert reply.status_code == 200, reply.text
        # Without Redis the gateway sees no tiers; idle engines tie, and the tie goes to the chunk's owner, which
        # ingestion had compute it: found there, not computed again.
        assert fleet.recent[-1].decision.engine == owner(keys["doc0"], ids)
        assert reply.json()["kv"]["miss"] == 0


def _held_keys(url: str) -> list[str]:
    tiers = httpx.get(f"{url}/tiers", params={"limit": 1000}, timeout=10).json()
    return [key for tier in tiers.values() for key in tier["keys"]]
