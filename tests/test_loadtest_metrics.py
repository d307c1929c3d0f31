"""The load test reads the server's counters from /metrics pages: the retrieval split per question."""

from __future__ import annotations

import argparse

from loadtest.bench_retrieval import summary
from loadtest.load import Result, mode_report
from loadtest.serve_random import engine_seconds, gc_passes, gc_pause_growth, gc_pauses, passes, retrieval_split
from service.retrieval.batcher import RetrievalStats

BEFORE = """# HELP kvstitch_retrieval_seconds_total x
kvstitch_retrieval_seconds_total{stage="wait"} 1.0
kvstitch_retrieval_seconds_total{stage="embed"} 0.5
kvstitch_retrieval_seconds_total{stage="search"} 0.25
kvstitch_retrieval_questions_total 10.0
kvstitch_retrieval_rounds_total 5.0
kvstitch_engine_seconds_total{phase="idle"} 3.0
"""
AFTER = """kvstitch_retrieval_seconds_total{stage="wait"} 3.0
kvstitch_retrieval_seconds_total{stage="embed"} 1.5
kvstitch_retrieval_seconds_total{stage="search"} 0.75
kvstitch_retrieval_questions_total 50.0
kvstitch_retrieval_rounds_total 10.0
kvstitch_engine_seconds_total{phase="idle"} 4.5
"""


def test_the_retrieval_split_is_the_growth_per_question_between_two_pages() -> None:
    # 40 questions in 5 rounds spent 2 s waiting, 1 s embedding, 0.5 s searching.
    assert retrieval_split(BEFORE, AFTER) == {"wait": 50.0, "embed": 25.0, "search": 12.5, "round_size": 8.0}
    assert retrieval_split(AFTER, AFTER) == {}  # no question between the pages
    assert engine_seconds(AFTER) == {"idle": 4.5}


def test_gc_pauses_are_read_by_generation_as_seconds_and_collections() -> None:
    page = """kvstitch_gc_pause_seconds_bucket{generation="0",le="0.001"} 3.0
kvstitch_gc_pause_seconds_count{generation="0"} 7.0
kvstitch_gc_pause_seconds_sum{generation="0"} 0.25
kvstitch_gc_pause_seconds_count{generation="2"} 1.0
kvstitch_gc_pause_seconds_sum{generation="2"} 0.125
"""
    assert gc_pauses(page) == {"0": (0.25, 7), "2": (0.125, 1)}
    assert gc_pauses(AFTER) == {}
    later = page.replace("} 7.0", "} 10.0").replace("} 0.25", "} 0.5")
    # Between the pages: 3 young collections took 0.25 s; a generation first seen in the later page counts whole.
    assert gc_pause_growth(page, later) == {"0": [0.25, 3], "2": [0.0, 0]}
    assert gc_pause_growth(AFTER, page) == {"0": [0.25, 7], "2": [0.125, 1]}


def test_the_retrieval_benchmark_divides_each_stage_by_the_questions_of_its_phase() -> None:
    before = RetrievalStats(questions=10, rounds=5, wait_s=1.0, embed_s=1.0, search_s=1.0)
    after = RetrievalStats(questions=30, rounds=9, wait_s=1.2, embed_s=1.8, search_s=1.4)
    row = summary(before, after, [10.0, 20.0, 30.0, 40.0])
    assert row["questions"] == 20 and row["round_size"] == 5.0
    assert (round(row["wait_ms"], 6), round(row["embed_ms"], 6), round(row["search_ms"], 6)) == (10.0, 40.0, 20.0)
    assert row["p50_ms"] == 25.0 and 38.0 <= row["p95_ms"] <= 40.0


def test_serve_random_passes_pair_overlap_levels_with_the_with_decode_setting() -> None:
    assert passes("auto", "auto") == [(None, None, None)]
    assert passes("on", "both") == [("on", True, "on-with-decode"), ("on", False, "on-apart")]
    assert passes("both", "auto") == [("on", None, "on"), ("off", None, "off")]
    assert passes("auto", "off") == [(None, False, "apart")]


def test_serve_random_repeats_every_pass_per_gc_threshold_in_order() -> None:
    args = argparse.Namespace(overlap="on", with_decode="on", gc_gen0=[20_000, 700])
    assert gc_passes(args) == [
        ("on", True, "on-with-decode-gc20000", 20_000),
        ("on", True, "on-with-decode-gc700", 700),
    ]
    assert gc_passes(argparse.Namespace(overlap="auto", with_decode="auto", gc_gen0=None)) == [(None, None, None, None)]
    assert gc_passes(argparse.Namespace(overlap="auto", with_decode="auto", gc_gen0=[5])) == [(None, None, "gc5", 5)]


def test_a_mode_report_gives_each_server_stage_its_median_over_the_answers_that_report_it() -> None:
    """The done events' stage times (queue, prefill, ...) summarised per stage; a failed answer's are left out."""
    timings = [{"queue": 10.0, "prefill": 4.0}, {"queue": 30.0, "prefill": 6.0}, {"queue": 20.0}]
    results = [Result(mode="turbo", topic=0, started_s=0.0, timings_ms=t) for t in timings]
    results.append(Result(mode="turbo", topic=0, started_s=0.0, timings_ms={"queue": 999.0}, error="HTTP 500"))
    report = mode_report("turbo", results, 1.0)
    assert report.stage_ms == {"prefill": 5.0, "queue": 20.0}
