"""Shadow answers in the served app (`KVSTITCH_SHADOW_SHARE`): every turbo answer shadowed at share 1, none at 0;
the agreement and KL metrics and `/readyz`'s figures after real questions over HTTP."""

from __future__ import annotations

import time
from typing import Any

from api_support import QUESTION, ingest
from app_server import MakeApp, wait_ready
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

SHADOW_WAIT_S = 60


def ask(client: TestClient, **body: Any) -> dict[str, Any]:
    reply = client.post("/ask", json={"question": QUESTION, "stream": False, "top_k": 3, "max_new_tokens": 6, **body})
    assert reply.status_code == 200, reply.text
    answer: dict[str, Any] = reply.json()
    return answer


def shadow_figures(client: TestClient, compared: int) -> dict[str, Any]:
    """/readyz's shadow figures once `compared` shadows were compared (they run after their answers)."""
    deadline = time.monotonic() + SHADOW_WAIT_S
    while True:
        reply = client.get("/readyz")
        assert reply.status_code == 200, reply.text
        figures: dict[str, Any] = reply.json()["shadow"]
        if figures["answers"]["compared"] >= compared or time.monotonic() > deadline:
            return figures
        time.sleep(0.05)


def scrape(client: TestClient, name: str) -> dict[frozenset[tuple[str, str]], float]:
    return {
        frozenset(s.labels.items()): s.value
        for family in text_string_to_metric_families(client.get("/metrics").text)
        for s in family.samples
        if s.name == name
    }


def labels(**pairs: str) -> frozenset[tuple[str, str]]:
    return frozenset(pairs.items())


def test_at_share_1_every_turbo_answer_is_shadowed_and_compared(make_app: MakeApp) -> None:
    app = make_app(shadow_share=1.0)
    with TestClient(app) as client:
        wait_ready(app)
        ingest(client)
        ask(client, recompute="selective:1")  # answers as naive by construction
        ask(client, recompute="selective:1", temperature=0.8, seed=5)
        ask(client, positions="composite")
        ask(client, mode="naive")  # not shadowed: it is the reference already

        figures = shadow_figures(client, compared=3)
        agreement = scrape(client, "kvstitch_shadow_agreement_total")
        kl_count = scrape(client, "kvstitch_shadow_kl_count")
        kl_sum = scrape(client, "kvstitch_shadow_kl_sum")
        answers = scrape(client, "kvstitch_shadow_answers_total")

    selective = {"positions": "reordered", "recompute": "selective"}
    assert agreement[labels(**selective, kind="first_token", outcome="agreed")] == 2
    assert agreement[labels(**selective, kind="answer", outcome="agreed")] == 1  # the greedy one; a draw: no answer
    assert labels(**selective, kind="first_token", outcome="differed") not in agreement
    assert kl_count == {labels(**selective, kind="first_token"): 1}
    assert kl_sum[labels(**selective, kind="first_token")] < 1e-9
    composite = {"positions": "composite", "recompute": "none"}
    assert sum(v for k, v in agreement.items() if k >= labels(**composite, kind="answer")) == 1
    assert answers == {
        labels(outcome="compared"): 3,
        labels(outcome="dropped"): 0,
        labels(outcome="preempted"): 0,
        labels(outcome="failed"): 0,
    }
    assert figures["share"] == 1.0 and figures["pending"] == 0
    assert figures["answers"] == {"compared": 3, "dropped": 0, "preempted": 0, "failed": 0}
    first = figures["agreement"]["first_token"]
    assert first["compared"] == 3 and first["agreed"] == 2 + agreement.get(
        labels(**composite, kind="first_token", outcome="agreed"), 0
    )
    assert first["rate"] == first["agreed"] / 3
    assert figures["agreement"]["answer"]["compared"] == 2
    assert figures["kl"]["count"] == 1 and figures["kl"]["mean"] < 1e-9


def test_at_share_0_no_answer_is_shadowed(make_app: MakeApp) -> None:
    app = make_app(shadow_share=0.0)
    with TestClient(app) as client:
        wait_ready(app)
        ingest(client)
        ask(client)
        ask(client, temperature=0.8, seed=5)
        time.sleep(0.5)  # a shadow, were one queued, would have run by now on this idle engine

        figures = client.get("/readyz").json()["shadow"]
        agreement = scrape(client, "kvstitch_shadow_agreement_total")
        answers = scrape(client, "kvstitch_shadow_answers_total")

    assert figures["share"] == 0.0 and figures["pending"] == 0
    assert figures["answers"] == {"compared": 0, "dropped": 0, "preempted": 0, "failed": 0}
    assert figures["agreement"]["first_token"] == {"compared": 0, "agreed": 0, "rate": None}
    assert agreement == {} and set(answers.values()) == {0}
