"""Where a text may be cut into chunks, and how good each place is.

A cut point is a whitespace run between two pieces of text: the chunk before it ends where the run starts and
the chunk after it begins where the run ends, so no chunk starts or ends with whitespace. Each cut point is
ranked by what it separates (a Markdown section, a paragraph, a sentence, a line, two words); the chunker takes
the best-ranked one that fits its token budget. Counting tokens is the chunker's job, not this module's.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import IntEnum

from service.retrieval.headings import find_headings


class Rank(IntEnum):
    """How good a cut is; higher is better."""

    TOKEN = 0  # inside a run without whitespace: the last resort, made by the chunker at a token boundary
    WORD = 1
    LINE = 2
    SENTENCE = 3
    PARAGRAPH = 4
    HEADING = 5  # right before a heading (`headings.py`), so a section starts its own chunk


@dataclass(frozen=True)
class CutPoint:
    """The chunk before ends at `start`, the chunk after begins at `end` (equal for a cut without whitespace)."""

    start: int
    end: int
    rank: Rank


@dataclass(frozen=True)
class Span:
    """A half-open character range [start, end) of the text."""

    start: int
    end: int


_WHITESPACE = re.compile(r"\s+")
# A sentence ends with terminal punctuation, optionally followed by closing quotes or brackets.
_SENTENCE_END = re.compile(r"[.!?…。！？][)\]}\"'”’»」』）]*\Z")
# CJK sentences end with full-width punctuation and often run on without a space.
_CJK_SENTENCE_END = re.compile(r"[。！？][」』）”’]*(?=\S)")
_ATX_HEADING = re.compile(r"#{1,6}(?:[ \t]|$)", re.MULTILINE)
_FENCE_OPEN = re.compile(r"^ {0,3}(`{3,}|~{3,})([^\n]*)$", re.MULTILINE)
_LINE_NUMBER = re.compile(r"[ \t]*(?:\d+\.)+|[ \t]*[A-Za-z]\.")
_PARAGRAPH_SEPARATOR = "\u2029"  # Unicode's explicit paragraph break counts as a blank line


def code_fences(text: str) -> list[Span]:
    """Fenced code blocks of a Markdown text, from the opening fence to the closing one (or the text's end)."""
    fences: list[Span] = []
    pos = 0
    while (opening := _FENCE_OPEN.search(text, pos)) is not None:
        marker, info = opening.group(1), opening.group(2)
        if marker[0] == "`" and "`" in info:  # CommonMark: a backtick fence's info string has no backticks
            pos = opening.end() + 1
            continue
        closing = re.compile(rf"^ {{0,3}}({re.escape(marker[0])}{{{len(marker)},}})[ \t\r]*$", re.MULTILINE)
        close_match = closing.search(text, opening.end() + 1)
        end = len(text.rstrip()) if close_match is None else close_match.end(1)
        fences.append(Span(opening.start(1), end))
        pos = end + 1
    return fences


def find_cut_points(
    text: str,
    *,
    markdown: bool = False,
    keep_whole: Callable[[Span], bool] = lambda _: False,
) -> list[CutPoint]:
    """Every place the text may be cut between its first and last non-whitespace characters, in text order.

    In Markdown, a fenced code block for which `keep_whole` is true has no cut points inside it (the chunker
    passes "fits in one chunk"); a larger one is cut like plain text.
    """
    fences = code_fences(text) if markdown else []
    whole = [keep_whole(f) for f in fences]
    whole_fences = _SpanSet([f for f, w in zip(fences, whole, strict=True) if w])
    code = _SpanSet(fences)
    headings = [] if markdown else find_headings(text, markdown=False)
    marks = _HeadingMarks({h.start for h in headings}, {h.end for h in headings})
    first, last = len(text) - len(text.lstrip()), len(text.rstrip())
    points = [p for p in _all_cut_points(text, markdown, code, marks) if first < p.start and p.end < last]
    return [p for p in points if not whole_fences.holds(p.start)]


@dataclass(frozen=True)
class _HeadingMarks:
    """Where plain-text headings start and end (Markdown's are read from the text at each gap)."""

    starts: set[int]
    ends: set[int]


def _all_cut_points(text: str, markdown: bool, code: _SpanSet, marks: _HeadingMarks) -> Iterator[CutPoint]:
    """Whitespace runs and CJK sentence ends, ranked, in text order; inside code a `#` line is no heading."""
    gaps = (
        CutPoint(m.start(), m.end(), _rank_gap(text, m.start(), m.end(), markdown and not code.holds(m.start()), marks))
        for m in _WHITESPACE.finditer(text)
    )
    cjk = (CutPoint(m.end(), m.end(), Rank.SENTENCE) for m in _CJK_SENTENCE_END.finditer(text))
    yield from sorted([*gaps, *cjk], key=lambda p: p.start)


def _rank_gap(text: str, start: int, end: int, markdown: bool, marks: _HeadingMarks) -> Rank:
    gap = text[start:end]
    newlines = gap.count("\n") + gap.count("\f") + 2 * gap.count(_PARAGRAPH_SEPARATOR)
    # A heading belongs with the text under it, never alone at a chunk's end (checked before "a heading
    # follows": a title right above a section heading stays with it too).
    if start in marks.ends or (markdown and newlines >= 1 and _follows_heading(text, start)):
        return Rank.LINE if newlines >= 1 else Rank.WORD
    if newlines >= 1 and (end in marks.starts or (markdown and _ATX_HEADING.match(text, end) is not None)):
        return Rank.HEADING
    if newlines >= 2:
        return Rank.PARAGRAPH
    if _ends_sentence(text, start, end):
        return Rank.SENTENCE
    return Rank.LINE if newlines == 1 else Rank.WORD


def _follows_heading(text: str, start: int) -> bool:
    """Whether the line that ends at `start` is an ATX heading."""
    line_start = text.rfind("\n", 0, start) + 1
    line = text[line_start:start].lstrip(" ")
    return _ATX_HEADING.match(line) is not None


def _ends_sentence(text: str, start: int, end: int) -> bool:
    """Terminal punctuation before the gap and no lowercase letter after it ("e.g. this" is not a sentence end);
    a section or list number opening its line ("3.", "1.4.", "b.") ends no sentence."""
    if _SENTENCE_END.search(text, max(0, start - 8), start) is None:
        return False
    if _LINE_NUMBER.fullmatch(text, text.rfind("\n", 0, start) + 1, start) is not None:
        return False
    return end >= len(text) or not text[end].islower()


class _SpanSet:
    """Sorted, disjoint spans with a logarithmic "strictly inside one of them" test."""

    def __init__(self, spans: list[Span]) -> None:
        self._spans = sorted(spans, key=lambda s: s.start)
        self._starts = [s.start for s in self._spans]

    def holds(self, pos: int) -> bool:
        i = bisect.bisect_left(self._starts, pos) - 1
        return i >= 0 and pos < self._spans[i].end
