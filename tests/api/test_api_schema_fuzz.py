"""Schemathesis against /openapi.json on a live server: generated valid and invalid requests to every operation,
and no answer may be a 5xx or disagree with the document (status code, content type, response body).

Bounded so it runs in the default suite: EXAMPLES cases per operation and mode (about 400 requests), answers of
at most a few tokens: well under a minute on 2 CPU cores. KVSTITCH_FUZZ_EXAMPLES=500 makes a longer, randomized run.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from app_server import LiveServer, MakeApp
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import positive_data_acceptance
from schemathesis.generation.modes import GenerationMode

# The default run is the same every time (derandomized, ~400 requests); a longer one explores new inputs.
EXAMPLES = int(os.environ.get("KVSTITCH_FUZZ_EXAMPLES", "30"))
DERANDOMIZE = "KVSTITCH_FUZZ_EXAMPLES" not in os.environ
# Every operation, and whether it takes inputs (only those have invalid requests to generate).
OPERATIONS = {
    "GET /healthz": False,
    "GET /health": False,
    "GET /readyz": False,
    "GET /metrics": False,
    "POST /ingest": True,
    "POST /ingest/files": True,
    "GET /ingest/{job_id}": True,
    "DELETE /ingest/{job_id}": True,
    "GET /documents": True,
    "GET /documents/{doc_id}": True,
    "DELETE /documents/{doc_id}": True,
    "POST /ask": True,
    "POST /retrieve": True,
    "GET /v1/models": False,
    "POST /v1/chat/completions": True,
}
CASES = [
    pytest.param(label, mode, id=f"{label}-{mode}")
    for label, has_inputs in OPERATIONS.items()
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    if has_inputs or mode is GenerationMode.POSITIVE
]
# Some schema-valid requests are refused by design (422, a 400 under /v1): bounds that come from settings (question
# length, max_new_tokens) and rules across fields (a chat needs a user message). Every other check applies.
EXCLUDED_CHECKS = [positive_data_acceptance]


@pytest.fixture(scope="module")
def fuzzed_server(make_module_app: MakeApp) -> Iterator[LiveServer]:
    app = make_module_app(max_new_tokens_limit=4, default_max_new_tokens=2, max_request_mb=1)
    with LiveServer(app) as server:
        yield server


@pytest.fixture(scope="module")
def api_schema(fuzzed_server: LiveServer) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(f"{fuzzed_server.url}/openapi.json")


def test_the_document_declares_streams_text_and_every_error_status(fuzzed_server: LiveServer) -> None:
    paths = httpx.get(f"{fuzzed_server.url}/openapi.json").json()["paths"]

    def statuses(path: str, method: str) -> set[str]:
        return set(paths[path][method]["responses"])

    for path in ("/ask", "/v1/chat/completions"):
        assert set(paths[path]["post"]["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert statuses("/ask", "post") == statuses("/retrieve", "post") == {"200", "400", "401", "413", "422", "503"}
    assert statuses("/v1/chat/completions", "post") == {"200", "400", "401", "404", "413", "503"}  # 404: model
    assert statuses("/ingest", "post") == {"202", "400", "401", "413", "422", "503"}
    assert (
        statuses("/ingest/{job_id}", "get")
        == statuses("/documents/{doc_id}", "get")
        == {"200", "401", "404", "422", "503"}
    )
    assert statuses("/documents/{doc_id}", "delete") == {"202", "401", "404", "422", "503"}
    assert statuses("/documents", "get") == {"200", "401", "422", "503"}
    assert statuses("/readyz", "get") == {"200", "503"}
    assert set(paths["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    error = paths["/v1/chat/completions"]["post"]["responses"]["400"]["content"]["application/json"]["schema"]
    assert error == {"$ref": "#/components/schemas/OpenAIErrorOut"}


def test_every_operation_in_the_document_is_fuzzed(api_schema: schemathesis.BaseSchema) -> None:
    documented = [result.ok().label for result in api_schema.get_all_operations()]

    assert sorted(documented) == sorted(OPERATIONS)


@pytest.mark.slow
@pytest.mark.parametrize(("label", "mode"), CASES)
def test_no_request_gets_a_server_error_or_an_undocumented_answer(
    api_schema: schemathesis.BaseSchema, label: str, mode: GenerationMode
) -> None:
    method, path = label.split(" ", 1)
    operation = api_schema[path][method]
    calls: list[int] = []

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
        derandomize=DERANDOMIZE,
    )
    def fuzz(case: schemathesis.Case) -> None:
        calls.append(case.call_and_validate(timeout=30, excluded_checks=EXCLUDED_CHECKS).status_code)

    began = time.perf_counter()
    fuzz()

    print(f"{label} {mode}: {len(calls)} calls in {time.perf_counter() - began:.1f} s, statuses {sorted(set(calls))}")
    assert calls and all(status < 500 for status in calls)
