"""What counts as plain JSON at the service's edges, and how a refused value is echoed back."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from service.plain_json import MAX_DEPTH, escaped, json_problem, json_safe, lone_surrogate


def nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(depth):
        value = {"k": value}
    return value


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ({"tags": ["a", "b\ud800"]}, "m.tags[1] contains a lone surrogate (\\ud800) at position 1"),
        ({"\udc00": 1}, "m: key '\\\\udc00' contains a lone surrogate (\\udc00) at position 0"),
        ({"score": math.nan}, "m.score: nan is not a finite number"),
        ({"a": [{"b": -math.inf}]}, "m.a[0].b: -inf is not a finite number"),
        ({1: "x"}, "m: keys must be strings, got int"),
        ({"when": {1, 2}}, "m.when: set is not a JSON value"),
        (nested(MAX_DEPTH + 1), "m" + ".k" * MAX_DEPTH + f": nested deeper than {MAX_DEPTH} levels"),
    ],
)
def test_json_problem_names_the_path_of_the_first_problem(value: Any, problem: str) -> None:
    found = json_problem(value, "m")

    assert found is not None and found.startswith(problem)


def test_plain_json_up_to_the_depth_limit_passes() -> None:
    value = {"n": 1, "f": 0.5, "t": True, "none": None, "s": "é 😀", "list": [1, "two"]}

    assert json_problem(value, "m") is None
    assert json_problem(nested(MAX_DEPTH - 1), "m") is None  # MAX_DEPTH objects, one in another
    assert json_problem(nested(MAX_DEPTH), "m") is not None


def test_a_value_far_deeper_than_the_limit_is_refused_without_recursing() -> None:
    deep: Any = []
    for _ in range(100_000):
        deep = [deep]

    assert json_problem(deep, "m") == "m" + "[0]" * MAX_DEPTH + f": nested deeper than {MAX_DEPTH} levels"


def test_json_safe_makes_any_echo_writable_by_a_strict_encoder() -> None:
    deep: Any = "leaf"
    for _ in range(5000):
        deep = [deep]
    value = {"x\ud800": [math.nan, math.inf, -math.inf, "\udfff"], "error": ValueError("bad \ud800"), "deep": deep}

    safe = json_safe(value)
    text = json.dumps(safe, ensure_ascii=False, allow_nan=False)

    assert safe["x\\ud800"] == ["NaN", "Infinity", "-Infinity", "\\udfff"]
    assert safe["error"] == "bad \\ud800"
    assert text.encode("utf-8") and "…" in text


def test_escaped_leaves_valid_text_alone() -> None:
    assert escaped("otters 🦦") == "otters 🦦" and lone_surrogate("otters 🦦") is None
    assert lone_surrogate("ab\ud800") == 2
