"""Metadata filters of a search, as a client writes them and as the core carries them (no Qdrant type here: the
HTTP process reads them through the facade without importing qdrant-client).

A filter is `{"must": [...], "should": [...], "must_not": [...]}`; each condition is one of
`{"key": K, "match": V}`, `{"key": K, "any": [V, ...]}`, `{"key": K, "range": {"gte"|"gt"|"lte"|"lt": X}}` or a
nested filter. A key names a field of the document's metadata (given at ingest), or `doc_id` (the document's id)
or `ingested_at` (when it was ingested, seconds since the epoch or an ISO 8601 date). A range's bounds are all
numbers or all ISO dates. `should` holds when at least one of its conditions does (Qdrant's meaning).

Every part is bounded, so a filter costs Qdrant a bounded amount of work and a mistake is a 422 naming `filter`
and what is wrong.
"""

from __future__ import annotations

import datetime
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MAX_CONDITIONS = 32  # in the whole filter, nested ones included
MAX_FILTER_DEPTH = 3  # a filter within a filter within a filter
MAX_KEY_CHARS = 64
MAX_VALUE_CHARS = 256
MAX_ANY_VALUES = 64
CLAUSES = ("must", "should", "must_not")
RANGE_BOUNDS = ("gte", "gt", "lte", "lt")
DOC_ID_KEY = "doc_id"
INGESTED_AT_KEY = "ingested_at"
# Letters, digits, `_`, `-`; dots reach into nested metadata (`source.site`).
KEY_PATTERN = re.compile(r"[A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+)*")

MatchValue = str | int | bool


@dataclass(frozen=True)
class Match:
    key: str
    value: MatchValue


@dataclass(frozen=True)
class AnyOf:
    key: str
    values: tuple[str, ...] | tuple[int, ...]


@dataclass(frozen=True)
class Range:
    """Bounds on a number (`dates` false) or on an ISO 8601 date (`dates` true: the bounds are aware datetimes)."""

    key: str
    bounds: tuple[tuple[str, float | datetime.datetime], ...]  # (gte|gt|lte|lt, value)
    dates: bool


@dataclass(frozen=True)
class SearchFilter:
    must: tuple[Condition, ...] = ()
    should: tuple[Condition, ...] = ()
    must_not: tuple[Condition, ...] = ()

    def clauses(self) -> dict[str, tuple[Condition, ...]]:
        return {"must": self.must, "should": self.should, "must_not": self.must_not}


Condition = Match | AnyOf | Range | SearchFilter


class FilterError(ValueError):
    """What is wrong with a filter and where (`must[1].range`)."""


def parse_filter(raw: Any) -> SearchFilter:
    """The client's filter, checked against every bound; `FilterError` saying where it is wrong."""
    counter = [0]
    return _filter(raw, "filter", 1, counter)


def _filter(raw: Any, where: str, depth: int, counter: list[int]) -> SearchFilter:
    if not isinstance(raw, Mapping):
        raise FilterError(f"{where}: a filter is an object with must, should and/or must_not lists")
    if depth > MAX_FILTER_DEPTH:
        raise FilterError(f"{where}: filters nest at most {MAX_FILTER_DEPTH} deep")
    unknown = sorted(set(raw) - set(CLAUSES))
    if unknown:
        raise FilterError(f"{where}: unknown clause {unknown[0]!r} (must, should, must_not)")
    if not raw:
        raise FilterError(f"{where}: empty; give at least one of must, should, must_not")
    clauses: dict[str, tuple[Condition, ...]] = {}
    for name in CLAUSES:
        if name not in raw:
            continue
        items = raw[name]
        if not isinstance(items, list) or not items:
            raise FilterError(f"{where}.{name}: a non-empty list of conditions")
        clauses[name] = tuple(_condition(c, f"{where}.{name}[{i}]", depth, counter) for i, c in enumerate(items))
    return SearchFilter(**clauses)


def _condition(raw: Any, where: str, depth: int, counter: list[int]) -> Condition:
    counter[0] += 1
    if counter[0] > MAX_CONDITIONS:
        raise FilterError(f"{where}: at most {MAX_CONDITIONS} conditions in a filter")
    if isinstance(raw, Mapping) and "key" not in raw:
        return _filter(raw, where, depth + 1, counter)
    if not isinstance(raw, Mapping):
        raise FilterError(f"{where}: a condition is an object with key and one of match, any, range")
    kinds = [k for k in ("match", "any", "range") if k in raw]
    extra = sorted(set(raw) - {"key", "match", "any", "range"})
    if extra:
        raise FilterError(f"{where}: unknown field {extra[0]!r} (key, match, any, range)")
    if len(kinds) != 1:
        raise FilterError(f"{where}: give exactly one of match, any, range")
    key = _key(raw["key"], f"{where}.key")
    kind = kinds[0]
    if kind == "match":
        return Match(key, _value(raw["match"], f"{where}.match"))
    if kind == "any":
        return AnyOf(key, _values(raw["any"], f"{where}.any"))
    return _range(key, raw["range"], f"{where}.range")


def _key(raw: Any, where: str) -> str:
    if not isinstance(raw, str) or not 1 <= len(raw) <= MAX_KEY_CHARS or not KEY_PATTERN.fullmatch(raw):
        raise FilterError(
            f"{where}: 1 to {MAX_KEY_CHARS} letters, digits, '_' or '-', dots between parts (got {_shown(raw)})"
        )
    return raw


def _value(raw: Any, where: str) -> MatchValue:
    if isinstance(raw, bool | int) and not isinstance(raw, float):
        if not isinstance(raw, bool) and abs(raw) >= 2**63:
            raise FilterError(f"{where}: integers fit in 64 bits")
        return raw
    if isinstance(raw, str):
        if not 1 <= len(raw) <= MAX_VALUE_CHARS:
            raise FilterError(f"{where}: strings of 1 to {MAX_VALUE_CHARS} characters")
        try:
            raw.encode("utf-8")
        except UnicodeEncodeError as err:
            raise FilterError(f"{where}: not valid Unicode") from err
        return raw
    raise FilterError(f"{where}: a string, an integer or a boolean (a range takes other numbers; got {_shown(raw)})")


def _values(raw: Any, where: str) -> tuple[str, ...] | tuple[int, ...]:
    if not isinstance(raw, list) or not 1 <= len(raw) <= MAX_ANY_VALUES:
        raise FilterError(f"{where}: a list of 1 to {MAX_ANY_VALUES} values")
    values = [_value(v, f"{where}[{i}]") for i, v in enumerate(raw)]
    if all(isinstance(v, str) for v in values):
        return tuple(str(v) for v in values)
    if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return tuple(int(v) for v in values)
    raise FilterError(f"{where}: all strings or all integers")


def _range(key: str, raw: Any, where: str) -> Range:
    if not isinstance(raw, Mapping) or not raw:
        raise FilterError(f"{where}: an object with one or more of gte, gt, lte, lt")
    extra = sorted(set(raw) - set(RANGE_BOUNDS))
    if extra:
        raise FilterError(f"{where}: unknown bound {extra[0]!r} (gte, gt, lte, lt)")
    bounds = [(name, _bound(raw[name], f"{where}.{name}")) for name in RANGE_BOUNDS if name in raw]
    dates = isinstance(bounds[0][1], datetime.datetime)
    if any(isinstance(b, datetime.datetime) != dates for _, b in bounds):
        raise FilterError(f"{where}: bounds are all numbers or all ISO dates")
    return Range(key, tuple(bounds), dates)


def _bound(raw: Any, where: str) -> float | datetime.datetime:
    if isinstance(raw, bool):
        raise FilterError(f"{where}: a number or an ISO 8601 date (got a boolean)")
    if isinstance(raw, int | float):
        if not math.isfinite(raw):
            raise FilterError(f"{where}: a finite number")
        return float(raw)
    if isinstance(raw, str) and len(raw) <= MAX_VALUE_CHARS:
        try:
            when = datetime.datetime.fromisoformat(raw)
        except ValueError:
            pass
        else:
            return when if when.tzinfo is not None else when.replace(tzinfo=datetime.UTC)
    raise FilterError(f"{where}: a number or an ISO 8601 date such as 2026-01-31 (got {_shown(raw)})")


def _shown(raw: Any) -> str:
    text = repr(raw)
    return text if len(text) <= 40 else text[:37] + "..."


def epoch_seconds(bound: float | datetime.datetime) -> float:
    """A range bound on `ingested_at` (stored as seconds since the epoch)."""
    return bound.timestamp() if isinstance(bound, datetime.datetime) else bound
