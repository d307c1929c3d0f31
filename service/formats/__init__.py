"""Files to ingestable text: plain text, Markdown, HTML and PDF, told apart by their content.

A leaf: bytes and a file name in, an `Extracted` (text, job format, title, original kind) out, no service state.
The CLI (`kvstitch ingest`) and the gateway (`POST /ingest/files`) both call `extract`, so a file is read the same
way whichever way it is sent. The job contract still carries text only: HTML becomes Markdown (its headings keep
steering the chunker and the heading path), a PDF becomes plain text with one form feed between pages (page
numbers are counted from them, `service/retrieval/outline.py`).
"""

from service.formats.errors import ExtractError
from service.formats.extract import EXTENSIONS, Extracted, extract, sniff

__all__ = ["EXTENSIONS", "ExtractError", "Extracted", "extract", "sniff"]
