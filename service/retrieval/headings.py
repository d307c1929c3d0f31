"""Headings of a text: Markdown ATX headings, and in plain text the shapes licences, RFCs and PDFs use.

Plain text has no markup, so a heading is recognised by shape: a short line standing alone as a paragraph,
numbered or not ending as a sentence does ("0. Definitions.", "TERMS AND CONDITIONS"), a line underlined with
`---` or `===`, or a numbered title sentence that opens a section's first line ("3. Grant of Patent License.
Subject to…"). The chunker keeps each heading with the text under it, and the outline gives every chunk its
heading path.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

MAX_HEADING_WORDS = 10
MAX_TITLE_SENTENCE_WORDS = 6
_ATX = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?[ \t#]*$", re.M)
_PARAGRAPH = re.compile(r"(?:^|(?<=\n))[ \t]*\S[^\n]*(?:\n[ \t]*\S[^\n]*)*", re.M)
_UNDERLINE = re.compile(r"[ \t]*(?:-{3,}|={3,})[ \t]*")
_NUMBER = re.compile(r"[ \t]*((?:\d+\.)+\d*|\d+\)|[A-Z]\.|(?:Section|Article|Chapter) \d+[.:]?)[ \t]+")
_TITLE_SENTENCE = re.compile(r"[^.!?\n]{1,80}[.:](?=[ \t]+\S)")


@dataclass(frozen=True)
class Heading:
    """A heading's characters [start, end) (the line, or the title sentence), its level and its words."""

    start: int
    end: int
    level: int
    title: str


def find_headings(text: str, markdown: bool, code: Sequence[tuple[int, int]] = ()) -> list[Heading]:
    """Every heading in text order; in Markdown the ATX ones outside `code` (spans of fenced blocks)."""
    if markdown:
        return [h for h in _atx(text) if not any(s <= h.start < e for s, e in code)]
    found: list[Heading] = []
    for match in _PARAGRAPH.finditer(text):
        heading = _plain(text, match.start(), match.end())
        if heading is not None:
            found.append(heading)
    return found


def is_heading_only(text: str, markdown: bool) -> bool:
    """Whether a chunk's text is nothing but headings (what a chunk must never be)."""
    if not text.strip():
        return False
    headings = find_headings(text, markdown)
    covered = [False] * len(text)
    for h in headings:
        covered[h.start : h.end] = [True] * (h.end - h.start)
    if not markdown:  # an underline belongs to its heading
        for m in re.finditer(r"^(?:-{3,}|={3,})[ \t]*$", text, re.M):
            covered[m.start() : m.end()] = [True] * (m.end() - m.start())
    return all(c or ch.isspace() for c, ch in zip(covered, text, strict=True))


def _atx(text: str) -> list[Heading]:
    return [
        Heading(m.start(), m.end(), len(m.group(1)), (m.group(2) or "").strip())
        for m in _ATX.finditer(text)
        if (m.group(2) or "").strip()
    ]


def _plain(text: str, start: int, end: int) -> Heading | None:
    """The heading a plain-text paragraph is or opens, if any."""
    block = text[start:end]
    lines = block.split("\n")
    if len(lines) == 2 and _UNDERLINE.fullmatch(lines[1]) and _short(lines[0]):
        first = start + len(lines[0]) - len(lines[0].lstrip())
        return Heading(first, start + len(lines[0]), _level(lines[0]), lines[0].strip())
    if len(lines) == 1 and _short(block) and (_NUMBER.match(block) or not _ends_like_prose(block)):
        first = start + len(block) - len(block.lstrip())
        return Heading(first, end, _level(block), block.strip())
    number = _NUMBER.match(block)
    if number is None:
        return None
    sentence = _TITLE_SENTENCE.match(block, number.end())
    if sentence is None or len(sentence.group().split()) > MAX_TITLE_SENTENCE_WORDS:
        return None
    first = start + len(block) - len(block.lstrip())
    return Heading(first, start + sentence.end(), _level(block), block[number.start(1) - 0 : sentence.end()].strip())


def _short(line: str) -> bool:
    words = line.split()
    return 0 < len(words) <= MAX_HEADING_WORDS and len(line.strip()) <= 100


def _ends_like_prose(line: str) -> bool:
    """A short unnumbered line ending as a sentence does ("Thanks.") is a paragraph, not a title."""
    return line.rstrip().endswith((".", "!", "?", ",", ";", ":", "…", '"', "'", ")"))


def _level(line: str) -> int:
    """1 for an unnumbered heading; 1 + depth for a numbered one ("3." → 2, "3.1." → 3)."""
    number = _NUMBER.match(line)
    if number is None:
        return 1
    label = number.group(1)
    return 1 + max(1, len([p for p in label.split(".") if p.strip().isdigit()]))
