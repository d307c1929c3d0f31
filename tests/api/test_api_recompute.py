"""Recompute over HTTP: `recompute` on /ask and in the OpenAI extra body, the KVSTITCH_RECOMPUTE default, and what
the `done` event reports (the spec applied, `recomputed_tokens`, `timings_ms.recompute`)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest
from api_support import QUESTION, ingest
from app_server import MakeApp, server_of, wait_ready
from fastapi.testclient import TestClient

from service.engine.engine import StitchEngine
from service.engine.kv_layout import ChunkContext
from service.kvcache.keys import model_fingerprint
from service.serving.runtime import open_engine
from service.settings import Settings


def _ask(client: TestClient, **body: Any) -> dict[str, Any]:
    reply = client.post("/ask", json={"question": QUESTION, "stream": False, "top_k": 3, **body})
    assert reply.status_code == 200, reply.text
    answer: dict[str, Any] = reply.json()
    return answer


def _chunk_tokens(answer: dict[str, Any], get_engine: Callable[[str, str], StitchEngine]) -> int:
    """Tokens of the answer's chunk blocks (wrappers included): the context less the template prefix."""
    return int(answer["context_tokens"]) - len(get_engine("qwen2", "cpu").template.prefix)


def test_recomputing_every_chunk_token_answers_as_naive(
    client: TestClient, get_engine: Callable[[str, str], StitchEngine]
) -> None:
    ingest(client)

    naive = _ask(client, mode="naive", max_new_tokens=16, recompute="selective:1")
    full = _ask(client, max_new_tokens=16, recompute="selective:1")
    turbo = _ask(client, max_new_tokens=16)

    assert full["answer"] == naive["answer"] and full["output_tokens"] == naive["output_tokens"]
    assert full["recompute"] == "selective:1" and full["recomputed_tokens"] == _chunk_tokens(full, get_engine) > 0
    assert full["timings_ms"]["recompute"] > 0
    # Naive computes every token anyway: it carries no recompute; plain turbo recomputes nothing.
    assert (naive["recompute"], naive["recomputed_tokens"], naive["timings_ms"]["recompute"]) == ("none", 0, 0)
    assert (turbo["recompute"], turbo["recomputed_tokens"], turbo["timings_ms"]["recompute"]) == ("none", 0, 0)


@pytest.mark.parametrize("spec", ["selective:2", "all", "prefix:-1", "none:3"])
def test_a_bad_spec_is_a_422_naming_recompute(client: TestClient, spec: str) -> None:
    reply = client.post("/ask", json={"question": QUESTION, "recompute": spec})

    assert reply.status_code == 422
    error = reply.json()["detail"][0]
    assert error["loc"] == ["body", "recompute"] and spec in error["msg"]


def test_the_setting_is_the_default_and_a_request_overrides_it(
    make_app: MakeApp, get_engine: Callable[[str, str], StitchEngine]
) -> None:
    app = make_app(recompute="prefix:4")
    with TestClient(app) as client:
        wait_ready(app)
        ingest(client)

        default = _ask(client, max_new_tokens=4)
        overridden = _ask(client, max_new_tokens=4, recompute="none")

    assert default["recompute"] == "prefix:4" and default["recomputed_tokens"] == 4 * len(default["chunks"])
    assert (overridden["recompute"], overridden["recomputed_tokens"]) == ("none", 0)


def test_the_openai_extra_body_carries_recompute(
    client: TestClient, get_engine: Callable[[str, str], StitchEngine]
) -> None:
    ingest(client)
    oai = openai.OpenAI(base_url=f"{client.base_url}/v1", api_key="unused", http_client=client, max_retries=0)
    messages: Any = [{"role": "user", "content": QUESTION}]

    completion = oai.chat.completions.create(
        model="qwen2", messages=messages, max_tokens=8, temperature=0, extra_body={"recompute": "selective:1"}
    )

    extra = completion.model_extra["kvstitch"] if completion.model_extra else {}
    assert extra["recompute"] == "selective:1" and extra["recomputed_tokens"] == _chunk_tokens(extra, get_engine)
    with pytest.raises(openai.BadRequestError) as refused:
        oai.chat.completions.create(model="qwen2", messages=messages, extra_body={"recompute": "selective:9"})
    assert refused.value.body["param"] == "recompute"  # type: ignore[index]


def _metric(text: str, line_start: str) -> float:
    lines = [line for line in text.splitlines() if line.startswith(line_start)]
    assert len(lines) == 1, (line_start, lines)
    return float(lines[0].rsplit(" ", 1)[1])


def test_composite_positions_refuse_a_recompute_and_skip_the_default(make_app: MakeApp) -> None:
    app = make_app(recompute="prefix:4")
    with TestClient(app) as client:
        wait_ready(app)
        ingest(client)
        reply = client.post("/ask", json={"question": QUESTION, "positions": "composite", "recompute": "query:0.5"})
        composite = _ask(client, positions="composite", max_new_tokens=4)

    assert reply.status_code == 422
    error = reply.json()["detail"][0]
    assert error["loc"] == ["body", "recompute"] and "composite positions cannot be recomputed" in error["msg"]
    assert (composite["recompute"], composite["recomputed_tokens"]) == ("none", 0)


def test_done_and_metrics_report_the_share_recomputed_and_the_trigger_rate(
    client: TestClient, get_engine: Callable[[str, str], StitchEngine]
) -> None:
    ingest(client)
    query = _ask(client, max_new_tokens=4, recompute="query:0.5")
    never = _ask(client, max_new_tokens=4, recompute="auto:1")  # no estimate reaches 1: nothing recomputed
    always = _ask(client, max_new_tokens=4, recompute="auto:0.000001")

    chunk_tokens = _chunk_tokens(query, get_engine)
    assert query["recomputed_tokens"] == int(0.5 * chunk_tokens + 0.5)
    assert query["recomputed_share"] == pytest.approx(query["recomputed_tokens"] / chunk_tokens, abs=1e-4)
    assert (never["recompute"], never["recomputed_tokens"], never["recomputed_share"]) == ("auto:1", 0, 0.0)
    assert always["recompute"] == "auto:1e-06" and 0 < always["recomputed_share"] <= 0.3
    metrics = client.get("/metrics").text
    assert _metric(metrics, 'kvstitch_recompute_requests_total{policy="auto"}') == 2
    assert _metric(metrics, 'kvstitch_recompute_triggered_total{policy="auto"}') == 1
    assert _metric(metrics, 'kvstitch_recompute_trigger_rate{policy="auto"}') == 0.5
    assert _metric(metrics, 'kvstitch_recompute_trigger_rate{policy="query"}') == 1.0
    recomputed = query["recomputed_tokens"] + always["recomputed_tokens"]
    assert _metric(metrics, "kvstitch_recomputed_tokens_total") == recomputed


def test_a_context_under_the_setting_is_recomputed_by_a_full_prefill(
    make_app: MakeApp, get_engine: Callable[[str, str], StitchEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The test apps share one engine (loading is the slow part): the setting's value is set on it as
    # `open_engine` sets it from KVSTITCH_RECOMPUTE_FULL_BELOW (tests/test_engine_chunk_context.py checks that).
    monkeypatch.setattr(get_engine("qwen2", "cpu"), "recompute_full_below", 1 << 20)
    app = make_app()
    with TestClient(app) as client:
        wait_ready(app)
        ingest(client)
        naive = _ask(client, mode="naive", max_new_tokens=8)
        full = _ask(client, max_new_tokens=8, recompute="selective:0.2")
        plain = _ask(client, max_new_tokens=8)

    assert full["answer"] == naive["answer"] and full["recomputed_share"] == 1.0
    assert full["timings_ms"]["recompute"] > 0 and full["timings_ms"]["stitch"] == 0
    assert (plain["recompute"], plain["recomputed_tokens"]) == ("none", 0)  # no recompute asked: plain turbo


def test_the_settings_reach_the_engine(tiny_model_dirs: dict[str, Path]) -> None:
    settings = Settings(
        model=str(tiny_model_dirs["llama"]), device="cpu", chunk_context="prefix", recompute_full_below=7
    )
    engine = open_engine(settings)
    assert (engine.chunk_context, engine.recompute_full_below) == (ChunkContext.PREFIX, 7)


def _measured_model(tmp_path: Path, source: Path, fingerprint: str, **changes: Any) -> Path:
    """A copy of the tiny model's folder with a measurement beside its weights."""
    from service.quality.measured import Candidate, MeasuredRecompute, write_measured

    model = tmp_path / "measured-model"
    shutil.copytree(source, model)
    rows = (Candidate("none", "alone", 0.1, 0.4), Candidate("prefix:4", "alone", 0.24, 0.96))
    fields: dict[str, Any] = {
        "recompute": "prefix:4",
        "chunk_context": "alone",
        "met": True,
        "keep": 0.85,
        "fingerprint": fingerprint,
        "dtype": "float32",
        "samples": 40,
        "naive_accuracy": 0.25,
        "data": "qa.jsonl",
        "candidates": rows,
    }
    write_measured(model, MeasuredRecompute(**{**fields, **changes}))
    return model


def _default_answer(make_app: MakeApp, model: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """A turbo answer naming no recompute from a server of `model`, and what /readyz says of the default."""
    app = make_app(model=str(model))
    with TestClient(app) as client:
        wait_ready(app)
        ingest(client)
        answer = _ask(client, max_new_tokens=4)
        ready: dict[str, Any] = client.get("/readyz").json()["recompute_default"]
    return answer, ready


def test_the_default_serves_the_models_measured_recompute_and_readyz_says_why(
    make_app: MakeApp,
    tmp_path: Path,
    tiny_model_dirs: dict[str, Path],
    get_engine: Callable[[str, str], StitchEngine],
) -> None:
    fingerprint = model_fingerprint(get_engine("qwen2", "cpu").model)

    answer, ready = _default_answer(make_app, _measured_model(tmp_path, tiny_model_dirs["qwen2"], fingerprint))

    assert answer["recompute"] == "prefix:4" and answer["recomputed_tokens"] == 4 * len(answer["chunks"])
    assert ready["spec"] == "prefix:4" and "kept 96% of naive's accuracy on 40 samples" in ready["source"]


def test_a_measurement_of_other_weights_is_not_applied_and_readyz_says_so(
    make_app: MakeApp, tmp_path: Path, tiny_model_dirs: dict[str, Path]
) -> None:
    answer, ready = _default_answer(make_app, _measured_model(tmp_path, tiny_model_dirs["qwen2"], "0" * 64))

    assert (answer["recompute"], answer["recomputed_tokens"]) == ("none", 0)
    assert ready["spec"] == "none" and "not applied" in ready["source"]


def test_a_corrupt_measurement_stops_start_up_naming_the_file(
    make_app: MakeApp, tmp_path: Path, tiny_model_dirs: dict[str, Path]
) -> None:
    from service.quality.measured import MEASURED_FILE

    model = _measured_model(tmp_path, tiny_model_dirs["qwen2"], "0" * 64)
    (model / MEASURED_FILE).write_text('{"format": "kvstitch-measured-recompute/1"', encoding="utf-8")
    app = make_app(model=str(model))
    with TestClient(app) as client:
        server = server_of(app)
        assert server.started.wait(120)
        ready = client.get("/readyz")

    assert not server.ready and ready.status_code == 503
    startup = ready.json()["checks"]["startup"]
    assert f"{model / MEASURED_FILE}: not JSON" in startup
