"""Reading a hostile file is bounded: HTML nested past the bound is refused before the parser sees it, and every
upload is read in a child process that is killed when its time is up or its caller gives up."""

from __future__ import annotations

import multiprocessing
import threading
import time

import pytest

from service.formats import ExtractError, extract
from service.formats.html import MAX_DEPTH, nesting_depth
from service.formats.isolated import ExtractCancelledError, ExtractTimeoutError, IsolatedExtractor

DEEP_DIVS = b"<!doctype html><html><body>" + b"<div>" * 200_000 + b"deep" + b"</div>" * 200_000


def large_page(paragraphs: int) -> bytes:
    return b"<!doctype html><html><body>" + b"<p>Sea otters <b>hold</b> <a href='x'>hands</a>.</p>\n" * paragraphs


def readers() -> list[str]:
    return [child.name for child in multiprocessing.active_children() if child.name == "kvstitch-extract"]


def test_html_nested_past_the_bound_is_refused_at_once_naming_it() -> None:
    started = time.monotonic()
    with pytest.raises(ExtractError, match=rf"page\.html: HTML nested deeper than {MAX_DEPTH} elements"):
        extract("page.html", DEEP_DIVS)
    assert time.monotonic() - started < 2.0  # parsing it took 76 CPU-seconds


def test_the_depth_counts_only_elements_that_nest() -> None:
    page = b"<div><p>a<p>b<ul><li>x<li>y</ul><br><img src=x><table><tr><td>1<td>2</table></div>"
    assert nesting_depth(page, MAX_DEPTH) == 2  # div > ul, then div > table: p, li, td, br, img do not nest
    assert nesting_depth(b"<div>" * 600, MAX_DEPTH) == MAX_DEPTH + 1  # counting stops past the bound
    assert extract("ok.html", b"<html><body>" + b"<div>" * 400 + b"fine").text == "fine"


def test_a_file_read_in_a_child_process_comes_back_whole() -> None:
    extractor = IsolatedExtractor(timeout_s=60)
    try:
        extracted = extractor.extract("seals.html", b"<html><head><title>Seals</title></head><body><h1>Seals</h1>x")
        with pytest.raises(ExtractError, match=r"deep\.html: HTML nested deeper"):
            extractor.extract("deep.html", DEEP_DIVS)
    finally:
        extractor.close()
    assert (extracted.kind, extracted.title, extracted.text) == ("html", "Seals", "# Seals\n\nx")


def test_a_file_past_its_time_is_refused_and_its_reader_killed() -> None:
    extractor = IsolatedExtractor(timeout_s=0.3)
    try:
        started = time.monotonic()
        with pytest.raises(ExtractTimeoutError, match=r"big.html: reading it took longer than 0.3 s"):
            extractor.extract("big.html", large_page(200_000))  # ~10 MB: seconds of parsing
        took = time.monotonic() - started
        left = readers()
        small = extractor.extract("small.html", large_page(3))  # a fresh reader takes the next file
    finally:
        extractor.close()
    assert took < 2.0 and left == []
    assert small.text.startswith("Sea otters hold hands.")


def test_a_caller_giving_up_stops_the_reading_at_once() -> None:
    extractor = IsolatedExtractor(timeout_s=60)
    stop = threading.Event()
    threading.Timer(0.5, stop.set).start()
    try:
        started = time.monotonic()
        with pytest.raises(ExtractCancelledError):
            extractor.extract("big.html", large_page(400_000), stop.is_set)
        took = time.monotonic() - started
        left = readers()
    finally:
        extractor.close()
    assert 0.4 < took < 1.5 and left == []
