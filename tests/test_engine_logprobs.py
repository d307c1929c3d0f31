"""Log-probabilities from the batched decode: the model's own, per token, only for the requests that ask."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from test_engine_batch import Case, drain, nan_pool, steps

from service.engine.batch_request import BatchRequest
from service.engine.engine import StitchEngine
from service.engine.reference import prompt_reference_logits
from service.engine.sampling import SamplingParams, logprobs_rows
from service.engine.scheduler import Scheduler


def test_rows_give_the_picked_token_and_the_likeliest() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 0.0]])

    rows = logprobs_rows(logits, [2, 0], [2, 0])

    expected = torch.log_softmax(logits, dim=-1)
    assert rows[0].token == 2 and abs(rows[0].logprob - float(expected[0, 2])) < 1e-6
    assert [t for t, _ in rows[0].top] == [1, 2]
    assert abs(rows[0].top[0][1] - float(expected[0, 1])) < 1e-6
    assert rows[1].top == () and abs(rows[1].logprob - float(expected[1, 0])) < 1e-6


@pytest.mark.parametrize("overlap", [False, True])
def test_batched_logprobs_equal_the_reference_and_only_where_asked(
    get_engine: Callable[..., StitchEngine], overlap: bool
) -> None:
    """`plain` decodes for two steps first; overlapped, the others join a step in flight, which is read before the
    next step launches (log-probabilities come from a step's logits)."""
    engine = get_engine("qwen2", "cpu")
    case = Case((21, 8), max_new=10, seed=3)
    prompt = case.prompt(engine)
    asked = BatchRequest(prompt, SamplingParams(max_new_tokens=10, ignore_eos=True, logprobs=3))
    plain = BatchRequest(prompt, SamplingParams(max_new_tokens=10, ignore_eos=True))
    beside = BatchRequest(Case((33,), max_new=6, seed=4).prompt(engine), SamplingParams(max_new_tokens=6, logprobs=0))
    scheduler = Scheduler(engine, nan_pool(engine, 800), overlap=overlap)
    scheduler.add(plain)
    steps(scheduler, 2)
    for request in (asked, beside):
        scheduler.add(request)
    drain(scheduler)

    tokens = asked.result.token_ids
    assert tokens == plain.result.token_ids and plain.result.logprobs == []
    assert [e.token for e in asked.result.logprobs] == tokens
    reference = prompt_reference_logits(engine.model, prompt, "reordered", tokens)
    rows = torch.log_softmax(reference[len(prompt.joined()) - 1 : -1], dim=-1)
    for entry, row in zip(asked.result.logprobs, rows, strict=True):
        assert abs(entry.logprob - float(row[entry.token])) < 1e-4
        assert [t for t, _ in entry.top] == torch.topk(row, 3).indices.tolist()
        assert entry.top[0][0] == entry.token  # greedy: the picked token is the likeliest
    assert all(e.top == () for e in beside.result.logprobs)
    assert len(beside.result.logprobs) == len(beside.result.token_ids) - (beside.result.finish_reason == "stop")
