"""`kvstitch eval` measures what the server serves: for the same question over the same corpus, eval's code (the
corpus form's cases, `run_variant`) and the running server's `/ask` build the same prompt and give the same greedy
tokens, in each mode, because both generate through the scheduler as `build_scheduler` configures it."""

from __future__ import annotations

from typing import Any

import pytest
from api_support import QUESTION, ingest, record_added
from app_server import MakeApp, server_of, wait_ready
from fastapi.testclient import TestClient

from service.engine.batch_request import BatchRequest
from service.engine.engine import GenerationMode
from service.engine.offline import OfflineScheduler
from service.engine.sampling import SamplingParams
from service.engine.stitch import PositionMode
from service.quality.corpus_eval import Corpus, Question, corpus_cases
from service.quality.eval import Outcome, Variant, run_variant

TOP_K = 2
MAX_NEW_TOKENS = 16


def _served(client: TestClient, added: list[BatchRequest], mode: str, positions: str) -> tuple[BatchRequest, str]:
    """The request the server's scheduler ran for one greedy `/ask`, and the answer the client got."""
    body = {"question": QUESTION, "stream": False, "top_k": TOP_K, "max_new_tokens": MAX_NEW_TOKENS}
    reply = client.post("/ask", json={**body, "mode": mode, "positions": positions})
    assert reply.status_code == 200, reply.text
    request = added.pop()
    assert not added and request.finished
    assert reply.json()["output_tokens"] == len(request.result.token_ids)
    answer: str = reply.json()["answer"]
    return request, answer


def _evaluated(app: Any, mode: GenerationMode, positions: PositionMode) -> tuple[Any, Outcome]:
    """Eval's case for the question (retrieved from the server's own collection, as `kvstitch eval --questions`
    retrieves) and its variant's greedy outcome, run on the server's engine loop (the engine's one owner)."""
    runtime = server_of(app).runtime
    assert runtime is not None
    engine, corpus = runtime.engine, Corpus(runtime.embedder, runtime.collection)
    sampling = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=0.0)
    variant = Variant(mode, positions if mode is GenerationMode.TURBO else None)

    def evaluate() -> tuple[Any, Outcome]:
        case = next(corpus_cases(engine, corpus, [Question(QUESTION, 1)], TOP_K, MAX_NEW_TOKENS, "questions.txt"))
        runner = OfflineScheduler(engine)
        try:
            return case, run_variant(runner, case, variant, sampling)
        finally:
            runner.close()

    return runtime.loop.call(evaluate)


def test_eval_and_the_server_give_the_same_greedy_tokens(make_app: MakeApp, monkeypatch: pytest.MonkeyPatch) -> None:
    app = make_app()
    with TestClient(app) as client:
        wait_ready(app)
        ingest(client)
        runtime = server_of(app).runtime
        assert runtime is not None and runtime.loop.scheduler is not None
        scheduler = runtime.loop.scheduler
        added = record_added(monkeypatch, scheduler)
        answers: dict[tuple[str, str], list[int]] = {}
        for mode, positions in (("turbo", "reordered"), ("turbo", "composite"), ("naive", "reordered")):
            served, answer = _served(client, added, mode, positions)
            case, outcome = _evaluated(app, GenerationMode(mode), PositionMode(positions))

            assert case.prompt == served.prompt, mode  # one prompt build: retrieval, fit, template
            assert list(outcome.token_ids) == served.result.token_ids, (mode, positions)
            assert outcome.text == answer
            answers[mode, positions] = served.result.token_ids
    # The comparison tells the paths apart: eval run in another mode or position plan than the server's would fail.
    assert len({tuple(tokens) for tokens in answers.values()}) == 3
