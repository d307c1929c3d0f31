"""The HTTP boundary's one check of a question against the deployment's limits, into a typed `AnswerRequest`."""

from __future__ import annotations

from typing import Any

import pytest

from service.api.validation import Sampling, answer_request
from service.facade.errors import InvalidRequestError
from service.facade.types import AnswerLimits, ChatMessage, RecomputeSpec

LIMITS = AnswerLimits(
    max_question_chars=20,
    max_top_k=8,
    max_new_tokens=64,
    default_max_new_tokens=16,
    max_history_messages=2,
    max_history_chars=30,
)


def request(question: str = "Why?", history: tuple[ChatMessage, ...] = (), **change: Any) -> Any:
    sampling = Sampling(change.pop("max_new_tokens", None), 0.0, 1.0, None, ("\n",), 2)
    options = {"top_k": 5, "mode": "turbo", "positions": "reordered", "recompute": None, **change}
    return answer_request(LIMITS, question, history, sampling, **options)


def test_a_request_within_the_limits_is_typed_with_the_defaults_applied() -> None:
    typed = request(recompute="prefix:4")

    assert (typed.question, typed.max_new_tokens, typed.stop, typed.logprobs) == ("Why?", 16, ("\n",), 2)
    assert str(typed.recompute) == "prefix:4" and isinstance(typed.recompute, RecomputeSpec)
    assert request().recompute is None  # the deployment's default applies later


@pytest.mark.parametrize(
    ("question", "history", "change", "field", "message"),
    [
        ("x" * 21, (), {}, "question", "at most 20 characters (got 21)"),
        (" \n ", (), {}, "question", "must not be blank"),
        ("Why?", (), {"top_k": 9}, "top_k", "at most 8"),
        ("Why?", (), {"max_new_tokens": 65}, "max_new_tokens", "at most 64 (got 65)"),
        ("Why?", (ChatMessage("user", "a"),) * 3, {}, "history", "at most 2 earlier messages (got 3)"),
        ("Why?", (ChatMessage("user", "a" * 31),), {}, "history", "at most 30 characters in all (got 31)"),
        ("Why?", (), {"recompute": "selective:2"}, "recompute", "selective:R needs R"),
    ],
)
def test_a_bound_passed_names_its_field(
    question: str, history: tuple[ChatMessage, ...], change: dict[str, Any], field: str, message: str
) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        request(question, history, **change)

    assert refused.value.field == field and message in refused.value.message
