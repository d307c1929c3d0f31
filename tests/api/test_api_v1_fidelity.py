"""/v1 as an OpenAI or vLLM client sees it, over a real uvicorn server and the official `openai` client: unknown
fields and bad values are a 400 in OpenAI's words, broken JSON a 400 without offsets, `model` may be left out,
`X-Request-Id` is echoed and logged (and carried in /ask's answer), `/health` answers, and a logprob's bytes are the
token's own."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from api_support import QUESTION, ingest, sse
from app_server import LiveServer, MakeApp
from transformers import AutoTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

API_KEY = "v1-key"
AUTH = {"authorization": f"Bearer {API_KEY}"}
MESSAGES: list[Any] = [{"role": "user", "content": QUESTION}]
CHAT = {"model": "qwen2", "messages": MESSAGES, "max_tokens": 6, "temperature": 0}
GENERATED_ID = re.compile(r"[0-9a-f]{32}")


@pytest.fixture(scope="module")
def server(make_module_app: MakeApp) -> Iterator[LiveServer]:
    with LiveServer(make_module_app(api_key=API_KEY)) as live:
        with httpx.Client(base_url=live.url, headers=AUTH, timeout=60) as client:
            ingest(client)
        yield live


@pytest.fixture(scope="module")
def oai(server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0) as client:
        yield client


def post_chat(server: LiveServer, body: Any = None, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, headers={**AUTH, **(headers or {})}, timeout=60)


# ---- refused bodies ------------------------------------------------------------------------------------------------


def test_an_unknown_field_is_a_400_in_openais_words(oai: openai.OpenAI, server: LiveServer) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        oai.chat.completions.create(**CHAT, extra_body={"topk": 1})
    two = post_chat(server, {**CHAT, "topk": 1, "best_of": 2})

    assert refused.value.status_code == 400
    assert refused.value.body == {  # what OpenAI answers
        "message": "Unrecognized request argument supplied: topk",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }
    assert two.status_code == 400
    assert two.json()["error"]["message"] == "Unrecognized request arguments supplied: topk, best_of"


def test_openai_fields_that_leave_the_answer_alone_are_taken(oai: openai.OpenAI) -> None:
    plain = oai.chat.completions.create(**CHAT)

    tagged = oai.chat.completions.create(
        **CHAT, user="u-1", metadata={"team": "a"}, store=False, frequency_penalty=0, presence_penalty=0
    )

    assert tagged.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize(
    ("option", "value"),
    [("frequency_penalty", 0.5), ("presence_penalty", -1.0), ("logit_bias", {"42": 5}), ("modalities", ["audio"])],
)
def test_an_openai_option_that_would_change_the_answer_is_a_400_naming_it(
    oai: openai.OpenAI, option: str, value: Any
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        oai.chat.completions.create(**CHAT, **{option: value})

    assert refused.value.param == option and refused.value.code == "unsupported_parameter"


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"temperature": 9}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 5000}, "max_tokens"),  # beyond KVSTITCH_MAX_NEW_TOKENS_LIMIT: the service's bound
        ({"top_logprobs": 99, "logprobs": True}, "top_logprobs"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages"),
    ],
)
def test_a_bad_value_is_a_400_with_openais_param(oai: openai.OpenAI, change: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        oai.chat.completions.create(**{**CHAT, **change})

    assert refused.value.status_code == 400 and refused.value.param == param
    assert refused.value.body["type"] == "invalid_request_error"  # type: ignore[index]
    assert refused.value.code == "invalid_value"


@pytest.mark.parametrize("content", [b'{"model": "qwen2", "messages": [', b"{'model': 'qwen2'}", b"\xff\xfe"])
def test_broken_json_is_a_400_without_offsets(server: LiveServer, content: bytes) -> None:
    reply = httpx.post(
        f"{server.url}/v1/chat/completions", content=content, headers={**AUTH, "content-type": "application/json"}
    )

    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] is None
    assert "JSON" in error["message"] and not re.search(r"\d", error["message"])  # no line, column or offset


def test_ask_keeps_fastapis_422_for_the_same_mistakes(server: LiveServer) -> None:
    unknown = httpx.post(f"{server.url}/ask", json={"question": QUESTION, "topk": 1}, headers=AUTH)
    json_type = {**AUTH, "content-type": "application/json"}
    broken = httpx.post(f"{server.url}/ask", content=b'{"question":', headers=json_type)

    assert unknown.status_code == 422 and unknown.json()["detail"][0]["type"] == "extra_forbidden"
    assert broken.status_code == 422 and broken.json()["detail"][0]["type"] == "json_invalid"


def test_a_request_without_a_model_is_answered_by_the_served_one(server: LiveServer) -> None:
    named = post_chat(server, CHAT)
    unnamed = post_chat(server, {k: v for k, v in CHAT.items() if k != "model"})
    null = post_chat(server, {**CHAT, "model": None})

    assert unnamed.status_code == 200, unnamed.text
    assert unnamed.json()["model"] == null.json()["model"] == "qwen2"
    assert unnamed.json()["choices"][0]["message"] == named.json()["choices"][0]["message"]


# ---- request ids, /health ------------------------------------------------------------------------------------------


def test_the_request_id_is_echoed_and_names_the_completion(oai: openai.OpenAI) -> None:
    raw = oai.chat.completions.with_raw_response.create(**CHAT, extra_headers={"X-Request-Id": "trace-42.a:b_c"})

    assert raw.headers["x-request-id"] == "trace-42.a:b_c"
    assert raw.parse().id == "chatcmpl-trace-42.a:b_c"  # as vLLM names it


@pytest.mark.parametrize(
    ("path", "headers"),
    [("/v1/chat/completions", AUTH), ("/v1/chat/completions", {}), ("/healthz", {}), ("/nowhere", AUTH)],
)
def test_every_answer_carries_a_request_id(server: LiveServer, path: str, headers: dict[str, str]) -> None:
    sent = httpx.post(f"{server.url}{path}", json=CHAT, headers={**headers, "x-request-id": "abc-1"}, timeout=60)
    generated = httpx.post(f"{server.url}{path}", json=CHAT, headers=headers, timeout=60)

    assert sent.headers["x-request-id"] == "abc-1", sent.status_code
    assert GENERATED_ID.fullmatch(generated.headers["x-request-id"]), generated.status_code
    assert len(sent.headers.get_list("x-request-id")) == 1


@pytest.mark.parametrize("bad", [b"x" * 129, b"two words", b"semi;colon", b"", "ünï".encode()])
def test_an_invalid_request_id_is_replaced_by_a_generated_one(server: LiveServer, bad: bytes) -> None:
    reply = httpx.get(f"{server.url}/healthz", headers={"x-request-id": bad})

    assert GENERATED_ID.fullmatch(reply.headers["x-request-id"]), reply.headers["x-request-id"]


def test_the_longest_valid_request_id_is_kept(server: LiveServer) -> None:
    longest = "a" * 128

    assert httpx.get(f"{server.url}/healthz", headers={"x-request-id": longest}).headers["x-request-id"] == longest


def test_the_request_log_line_carries_the_id(server: LiveServer, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="kvstitch.requests"):
        reply = post_chat(server, CHAT, headers={"x-request-id": "log-me-7"})
        refused = post_chat(server, {**CHAT, "topk": 1})

        theirs = refused.headers["x-request-id"]
        # The line is written once the app has returned, after the client has the whole response: wait for it.
        lines = _request_lines(caplog, lambda text: f"request_id={theirs}" in text)

    mine = [line for line in lines if "request_id=log-me-7" in line]
    assert reply.status_code == 200 and len(mine) == 1
    assert '"POST /v1/chat/completions" 200' in mine[0]
    assert any(f"request_id={theirs}" in line and '" 400 ' in line for line in lines)


def _request_lines(caplog: pytest.LogCaptureFixture, until: Callable[[str], bool], wait_s: float = 5.0) -> list[str]:
    """The request log's lines, once one satisfies `until` (or `wait_s` has passed)."""
    deadline = time.monotonic() + wait_s
    while True:
        lines = [r.getMessage() for r in caplog.records if r.name == "kvstitch.requests"]
        if any(until(line) for line in lines) or time.monotonic() > deadline:
            return lines
        time.sleep(0.02)


def test_ask_carries_the_request_id_streamed_or_not(server: LiveServer) -> None:
    body = {"question": QUESTION, "max_new_tokens": 4}
    plain = httpx.post(
        f"{server.url}/ask", json={**body, "stream": False}, headers={**AUTH, "x-request-id": "ask-1"}, timeout=60
    )
    with httpx.stream("POST", f"{server.url}/ask", json=body, headers=AUTH, timeout=60) as streamed:
        generated = streamed.headers["x-request-id"]
        events = list(sse(streamed.iter_lines()))

    assert plain.status_code == 200 and plain.json()["request_id"] == "ask-1"
    done = [data for event, data in events if event == "done"]
    assert len(done) == 1 and done[0]["request_id"] == generated and GENERATED_ID.fullmatch(generated)


def test_health_answers_as_healthz_without_the_key(server: LiveServer) -> None:
    health = httpx.get(f"{server.url}/health")
    healthz = httpx.get(f"{server.url}/healthz")

    assert (health.status_code, health.json()) == (healthz.status_code, healthz.json()) == (200, {"status": "ok"})


# ---- logprob bytes -------------------------------------------------------------------------------------------------


def vocabulary_bytes(model_dir: Path) -> set[bytes]:
    """Every token's bytes, read from the byte-level vocabulary with transformers' own byte table."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return {bytes(byte_of[c] for c in piece) for piece in pieces if all(c in byte_of for c in piece)}


def test_a_logprob_reports_the_tokens_own_bytes(oai: openai.OpenAI, tiny_model_dirs: dict[str, Path]) -> None:
    vocabulary = vocabulary_bytes(tiny_model_dirs["qwen2"])
    replacement = list("\ufffd".encode())

    completion = oai.chat.completions.create(
        **{**CHAT, "max_tokens": 32, "temperature": 1.5, "seed": 7}, logprobs=True, top_logprobs=5
    )

    special = set(AutoTokenizer.from_pretrained(tiny_model_dirs["qwen2"]).all_special_tokens)
    content = completion.choices[0].logprobs.content
    entries = [*content, *(alt for e in content for alt in e.top_logprobs)]
    partial = [e for e in entries if e.token == "\ufffd"]
    assert partial, "no token holding part of a character: the test would not test anything"
    assert all(e.bytes != replacement and bytes(e.bytes) in vocabulary for e in partial)
    assert all(bytes(e.bytes) == e.token.encode() for e in entries if "\ufffd" not in e.token)
    # The client's rebuild: the chosen tokens' bytes joined are the answer (which leaves out special tokens, and a
    # character cut off at the end).
    joined = b"".join(bytes(e.bytes) for e in content if e.token not in special).decode("utf-8", errors="replace")
    answer = completion.choices[0].message.content
    assert joined.startswith(answer) and set(joined[len(answer) :]) <= {"\ufffd"}, (joined, answer)
