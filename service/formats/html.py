"""HTML to Markdown-shaped text with selectolax (MIT; the Lexbor parser in C: fast, tolerant of broken markup).

Scripts, styles and other non-text elements are dropped; headings become ATX headings and list items `- ` lines,
block elements paragraphs, so the chunker cuts at sections and the heading path is kept. The walk is iterative:
a deeply nested page cannot exhaust Python's stack.

Nesting is bounded before the parser sees the page: the parser's time grows with the square of the depth (a
2.4 MB page of `<div>` 200,000 deep held a CPU for over a minute), and no real page nests more than a few dozen
elements. The check counts open tags against close tags, leaving out void elements and those whose end tag may
be omitted (`<p>`, `<li>`, `<td>`…: the parser closes them itself), so it bounds the tree's depth from above.
"""

from __future__ import annotations

import re
from typing import Any

from selectolax.lexbor import LexborHTMLParser

from service.formats.errors import ExtractError

DROPPED = frozenset(
    {
        "script",
        "style",
        "noscript",
        "template",
        "svg",
        "math",
        "iframe",
        "object",
        "canvas",
        "head",
        "button",
        "select",
        "input",
        "textarea",
        "-comment",
    }
)
BLOCKS = frozenset(
    {
        "p",
        "div",
        "section",
        "article",
        "main",
        "header",
        "footer",
        "nav",
        "aside",
        "blockquote",
        "ul",
        "ol",
        "dl",
        "dd",
        "dt",
        "table",
        "thead",
        "tbody",
        "tfoot",
        "figure",
        "figcaption",
        "form",
        "fieldset",
        "address",
        "details",
        "summary",
        "hr",
        "body",
        "html",
    }
)
LINES = frozenset({"br", "li", "tr"})
HEADINGS = {f"h{n}": n for n in range(1, 7)}
_SPACES = re.compile(r"\s+")
MAX_DEPTH = 512
_TAG = re.compile(rb"<(/?)([A-Za-z][A-Za-z0-9:-]*)")  # `<div/>` opens a div in HTML: the slash is ignored
# Elements that never hold others, or whose end tag the parser supplies when the next one starts.
_NOT_NESTING = frozenset(
    b"area base br col embed hr img input link meta source track wbr "
    b"p li dt dd tr td th option optgroup thead tbody tfoot colgroup caption rb rt rp html head body".split()
)


def html_to_markdown(html: str) -> tuple[str, str | None]:
    """(Markdown text, the `<title>` or None); `ExtractError` for a page nested deeper than `MAX_DEPTH`."""
    depth = nesting_depth(html.encode("utf-8", "surrogatepass"), MAX_DEPTH)
    if depth > MAX_DEPTH:
        raise ExtractError(f"HTML nested deeper than {MAX_DEPTH} elements (the reader's bound)")
    tree = LexborHTMLParser(html)
    title_node = tree.css_first("title")
    title = _inline(title_node.text(deep=True)) if title_node is not None else ""
    root = tree.body or tree.root
    out = _Writer()
    if root is not None:
        _walk(root, out)
    return out.text(), title or None


def nesting_depth(html: bytes, stop_above: int) -> int:
    """How deep the page's elements nest, counted from its tags (at most `stop_above` + 1: counting stops there)."""
    depth = deepest = 0
    for closing, name in _TAG.findall(html):
        if name.lower() in _NOT_NESTING:
            continue
        depth = max(0, depth - 1) if closing else depth + 1
        deepest = max(deepest, depth)
        if deepest > stop_above:
            break
    return deepest


def _walk(root: Any, out: _Writer) -> None:
    stack: list[Any] = [root]
    while stack:
        node = stack.pop()
        if node is None:  # the end of a block element
            out.paragraph()
            continue
        tag = node.tag
        if tag == "-text":
            out.inline(node.text(deep=False))
        elif tag in DROPPED:
            continue
        elif tag in HEADINGS:
            out.paragraph()
            out.raw("#" * HEADINGS[tag] + " " + _inline(node.text(deep=True, separator=" ")))
            out.paragraph()
        elif tag == "pre":
            out.paragraph()
            out.raw(node.text(deep=True).strip("\n"))
            out.paragraph()
        else:
            if tag in LINES:
                out.line()
                if tag == "li":
                    out.raw("- ")
            if tag in BLOCKS:
                out.paragraph()
                stack.append(None)
            stack.extend(reversed(list(node.iter(include_text=True))))


def _inline(text: str) -> str:
    return _SPACES.sub(" ", text).strip()


class _Writer:
    """Text with collapsed whitespace and breaks merged: a paragraph break wins over a line break."""

    def __init__(self) -> None:
        self._parts: list[str] = []
        self._pending = 0  # newlines owed before the next text
        self._at_line_start = True

    def line(self) -> None:
        self._pending = max(self._pending, 1)

    def paragraph(self) -> None:
        self._pending = 2

    def inline(self, text: str) -> None:
        collapsed = _SPACES.sub(" ", text)
        if self._pending or self._at_line_start:
            collapsed = collapsed.lstrip()
        if collapsed:
            self.raw(collapsed)

    def raw(self, text: str) -> None:
        if not text:
            return
        if self._pending and self._parts:
            self._parts[-1] = self._parts[-1].rstrip(" ")
            self._parts.append("\n" * self._pending)
        self._pending = 0
        self._parts.append(text)
        self._at_line_start = text.endswith("\n") or text == "- "

    def text(self) -> str:
        return "".join(self._parts).strip()
