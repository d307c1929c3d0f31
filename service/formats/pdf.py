"""PDF to text with pypdf (pure Python, BSD, maintained): each page's text layer, pages joined by a form feed."""

from __future__ import annotations

import io

from pypdf import PdfReader

from service.formats.errors import ExtractError

PAGE_BREAK = "\f"  # plain text's own page break (as in RFCs and pdftotext output); never inside a page's text


def pdf_to_text(data: bytes) -> tuple[str, str | None, int]:
    """(text, metadata title, page count); `ExtractError` for an encrypted or unreadable file."""
    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted and not reader.decrypt(""):
            raise ExtractError("the PDF is encrypted with a password")
        pages = [_page_text(page.extract_text()) for page in reader.pages]
        title = _title(reader)
    except ExtractError:
        raise
    except Exception as err:
        # pypdf reports damaged files through many exception types (its own, ValueError, KeyError, recursion…):
        # all mean "cannot read this PDF", which is the client's 422, never a 500.
        raise ExtractError(f"not a readable PDF ({type(err).__name__}: {err})") from err
    return PAGE_BREAK.join(pages), title, len(pages)


def _page_text(text: str | None) -> str:
    return (text or "").replace(PAGE_BREAK, "\n").strip()


def _title(reader: PdfReader) -> str | None:
    metadata = reader.metadata
    title = metadata.title if metadata is not None else None
    return title.strip() or None if isinstance(title, str) else None
