"""Metadata filters as a client writes them: what is accepted (and how it reads), and each mistake's message."""

from __future__ import annotations

import datetime
from typing import Any

import pytest

from service.search_filter import (
    MAX_ANY_VALUES,
    MAX_CONDITIONS,
    AnyOf,
    FilterError,
    Match,
    Range,
    SearchFilter,
    parse_filter,
)


def test_a_filter_reads_as_its_clauses_and_conditions() -> None:
    parsed = parse_filter(
        {
            "must": [{"key": "lang", "match": "en"}, {"key": "year", "range": {"gte": 2020, "lt": 2025.5}}],
            "should": [{"key": "doc_id", "any": ["a", "b"]}, {"must_not": [{"key": "draft", "match": True}]}],
            "must_not": [{"key": "published", "range": {"lt": "2026-01-31"}}],
        }
    )
    assert parsed.must == (Match("lang", "en"), Range("year", (("gte", 2020.0), ("lt", 2025.5)), dates=False))
    assert parsed.should == (AnyOf("doc_id", ("a", "b")), SearchFilter(must_not=(Match("draft", True),)))
    midnight = datetime.datetime(2026, 1, 31, tzinfo=datetime.UTC)
    assert parsed.must_not == (Range("published", (("lt", midnight),), dates=True),)


BAD: list[tuple[Any, str]] = [
    ([], "filter: a filter is an object"),
    ({}, "filter: empty"),
    ({"mist": []}, "filter: unknown clause 'mist'"),
    ({"must": []}, "filter.must: a non-empty list"),
    ({"must": [{"key": "a"}]}, "filter.must[0]: give exactly one of match, any, range"),
    ({"must": [{"key": "a", "match": 1, "any": [1]}]}, "filter.must[0]: give exactly one"),
    ({"must": [{"key": "a", "equals": 1}]}, "filter.must[0]: unknown field 'equals'"),
    ({"must": [{"key": "a b", "match": 1}]}, "filter.must[0].key: 1 to 64 letters"),
    ({"must": [{"key": "k" * 65, "match": 1}]}, "filter.must[0].key: 1 to 64"),
    ({"must": [{"key": "a", "match": 1.5}]}, "filter.must[0].match: a string, an integer or a boolean"),
    ({"must": [{"key": "a", "match": "x" * 257}]}, "filter.must[0].match: strings of 1 to 256"),
    ({"must": [{"key": "a", "any": []}]}, "filter.must[0].any: a list of 1 to 64"),
    ({"must": [{"key": "a", "any": ["x", 1]}]}, "filter.must[0].any: all strings or all integers"),
    ({"must": [{"key": "a", "any": list(range(MAX_ANY_VALUES + 1))}]}, "filter.must[0].any: a list of 1 to 64"),
    ({"must": [{"key": "a", "range": {}}]}, "filter.must[0].range: an object with one or more"),
    ({"must": [{"key": "a", "range": {"ge": 1}}]}, "filter.must[0].range: unknown bound 'ge'"),
    ({"must": [{"key": "a", "range": {"gte": "soon"}}]}, "filter.must[0].range.gte: a number or an ISO 8601 date"),
    ({"must": [{"key": "a", "range": {"gte": True}}]}, "got a boolean"),
    ({"must": [{"key": "a", "range": {"gte": 1, "lt": "2026-01-01"}}]}, "all numbers or all ISO dates"),
    ({"must": [{"must": [{"must": [{"must": [{"key": "a", "match": 1}]}]}]}]}, "filters nest at most 3 deep"),
    ({"must": [{"key": "a", "match": i} for i in range(MAX_CONDITIONS + 1)]}, "at most 32 conditions"),
]


@pytest.mark.parametrize(("raw", "message"), BAD)
def test_a_wrong_filter_says_where_and_what(raw: Any, message: str) -> None:
    with pytest.raises(FilterError) as caught:
        parse_filter(raw)
    assert message in str(caught.value)


def test_a_filter_at_every_bound_is_accepted() -> None:
    deep = {"must": [{"must": [{"must": [{"key": "a", "match": 1}]}]}]}
    assert parse_filter(deep).must[0] == SearchFilter(must=(SearchFilter(must=(Match("a", 1),)),))
    many = {"should": [{"key": "a", "match": i} for i in range(MAX_CONDITIONS)]}
    assert len(parse_filter(many).should) == MAX_CONDITIONS
    assert parse_filter({"must": [{"key": "source.site-1_x", "any": list(range(MAX_ANY_VALUES))}]}).must[0] == AnyOf(
        "source.site-1_x", tuple(range(MAX_ANY_VALUES))
    )


def test_the_filter_index_setting_reads_as_keys_and_types() -> None:
    from service.settings import parse_filter_indexes

    assert parse_filter_indexes(" lang:keyword, year:integer,source.site:keyword,") == {
        "lang": "keyword",
        "year": "integer",
        "source.site": "keyword",
    }
    assert parse_filter_indexes("") == {}
    with pytest.raises(ValueError, match="'lang:text': write key:type, type one of keyword, integer"):
        parse_filter_indexes("lang:text")
    with pytest.raises(ValueError, match="'a b:keyword': the key is 1 to 64"):
        parse_filter_indexes("a b:keyword")
