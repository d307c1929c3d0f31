"""Which kind a file is (by its bytes first, its extension second) and its text."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any, Literal

from service.formats.errors import ExtractError
from service.formats.html import html_to_markdown
from service.formats.pdf import pdf_to_text

Kind = Literal["text", "markdown", "html", "pdf"]
# Extensions a folder walk picks up; a file named explicitly is read whatever its name (LICENSE, NOTICE…).
EXTENSIONS: dict[str, Kind] = {
    ".txt": "text",
    ".text": "text",
    ".md": "markdown",
    ".markdown": "markdown",
    ".html": "html",
    ".htm": "html",
    ".xhtml": "html",
    ".pdf": "pdf",
}
_HTML_START = re.compile(
    rb"\A(?:\xef\xbb\xbf)?\s*(?:<!--.*?-->\s*)*<(?:!doctype\s+html|html|head|body)[\s>]", re.I | re.S
)
_SNIFF_BYTES = 4096


@dataclass(frozen=True)
class Extracted:
    """A file's text as the job carries it (`format`: text or markdown), its title and what the file was."""

    text: str
    format: Literal["text", "markdown"]
    kind: Kind
    title: str | None = None
    pages: int | None = None  # PDF only

    def metadata(self, **where: Any) -> dict[str, Any]:
        """The document metadata a file brings: where it came from (`where`), its kind, title and page count."""
        metadata: dict[str, Any] = {**where, "content_type": self.kind}
        if self.title:
            metadata["title"] = self.title
        if self.pages is not None:
            metadata["pages"] = self.pages
        return metadata


def sniff(name: str, data: bytes) -> Kind | None:
    """The file's kind: PDF and HTML by their bytes whatever the name, else by extension; None when neither
    decides (read as text if it decodes)."""
    if data.lstrip()[:5] == b"%PDF-":
        return "pdf"
    if _HTML_START.match(data[:_SNIFF_BYTES]):
        return "html"
    return EXTENSIONS.get(PurePath(name).suffix.lower())


def extract(name: str, data: bytes) -> Extracted:
    """The text of a file; `ExtractError` naming the file when it is empty, binary or unreadable."""
    kind = sniff(name, data)
    if kind == "pdf":
        try:
            text, title, pages = pdf_to_text(data)
        except ExtractError as err:
            raise ExtractError(f"{name}: {err}") from err
        return _checked(name, Extracted(text, "text", "pdf", title, pages))
    decoded = _decode(name, data)
    if kind == "html":
        try:
            markdown, title = html_to_markdown(decoded)
        except ExtractError as err:
            raise ExtractError(f"{name}: {err}") from err
        return _checked(name, Extracted(markdown, "markdown", "html", title))
    if kind == "markdown":
        return _checked(name, Extracted(decoded, "markdown", "markdown", markdown_title(decoded)))
    return _checked(name, Extracted(decoded, "text", "text"))


def markdown_title(text: str) -> str | None:
    """The text of a Markdown document's first ATX heading, if any."""
    match = re.search(r"^ {0,3}#{1,6}[ \t]+(.+?)[ \t#]*$", text, re.M)
    return match.group(1).strip() or None if match else None


def _decode(name: str, data: bytes) -> str:
    if b"\x00" in data[:_SNIFF_BYTES]:
        raise ExtractError(f"{name}: a binary file (not UTF-8 text, Markdown, HTML or PDF)")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise ExtractError(f"{name}: not UTF-8 text ({err.reason} at byte {err.start})") from err


def _checked(name: str, extracted: Extracted) -> Extracted:
    if not extracted.text.strip():
        what = "no text layer (a scanned PDF? OCR is not built in)" if extracted.kind == "pdf" else "no text"
        raise ExtractError(f"{name}: {what}")
    return extracted
