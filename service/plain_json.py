"""What counts as plain JSON for values that travel on (metadata into the queue, Qdrant and Redis; text into the
tokenizer): finite numbers, strings that UTF-8 can encode, string keys, and a bounded depth.

Python's json reads `NaN`, `Infinity` and `1e309` as floats and `"\\ud800"` as a lone surrogate; both are valid
input to `json.loads` and poison to every encoder after it. Deep nesting is valid JSON too, but Qdrant's payload
storage recurses per level (a 500-deep object fails with `RecursionError` inside an ingest job).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

# Deep enough for any real metadata (a document's tags, a source record), far from any recursion limit.
MAX_DEPTH = 32


def lone_surrogate(text: str) -> int | None:
    """The index of the first lone surrogate in `text` (a str UTF-8 cannot encode), or None."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return err.start
    return None


def text_problem(text: str) -> str | None:
    at = lone_surrogate(text)
    if at is None:
        return None
    return f"contains a lone surrogate ({escaped(text[at])}) at position {at}; it is not valid Unicode"


def escaped(text: str) -> str:
    """`text` with lone surrogates written as `\\udXXX`, so it can be encoded, logged and sent back."""
    return text if lone_surrogate(text) is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def json_problem(value: Any, where: str, max_depth: int = MAX_DEPTH) -> str | None:
    """What is wrong with `value` as plain JSON, naming the path (`metadata.tags[2]`), or None.

    Iterative, so a value nested far deeper than `max_depth` is refused without recursing into it.
    """
    stack: list[tuple[Any, str, int]] = [(value, where, 0)]
    while stack:
        item, path, depth = stack.pop()
        if isinstance(item, Mapping | list):
            if depth >= max_depth:
                return f"{path}: nested deeper than {max_depth} levels"
            children = item.items() if isinstance(item, Mapping) else enumerate(item)
            for key, child in children:
                if isinstance(item, Mapping):
                    if not isinstance(key, str):
                        return f"{path}: keys must be strings, got {type(key).__name__}"
                    if (problem := text_problem(key)) is not None:
                        return f"{path}: key {escaped(key)!r} {problem}"
                    stack.append((child, f"{path}.{escaped(key)}", depth + 1))
                else:
                    stack.append((child, f"{path}[{key}]", depth + 1))
        elif isinstance(item, str):
            if (problem := text_problem(item)) is not None:
                return f"{path} {problem}"
        elif isinstance(item, float):
            if not math.isfinite(item):
                return f"{path}: {item} is not a finite number"
        elif item is not None and not isinstance(item, bool | int):
            return f"{path}: {type(item).__name__} is not a JSON value"
    return None


def json_safe(value: Any, depth: int = 0) -> Any:
    """`value` made writable by a strict JSON encoder, for echoing input back in an error: non-finite floats as
    their JSON spelling (`"NaN"`, `"Infinity"`), lone surrogates escaped (keys too), exceptions as their message,
    and anything nested deeper than `MAX_DEPTH` cut to `"…"` (an echo needs no more, and encoders recurse)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, str):
        return escaped(value)
    if isinstance(value, BaseException):
        return escaped(str(value))
    if isinstance(value, Mapping | list | tuple) and depth >= MAX_DEPTH:
        return "…"
    if isinstance(value, Mapping):
        return {json_safe(k, depth) if isinstance(k, str) else k: json_safe(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v, depth + 1) for v in value]
    return value
