"""The gateway-engine contract without processes: the request and event formats both sides import, the gateway's
settings, `--gpus` and the engine ids, and a fleet with nothing to route to."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from service.commands.engine import default_engine_id, engine_url
from service.commands.serve import engine_environment, parse_gpus, stop_engines
from service.facade.engine import (
    EngineAnswerRequest,
    EngineStreamError,
    WireChunk,
    error_line,
    event_line,
    parse_answer_request,
    parse_event,
)
from service.facade.types import ChatMessage, DoneEvent, Logprob, TokenChoice, TokenEvent
from service.fleet.routing import ChunkRef, RoutingMode
from service.fleet.tier_events import ENGINE_ID
from service.kvcache.keys import KeySpace
from service.serving.fleet_gateway import Fleet, NoEngineError, token_batches
from service.settings import Settings

REQUEST = EngineAnswerRequest(
    question="why?",
    chunks=(WireChunk("c1", "d1", 0.5, "text", (1, 2, 3), {"lang": "en"}, {"title": "T"}),),
    mode="naive",
    positions="composite",
    max_new_tokens=7,
    temperature=0.5,
    top_p=0.9,
    seed=3,
    stop=("\n",),
    logprobs=2,
    recompute="selective:0.2",
    history=(ChatMessage("user", "hi"), ChatMessage("assistant", "hello")),
    dropped=1,
)


def test_a_request_survives_its_json_form() -> None:
    assert parse_answer_request(REQUEST.to_json()) == REQUEST


def test_chunk_ids_travel_packed_and_a_plain_list_still_reads() -> None:
    """A gateway sends each chunk's ids as one packed string (decoding ~500 JSON ints a chunk was the largest cost
    of the engine's event loop); a caller sending a plain list gets the same request."""
    sent = REQUEST.to_json()["chunks"][0]["token_ids"]
    assert isinstance(sent, str) and sent.startswith("u32le:")
    plain = {**REQUEST.to_json(), "chunks": [{**REQUEST.to_json()["chunks"][0], "token_ids": [1, 2, 3]}]}
    assert parse_answer_request(plain) == REQUEST == parse_answer_request(json.loads(REQUEST.body()))
    ids = (0, 151_642, 2**31 - 1)
    wide = dataclasses.replace(REQUEST, chunks=(dataclasses.replace(REQUEST.chunks[0], token_ids=ids),))
    assert parse_answer_request(wide.to_json()).chunks[0].token_ids == ids


def test_the_request_body_is_what_the_http_client_would_encode() -> None:
    """The gateway encodes the body on its worker thread (`body`) instead of handing httpx `to_json()` on the event
    loop: the bytes on the wire are the same, text outside ASCII included."""
    request = dataclasses.replace(REQUEST, question="pourquoi « ça » ? 🙂", stop=("\n", "fin ✓"))
    for each in (REQUEST, request, EngineAnswerRequest("why?", ())):
        sent = httpx.Request("POST", "http://engine/answer", json=each.to_json())
        assert each.body() == sent.read()
        assert parse_answer_request(json.loads(each.body())) == each


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"surprise": 1}, "unknown fields: surprise"),
        ({"question": "  "}, "question"),
        ({"chunks": [{"id": "c", "doc_id": "d", "token_ids": []}]}, "chunks[0].token_ids"),
        ({"chunks": [{"id": "c", "doc_id": "d", "token_ids": [-1]}]}, "chunks[0].token_ids"),
        ({"chunks": [{"id": "c", "doc_id": "d", "token_ids": [1]}] * 65}, "chunks"),
        ({"chunks": [{"id": "c", "doc_id": "d", "token_ids": [1 << 31]}]}, "chunks[0].token_ids"),
        ({"chunks": [{"id": "c", "doc_id": "d", "token_ids": "1,2,3"}]}, "chunks[0].token_ids"),
        ({"chunks": [{"id": "c", "doc_id": "d", "token_ids": "u32le:AAA"}]}, "chunks[0].token_ids"),
        ({"chunks": [{"id": "c", "doc_id": "d", "token_ids": "u32le:"}]}, "chunks[0].token_ids"),
        ({"chunks": [{"id": "c", "doc_id": "d", "token_ids": {"a": 1}}]}, "chunks[0].token_ids"),
        ({"mode": "fast"}, "mode"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": float("nan")}, "temperature"),
        ({"history": [{"role": "robot", "text": "x"}]}, "history.role"),
        ({"logprobs": True}, "logprobs"),
    ],
)
def test_a_bad_request_names_its_field(change: dict[str, object], named: str) -> None:
    with pytest.raises(ValueError, match=re.escape(named)):
        parse_answer_request({**REQUEST.to_json(), **change})


def test_events_survive_their_json_lines() -> None:
    top = (TokenChoice("b", -2.0, b"b"),)
    token = TokenEvent("a\ufffd", (Logprob("a", -0.5, b"a\xe2", top),))
    done = DoneEvent(
        "turbo", "reordered", 12.5, 3, "length", {"decode": 1.0}, {"gpu": 1, "miss": 0}, "abc", 40, 30,
        kv_bytes={"gpu": 10}, recompute="none", logprobs=token.logprobs,
    )  # fmt: skip

    assert parse_event(event_line(token)) == token
    assert parse_event(event_line(done)) == done
    with pytest.raises(EngineStreamError, match="out of memory"):
        parse_event(error_line("out of memory"))
    with pytest.raises(ValueError, match="malformed"):
        parse_event(b'{"event": "token"}')
    with pytest.raises(ValueError, match="unknown engine event"):
        parse_event(b'{"event": "nap"}')


def test_the_gateway_settings_name_engines_or_redis() -> None:
    urls = Settings(engines=" http://a:8100/, http://b:8101 ", _env_file=None)  # type: ignore[call-arg]
    assert urls.engine_urls == ("http://a:8100", "http://b:8101") and urls.gateway
    discovered = Settings(engines="redis", redis_url="redis://x:6379/0", _env_file=None)  # type: ignore[call-arg]
    assert discovered.engine_urls == () and discovered.gateway
    assert not Settings(_env_file=None).gateway  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="set redis_url"):
        Settings(engines="redis", _env_file=None)  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="not an http"):
        Settings(engines="a:8100", _env_file=None)  # type: ignore[call-arg]


def test_gpus_and_the_engines_environment(tmp_path: Path) -> None:
    assert parse_gpus("0,1, 3") == [0, 1, 3]
    for bad in ("", "0,0", "-1", "x"):
        with pytest.raises(ValueError):
            parse_gpus(bad)
    with_redis = Settings(model="m", data_dir=tmp_path, redis_url="redis://r:6379/0", _env_file=None)  # type: ignore[call-arg]
    env = engine_environment(with_redis, 1, 8101)
    assert (env["CUDA_VISIBLE_DEVICES"], env["KVSTITCH_DATA_DIR"]) == ("1", str(tmp_path))
    assert env["KVSTITCH_ENGINE_ID"].endswith("-8101-gpu1") and ENGINE_ID.fullmatch(env["KVSTITCH_ENGINE_ID"])
    alone = engine_environment(Settings(model="m", data_dir=tmp_path, _env_file=None), 2, 8102)  # type: ignore[call-arg]
    assert alone["KVSTITCH_DATA_DIR"] == str(tmp_path / "engine-gpu2") and "KVSTITCH_ENGINE_ID" not in alone


def test_engine_ids_and_urls() -> None:
    assert ENGINE_ID.fullmatch(default_engine_id(8100)) and default_engine_id(8100).endswith("-8100")
    plain = Settings(_env_file=None)  # type: ignore[call-arg]
    assert engine_url(plain, "0.0.0.0", 8100) == "http://127.0.0.1:8100"
    assert engine_url(plain, "10.0.0.5", 8101) == "http://10.0.0.5:8101"
    given = Settings(engine_url="http://node-a:8100/", _env_file=None)  # type: ignore[call-arg]
    assert engine_url(given, "0.0.0.0", 8100) == "http://node-a:8100"


def test_stopping_engines_terminates_and_waits() -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    began = time.monotonic()

    stop_engines([("http://127.0.0.1:1", sleeper)])

    assert sleeper.returncode is not None and time.monotonic() - began < 10


def test_a_fleet_with_no_engine_refuses_and_is_not_ready() -> None:
    space = KeySpace("fp", "tpl", "float32")
    fleet = Fleet(Settings(engines="http://127.0.0.1:1", _env_file=None), space)  # type: ignore[call-arg]
    try:
        fleet.probe()  # nothing listens on port 1: unreachable
        with pytest.raises(NoEngineError, match=re.escape("127.0.0.1:1: unreachable")):
            fleet.choose([ChunkRef("k", 10)])
        assert fleet.readiness() == (False, "http://127.0.0.1:1: unreachable")
        assert fleet.figures()["http://127.0.0.1:1"].routable is False
        done: list[list[int]] = []
        fleet.place_kv([], [], lambda batch: done.append(list(batch)))  # nothing missing: nothing sent
        assert (done, fleet.unplaced) == ([], 0)
        fleet.place_kv(["k1", "k2"], [(1, 2), (3,)], lambda batch: done.append(list(batch)))
        assert (done, fleet.unplaced) == ([[0, 1]], 2)  # no engine to take them: counted, ingestion goes on
    finally:
        fleet.close()


@pytest.mark.parametrize(
    ("setting", "mode"), [("chunk-aware", RoutingMode.CHUNK_AWARE), ("round-robin", RoutingMode.ROUND_ROBIN)]
)
def test_the_routing_setting_reaches_the_fleets_policy(setting: str, mode: RoutingMode) -> None:
    settings = Settings(engines="http://127.0.0.1:1", fleet_routing=setting, _env_file=None)  # type: ignore[call-arg]
    fleet = Fleet(settings, KeySpace("fp", "tpl", "float32"))
    try:
        assert fleet.policy.mode is mode
    finally:
        fleet.close()
    assert Settings(_env_file=None).fleet_routing == "chunk-aware"  # type: ignore[call-arg]
    with pytest.raises(ValidationError):
        Settings(fleet_routing="random", _env_file=None)  # type: ignore[call-arg]


def test_ingestion_batches_cut_by_tokens_in_order() -> None:
    assert token_batches([4, 7, 9, 2], [10, 10, 25, 5], 20) == [[4, 7], [9], [2]]
    assert token_batches([], [], 20) == []


def test_an_engine_serves_through_uvloop_and_httptools_where_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both are dependencies (the engine's event loop shares the GIL with its engine thread); without them, as on a
    platform uvloop does not build for, the engine falls back to asyncio and h11 rather than failing to start."""
    import importlib.util

    from service.api import engine_app

    assert engine_app.engine_server_options() == ("uvloop", "httptools")
    real = importlib.util.find_spec
    missing = ("uvloop", "httptools")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name in missing else real(name))
    assert engine_app.engine_server_options() == ("asyncio", "h11")
