"""Where a chunk sits in its document: the heading path above it and the pages it spans.

Kept beside the chunk in Qdrant (shown with the sources) and put in front of the chunk's text for its embedding
only (`embedding_text`): the chunk's token ids, and so its KV cache, stay exactly the chunk's own text.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from service.retrieval.boundaries import code_fences
from service.retrieval.headings import Heading, find_headings

PAGE_BREAK = "\f"
MAX_PATH = 6  # headings kept in a path (the deepest ones)
MAX_HEADING_CHARS = 200


@dataclass(frozen=True)
class ChunkContext:
    """The title of the document, the headings above the chunk (outermost first), its first and last page."""

    title: str | None = None
    headings: tuple[str, ...] = ()
    page: int | None = None
    last_page: int | None = None

    def payload(self) -> dict[str, Any]:
        """The fields a point carries (absent ones left out)."""
        fields: dict[str, Any] = {"title": self.title, "headings": list(self.headings) or None}
        fields.update(page=self.page, last_page=self.last_page)
        return {k: v for k, v in fields.items() if v is not None}


class Outline:
    """A document's headings and page breaks, asked for the context of any character range."""

    def __init__(self, text: str, markdown: bool, title: str | None = None) -> None:
        code = [(s.start, s.end) for s in code_fences(text)] if markdown else []
        self._headings = find_headings(text, markdown, code)
        self._heading_starts = [h.start for h in self._headings]
        self._breaks = [i for i, ch in enumerate(text) if ch == PAGE_BREAK]
        self.title = _clip(title) if title else None

    def context(self, start: int, end: int) -> ChunkContext:
        """The context of the chunk [start, end): the headings in force where it starts, its pages."""
        paged = bool(self._breaks)
        return ChunkContext(
            title=self.title,
            headings=self._path(start),
            page=self._page(start) if paged else None,
            last_page=self._page(max(start, end - 1)) if paged else None,
        )

    def _path(self, offset: int) -> tuple[str, ...]:
        """The headings in force at `offset` (a heading starting right there included)."""
        stack: list[Heading] = []
        for heading in self._headings[: bisect.bisect_right(self._heading_starts, offset)]:
            while stack and stack[-1].level >= heading.level:
                stack.pop()
            stack.append(heading)
        return tuple(_clip(h.title) for h in stack[-MAX_PATH:])

    def _page(self, offset: int) -> int:
        return 1 + bisect.bisect_right(self._breaks, offset)


def embedding_text(context: ChunkContext, text: str) -> str:
    """What is embedded for a chunk: the document's title and the innermost heading above it, then its text (a
    heading the chunk starts with is not repeated). Only the innermost: the outer ones are the same for many
    chunks, and in a 256-piece embedder they dilute what sets the chunk apart (the whole path lost recall)."""
    lead = [context.title] if context.title else []
    for heading in context.headings[-1:]:
        if heading not in lead and not text.lstrip("# \t").startswith(heading):
            lead.append(heading)
    return " › ".join(lead) + "\n\n" + text if lead else text


def document_title(metadata: Mapping[str, Any], text: str, markdown: bool) -> str | None:
    """A document's title: the `title` in its metadata, else its first Markdown heading."""
    given = metadata.get("title")
    if isinstance(given, str) and given.strip():
        return given.strip()
    if markdown:
        headings = find_headings(text[:20_000], markdown=True)
        return headings[0].title if headings else None
    return None


def _clip(text: str) -> str:
    return text if len(text) <= MAX_HEADING_CHARS else text[: MAX_HEADING_CHARS - 1] + "…"
