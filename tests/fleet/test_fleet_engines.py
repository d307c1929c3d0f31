"""A gateway in front of several `kvstitch engine` processes on loopback, with the real Redis: questions go where their
chunks are, the load bound holds, a SIGKILLed engine loses no question that had not started, a key-space mismatch is
reported. One fleet serves the module (engine start-ups are the slow part); the kill test runs last and takes e2.

The engines: e1 and e2 share the gateway's data dir (one host: KV files named by the shared Redis index) and answer
one question at a time (KVSTITCH_MAX_BATCH=1), so a second question to the same engine waits there, admitted but
not streaming; e3 stores its KV files in int8 (another key space) and must never be routed to.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from engine_processes import EngineProcess, ingest, sse, start_engines, wait_ready
from fastapi.testclient import TestClient

from service.api.app import create_app
from service.devtools.ports import free_port
from service.engine.engine import StitchEngine
from service.engine.model import load_model
from service.facade.types import AnswerRequest, DoneEvent
from service.fleet.routing import RouteDecision, RouteReason, RoutingMode, RoutingPolicy, owner
from service.kvcache.tiers import Tier
from service.retrieval.embedder import Embedder
from service.serving.fleet_gateway import Fleet
from service.serving.remote_answer import RemoteAnswer
from service.serving.server import Server
from service.settings import Settings
from workers.worker import in_process_worker

pytestmark = pytest.mark.slow

GATEWAY_SETTINGS: dict[str, Any] = {
    "chunk_size": 48,
    "chunk_overlap": 8,
    "max_precompute_tokens": 256,
    "gpu_cache_mb": 0,
    "host_cache_mb": 8,
    "disk_cache_mb": 512,
    "device": "cpu",
    "max_new_tokens_limit": 1024,
    "default_max_new_tokens": 16,
}
DOCS = [
    {"id": "otters", "text": "Sea otters hold hands while they sleep so they do not drift apart in the sea."},
    {"id": "volcano", "text": "Mauna Loa on Hawaii is the largest active volcano on Earth by its volume."},
    {"id": "bread", "text": "Sourdough bread rises because wild yeast and bacteria ferment the flour slowly."},
]
GLACIER = {"id": "glacier", "text": "Glaciers carve deep U-shaped valleys as the ice grinds over the bedrock."}
GLACIER_QUESTION = "What shape of valley does a glacier carve?"
COMET = {"id": "comet", "text": "A comet's tail always points away from the Sun, pushed by the solar wind."}
COMET_QUESTION = "Which way does a comet's tail point?"
OTTERS = "Why do sea otters hold hands?"
VOLCANO = "Which volcano is the largest on Earth?"


class FleetUnderTest:
    def __init__(self, client: TestClient, server: Server, engines: dict[str, EngineProcess]) -> None:
        self.client = client
        self.server = server
        self.engines = engines

    @property
    def fleet(self) -> Fleet:
        assert self.server.fleet is not None
        return self.server.fleet

    def chunk_ids(self, question: str, top_k: int = 1) -> list[list[int]]:
        """The token ids of the chunks the gateway retrieves for `question` (as it will send them)."""
        reply = self.client.post("/retrieve", json={"question": question, "top_k": top_k})
        assert reply.status_code == 200, reply.text
        runtime = self.server.runtime
        assert runtime is not None
        hits = runtime.search(question, top_k)
        assert [h.id for h in hits] == [c["id"] for c in reply.json()["chunks"]]
        return [list(h.token_ids) for h in hits]

    def place_on(self, engine: str, question: str, top_k: int = 1) -> list[str]:
        """Have `engine` compute the question's chunks (its host tier then holds them) and wait until the gateway's
        view shows them there; their keys."""
        ids = self.chunk_ids(question, top_k)
        reply = httpx.post(f"{self.engines[engine].url}/precompute", json={"chunks": ids}, timeout=30)
        assert reply.status_code == 200, reply.text
        runtime = self.server.runtime
        assert runtime is not None and self.fleet.view is not None
        keys = [runtime.store.key_of(runtime.engine.template.chunk_block(tuple(c))) for c in ids]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if all(t is Tier.HOST for t in self.fleet.view.tiers(keys).get(engine, [])):
                return keys
            time.sleep(0.05)
        raise AssertionError(f"the view never placed {keys} on {engine}: {self.fleet.view.tiers(keys)}")

    def ingest_onto_owner(self, document: dict[str, str], question: str) -> tuple[str, str, list[str]]:
        """Ingest a document of one chunk no other test uses: the gateway has it computed on the engine it belongs
        to (`routing.owner`) alone; (that engine, the other one, the chunk's keys) once the view shows it so."""
        ingest(self.client, [document])
        runtime = self.server.runtime
        assert runtime is not None and self.fleet.view is not None
        keys = [runtime.store.key_of(runtime.engine.template.chunk_block(tuple(c))) for c in self.chunk_ids(question)]
        holder = owner(keys[0], ["e1", "e2"])
        other = "e2" if holder == "e1" else "e1"
        deadline = time.monotonic() + 10
        while self.fleet.view.tiers(keys).get(holder) != [Tier.HOST] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert self.fleet.view.tiers(keys) == {holder: [Tier.HOST], other: [Tier.MISS]}
        return holder, other, keys


@pytest.fixture(scope="module")
def fleet(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dirs: dict[str, Path], redis_url: str
) -> Iterator[FleetUnderTest]:
    import uuid

    import redis

    prefix = f"kvstitch-test:{uuid.uuid4().hex}"
    root = tmp_path_factory.mktemp("fleet")
    shared = root / "data"
    model = str(tiny_model_dirs["qwen2"])
    env = {
        "KVSTITCH_MODEL": model,
        "KVSTITCH_REDIS_URL": redis_url,
        "KVSTITCH_REDIS_PREFIX": prefix,
        "KVSTITCH_DATA_DIR": str(shared),
        "KVSTITCH_MAX_BATCH": "1",
    }
    # e1 serves its API from its own process, e2 from a second one (KVSTITCH_ENGINE_API_PROCESS, the default): every
    # test here runs through both forms
    inline = {**env, "KVSTITCH_ENGINE_API_PROCESS": "false"}
    started = start_engines([("e1", free_port(), inline), ("e2", free_port(), env)], root)
    engines = {e.engine_id: e for e in started}
    settings = Settings(
        model=model,
        data_dir=shared,
        redis_url=redis_url,
        redis_prefix=prefix,
        engines=",".join(e.url for e in engines.values()),
        **GATEWAY_SETTINGS,
    )
    try:
        server = Server(settings, StitchEngine(load_model(model, device="cpu")), Embedder(), in_process_worker)
        with TestClient(create_app(server)) as client:
            assert server.started.wait(120) and server.ready, server.startup_error
            ingest(client, DOCS)  # while the engines start
            wait_ready(started)
            _wait_routable(server, {"e1", "e2"})
            yield FleetUnderTest(client, server, engines)
    finally:
        for process in engines.values():
            process.stop()
        connection = redis.Redis.from_url(redis_url)
        leftovers = list(connection.scan_iter(match=f"{prefix}:*"))
        if leftovers:
            connection.delete(*leftovers)
        connection.close()


def _wait_routable(server: Server, wanted: set[str]) -> None:
    assert server.fleet is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        routable = {s.engine_id for s in server.fleet.engines() if s.routable}
        if wanted <= routable:
            return
        time.sleep(0.1)
    raise AssertionError(f"engines not routable: {server.fleet.engines()}")


def _request(question: str, max_new_tokens: int = 8, top_k: int = 1) -> AnswerRequest:
    return AnswerRequest(question, top_k, "turbo", "reordered", max_new_tokens, 0.0, 1.0, None)


@pytest.fixture
def policy(fleet: FleetUnderTest) -> Iterator[None]:
    """Each test sets the routing policy it needs; the module's is put back after it."""
    kept = fleet.fleet.policy
    yield
    fleet.fleet.policy = kept


# ---- routing follows the chunks -------------------------------------------------------------------------------


@pytest.mark.usefixtures("policy")
def test_a_question_goes_to_the_engine_that_holds_its_chunks(fleet: FleetUnderTest) -> None:
    for holder, question in (("e2", OTTERS), ("e1", VOLCANO)):
        fleet.place_on(holder, question)

        reply = fleet.client.post("/ask", json={"question": question, "top_k": 1, "stream": False})

        assert reply.status_code == 200, reply.text
        decision = fleet.fleet.recent[-1].decision
        assert (decision.engine, decision.reason, decision.tiers) == (holder, RouteReason.COST, (Tier.HOST,))
        assert decision.cost == decision.best_cost
        # The answer itself says the engine found the chunk in its host tier: nothing loaded from disk or computed.
        assert reply.json()["kv"] == {"gpu": 0, "host": 1, "disk": 0, "miss": 0}
    metrics = fleet.client.get("/metrics").text
    assert 'kvstitch_route_chunks_total{reason="cost",tier="host"}' in metrics
    assert _sample(metrics, 'kvstitch_route_chunks_total{reason="cost",tier="host"}') >= 2


def test_the_gateway_answers_as_the_engine_alone_would(fleet: FleetUnderTest) -> None:
    """Streaming through the gateway: the same SSE events as the embedded form, the answer the engine made."""
    with fleet.client.stream("POST", "/ask", json={"question": OTTERS, "top_k": 2, "max_new_tokens": 12}) as reply:
        assert reply.status_code == 200
        events = list(sse(reply.iter_lines()))
    names = [name for name, _ in events]
    assert names[0] == "retrieval" and names[-1] == "done" and set(names[1:-1]) <= {"token"}
    done = events[-1][1]
    text = "".join(data["text"] for name, data in events if name == "token")
    assert done["output_tokens"] == 12 or done["finish_reason"] == "stop"
    assert text and done["timings_ms"]["retrieve"] > 0
    assert len(events[0][1]["chunks"]) == 2
    # Straight to the engine that answered, with the same chunks: the same greedy answer.
    engine = fleet.engines[fleet.fleet.recent[-1].decision.engine]
    sent = events[0][1]["chunks"]
    ids = fleet.chunk_ids(OTTERS, 2)
    chunks = [
        {"id": c["id"], "doc_id": c["doc_id"], "score": c["score"], "text": c["text"], "token_ids": t}
        for c, t in zip(sent, ids, strict=True)
    ]
    body = {"question": OTTERS, "chunks": chunks}
    direct = httpx.post(f"{engine.url}/answer", json={**body, "max_new_tokens": 12}, timeout=30)
    lines = [line for line in direct.text.splitlines() if line]
    assert '"event":"done"' in lines[-1]
    assert f'"answer":{_json_str(text)}' in lines[-1]


# ---- the load bound ---------------------------------------------------------------------------------------


@pytest.mark.usefixtures("policy")
def test_the_load_bound_sends_questions_past_it_to_the_idlest_engine(fleet: FleetUnderTest) -> None:
    """Chunks on one engine and a load term too small to outweigh them: every question would go there but for the
    bound; with balance_abs=2 the chosen engine never runs more than 2 answers over the idlest one."""
    holder, other, _ = fleet.ingest_onto_owner(GLACIER, GLACIER_QUESTION)
    fleet.fleet.policy = RoutingPolicy(load_cost_tokens=1.0, balance_abs=2, balance_rel=1.0)
    before = len(fleet.fleet.recent)
    running: dict[str, float] = {}

    async def scenario() -> list[tuple[str | None, DoneEvent | None]]:
        streams = [await fleet.server.answer(_request(GLACIER_QUESTION, max_new_tokens=4)) for _ in range(6)]
        running.update(_samples(fleet.server.metrics_text().decode(), "kvstitch_fleet_engine_running"))
        for stream in streams:
            async for _ in stream:
                pass
        return [(s.engine, s.done) for s in streams if isinstance(s, RemoteAnswer)]

    answers = asyncio.run(scenario())

    routed = list(fleet.fleet.recent)[before:]
    assert len(routed) == 6 and all(done is not None for _, done in answers)
    for r in routed:
        assert r.loads[r.decision.engine] - min(r.loads.values()) <= 2
    # Opened together and held open: the holder takes three (0, 1, 2 answers over the other), then the bound sends
    # the 4th to the other although the holder is cheaper (later ones may find the chunk there too: it computed it).
    assert [r.decision.engine for r in routed[:4]] == [holder] * 3 + [other]
    assert [r.decision.reason for r in routed[:4]] == [RouteReason.COST] * 3 + [RouteReason.BALANCE]
    assert routed[3].decision.cost > routed[3].decision.best_cost
    # While the six were open, the gateway's metrics counted them on their engines; all closed now.
    chosen = [r.decision.engine for r in routed]
    assert running == {f'{{engine="{e}"}}': float(chosen.count(e)) for e in ("e1", "e2")}
    assert {s.engine_id: s.running for s in fleet.fleet.engines()} == {"e1": 0, "e2": 0}


@pytest.mark.usefixtures("policy")
def test_round_robin_alternates_the_engines_where_chunk_aware_follows_the_chunks(fleet: FleetUnderTest) -> None:
    """The same question, its chunk on one engine alone: chunk-aware sends it there every time; with
    KVSTITCH_FLEET_ROUTING=round-robin it goes to each engine in turn, counted under its own reason."""
    holder, _, _ = fleet.ingest_onto_owner(COMET, COMET_QUESTION)

    def ask(times: int) -> list[RouteDecision]:
        before = len(fleet.fleet.recent)
        for _ in range(times):
            body = {"question": COMET_QUESTION, "top_k": 1, "stream": False, "max_new_tokens": 2}
            reply = fleet.client.post("/ask", json=body)
            assert reply.status_code == 200, reply.text
        return [r.decision for r in list(fleet.fleet.recent)[before:]]

    assert [d.engine for d in ask(2)] == [holder, holder]

    fleet.fleet.policy = RoutingPolicy(mode=RoutingMode.ROUND_ROBIN)
    rounds = ask(4)
    assert sorted(d.engine for d in rounds) == ["e1", "e1", "e2", "e2"]
    assert all(a.engine != b.engine for a, b in itertools.pairwise(rounds))
    assert {d.reason for d in rounds} == {RouteReason.ROUND_ROBIN}
    counted = _samples(fleet.client.get("/metrics").text, "kvstitch_route_chunks_total")
    assert sum(counted[f'{{reason="round-robin",tier="{t.value}"}}'] for t in Tier) == 4


# ---- key-space mismatch -----------------------------------------------------------------------------------


def test_engines_of_another_key_space_are_reported_and_never_routed_to(
    fleet: FleetUnderTest, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A gateway that stores its KV files in int8 keys chunks in another key space than the engines (native): it
    says so in its metrics, its log and /readyz, and refuses questions (503) instead of missing every chunk."""
    settings = fleet.server.settings.model_copy(update={"data_dir": tmp_path / "int8", "kv_disk_format": "int8"})
    runtime = fleet.server.runtime
    assert runtime is not None
    server = Server(settings, runtime.engine, runtime.embedder, in_process_worker)
    with caplog.at_level(logging.WARNING), TestClient(create_app(server)) as client:
        assert server.started.wait(60) and server.ready, server.startup_error
        metrics = client.get("/metrics").text
        readiness = client.get("/readyz")
        reply = client.post("/ask", json={"question": OTTERS, "stream": False})
        assert server.fleet is not None and server.fleet.view is not None
        view = server.fleet.view.stats()

    assert _sample(metrics, 'kvstitch_fleet_key_space_mismatch{engine="e1"}') == 1
    assert _sample(metrics, 'kvstitch_fleet_key_space_mismatch{engine="e2"}') == 1
    assert _sample(metrics, "kvstitch_fleet_engines_live") == 0
    assert readiness.status_code == 503
    assert "e1: mismatched key space" in readiness.json()["checks"]["engines"]
    assert reply.status_code == 503 and "key space differs (stored)" in reply.json()["detail"]
    # The placement view read the engines' announcements in Redis and set them aside too.
    assert view.engines == 0 and set(view.mismatched_moves) == {"e1", "e2"}
    warned = [r.message for r in caplog.records if "another key space" in r.message]
    assert any("e1" in m and "stored differ" in m for m in warned), caplog.text
    # Meanwhile the module's gateway (native) still routes to both.
    assert {s.engine_id for s in fleet.fleet.engines() if s.routable} == {"e1", "e2"}


def test_v1_answers_through_the_gateway_and_an_engine_refuses_a_bad_request(fleet: FleetUnderTest) -> None:
    body = {
        "model": fleet.server.model_name,
        "messages": [{"role": "user", "content": OTTERS}],
        "max_tokens": 5,
        "temperature": 0,
    }
    reply = fleet.client.post("/v1/chat/completions", json=body)

    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["message"]["content"] and reply.json()["usage"]["completion_tokens"] <= 5
    bad = httpx.post(f"{fleet.engines['e1'].url}/answer", json={"question": "x", "chunks": [{"id": 1}]}, timeout=10)
    assert bad.status_code == 422 and "chunks[0]" in bad.text


def test_a_gateway_finds_the_engines_in_redis(fleet: FleetUnderTest, tmp_path: Path) -> None:
    """`--engines redis`: no URL given; the engines' heartbeats in Redis carry theirs."""
    settings = fleet.server.settings.model_copy(update={"data_dir": tmp_path / "discover", "engines": "redis"})
    runtime = fleet.server.runtime
    assert runtime is not None
    server = Server(settings, runtime.engine, runtime.embedder, in_process_worker)
    with TestClient(create_app(server)) as client:
        assert server.started.wait(60) and server.ready, server.startup_error
        _wait_routable(server, {"e1", "e2"})
        assert server.fleet is not None
        assert sorted(s.url for s in server.fleet.engines()) == sorted(e.url for e in fleet.engines.values())
        reply = client.post("/ask", json={"question": OTTERS, "max_new_tokens": 3, "stream": False})
        # This gateway's own collection is empty (another data dir): an answer without sources, made on an engine.
        assert reply.status_code == 200 and reply.json()["output_tokens"] >= 1
        assert server.fleet.recent[-1].decision.engine in {"e1", "e2"}


def test_a_client_that_leaves_frees_its_place_on_the_engine(fleet: FleetUnderTest) -> None:
    """The gateway stops reading after one token: the engine sees its connection close and cancels the answer."""

    async def leave_after_one_token() -> str | None:
        stream = await fleet.server.answer(_request(OTTERS, max_new_tokens=1000))
        async for _ in stream:
            break
        stream.cancel()  # what /ask and /v1 do when their client went away
        await asyncio.sleep(0.2)
        assert isinstance(stream, RemoteAnswer)
        return stream.engine

    engine = asyncio.run(leave_after_one_token())

    assert engine is not None
    deadline = time.monotonic() + 10
    while (load := httpx.get(f"{fleet.engines[engine].url}/load", timeout=5).json()) != {"running": 0, "waiting": 0}:
        assert time.monotonic() < deadline, f"{engine} still holds the answer: {load}"
        time.sleep(0.05)
    assert {s.engine_id: s.running for s in fleet.fleet.engines()} == {"e1": 0, "e2": 0}


# ---- an engine killed mid-load (last: it takes e2 away) ----------------------------------------------------


@pytest.mark.usefixtures("policy")
def test_a_killed_engine_loses_no_question_that_had_not_started(fleet: FleetUnderTest) -> None:
    """Four questions on e2 (its chunks' holder), one streaming and three waiting there (it answers one at a time);
    SIGKILL e2: the streaming one ends with an error event, the three are answered by e1, and e2 leaves routing."""
    fleet.place_on("e2", OTTERS)
    fleet.fleet.policy = RoutingPolicy(load_cost_tokens=1.0, balance_abs=100)
    long, short = {"question": OTTERS, "top_k": 1, "max_new_tokens": 1000}, {"question": OTTERS, "top_k": 1}
    results: dict[int, list[tuple[str, dict[str, Any]]]] = {}
    first_token = threading.Event()

    def ask(n: int) -> None:
        with fleet.client.stream("POST", "/ask", json=long if n == 0 else short, timeout=60) as reply:
            assert reply.status_code == 200
            events = []
            for event in sse(reply.iter_lines()):
                events.append(event)
                if n == 0 and event[0] == "token":
                    first_token.set()
            results[n] = events

    threads = [threading.Thread(target=ask, args=(0,))]
    threads[0].start()
    assert first_token.wait(30), "the first answer never streamed"
    threads += [threading.Thread(target=ask, args=(n,)) for n in (1, 2, 3)]
    for t in threads[1:]:
        t.start()
    _wait_load(fleet.engines["e2"], 4)
    reroutes = _sample(fleet.client.get("/metrics").text, "kvstitch_fleet_reroutes_total")

    fleet.engines["e2"].kill()
    for t in threads:
        t.join(60)

    streaming = results[0]
    assert streaming[-1][0] == "error" and "e2" in streaming[-1][1]["message"], streaming[-3:]
    assert [name for name, _ in streaming[1:-1]] == ["token"] * (len(streaming) - 2)
    for n in (1, 2, 3):
        names = [name for name, _ in results[n]]
        assert names[0] == "retrieval" and names[-1] == "done", results[n][-2:]
    answered = [r.decision.engine for r in list(fleet.fleet.recent)[-3:]]
    assert answered == ["e1", "e1", "e1"]
    metrics = fleet.client.get("/metrics").text
    assert _sample(metrics, "kvstitch_fleet_reroutes_total") == reroutes + 3
    # Out of routing at once (the failed connections), and still out: its probes fail.
    assert {s.engine_id for s in fleet.fleet.engines() if s.routable} == {"e1"}
    reply = fleet.client.post("/ask", json={**short, "stream": False})
    assert reply.status_code == 200 and fleet.fleet.recent[-1].decision.engine == "e1"


def _wait_load(engine: EngineProcess, answers: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        load = httpx.get(f"{engine.url}/load", timeout=5).json()
        if load["running"] + load["waiting"] >= answers:
            return
        time.sleep(0.05)
    raise AssertionError(f"{engine.engine_id} never held {answers} answers: {load}")


def _sample(metrics: str, name: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no sample {name} in the metrics")


def _samples(metrics: str, name: str) -> dict[str, float]:
    """Label set -> value of every sample of `name`."""
    found = {}
    for line in metrics.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) :].rsplit(" ", 1)
            found[labels] = float(value)
    return found


def _json_str(text: str) -> str:
    import json

    return json.dumps(text, ensure_ascii=False)
