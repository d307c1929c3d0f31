"""Files to text: kinds told by content, HTML without scripts or styles, PDF pages and titles, clear refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.commands.ingest import InputError, collect_documents
from service.formats import ExtractError, extract
from tests.samples import HARBOUR_HTML, OTTER_PAGES, OTTER_TITLE, make_pdf


def test_a_pdf_is_read_page_by_page_whatever_its_name() -> None:
    extracted = extract("guide.bin", make_pdf())

    assert (extracted.kind, extracted.format, extracted.title, extracted.pages) == ("pdf", "text", OTTER_TITLE, 3)
    assert extracted.text.split("\f") == list(OTTER_PAGES)


def test_html_becomes_markdown_without_scripts_or_styles() -> None:
    extracted = extract("seals", HARBOUR_HTML.encode())

    assert (extracted.kind, extracted.format, extracted.title) == ("html", "markdown", "Harbour Seals")
    assert "# Harbour seals\n\nHarbour seals rest on sandbanks at low tide." in extracted.text
    assert "## Diving" in extracted.text and "- Pups swim within hours of birth." in extracted.text
    for hidden in ("scriptSecret", "styleSecret", "color: red", "Enable JavaScript", "never indexed"):
        assert hidden not in extracted.text


def test_markdown_by_extension_with_its_first_heading_as_title() -> None:
    extracted = extract("notes.md", b"Intro line.\n\n## Storage rules\n\nBlocks are written once.")
    assert (extracted.kind, extracted.format, extracted.title) == ("markdown", "markdown", "Storage rules")


def test_a_file_without_extension_is_text_when_it_decodes() -> None:
    extracted = extract("LICENSE", "Copyright © 2026 the authors.\n".encode())
    assert (extracted.kind, extracted.format, extracted.text) == ("text", "text", "Copyright © 2026 the authors.\n")


@pytest.mark.parametrize(
    ("name", "data", "why"),
    [
        ("NOTICE", bytes(range(256)), "NOTICE: a binary file"),
        ("photo", b"\xff\xd8\xff\xe0" + b"\x10" * 64, "photo: not UTF-8 text"),
        ("broken.pdf", b"%PDF-1.7\n" + b"garbage" * 20, "broken.pdf: not a readable PDF"),
        ("scan.pdf", make_pdf(pages=["", ""], title=None), "scan.pdf: no text layer"),
        ("empty.html", b"<html><body><script>x()</script></body></html>", "empty.html: no text"),
    ],
)
def test_unreadable_files_are_refused_naming_the_file(name: str, data: bytes, why: str) -> None:
    with pytest.raises(ExtractError) as caught:
        extract(name, data)
    assert str(caught.value).startswith(why)


def test_the_cli_reads_named_files_of_any_name_and_walks_folders_by_extension(tmp_path: Path) -> None:
    (tmp_path / "LICENSE").write_text("Licensed under the Apache License.\n")
    folder = tmp_path / "site"
    folder.mkdir()
    (folder / "seals.html").write_text(HARBOUR_HTML)
    (folder / "guide.pdf").write_bytes(make_pdf())
    (folder / "README").write_text("not picked up by a folder walk")

    documents = {d.id: d for d in collect_documents([tmp_path / "LICENSE", folder], max_chars=10_000)}

    assert sorted(documents) == ["LICENSE", "site/guide.pdf", "site/seals.html"]
    assert documents["LICENSE"].text == "Licensed under the Apache License.\n"
    pdf = documents["site/guide.pdf"]
    assert pdf.metadata == {
        "source": str(folder / "guide.pdf"),
        "content_type": "pdf",
        "title": OTTER_TITLE,
        "pages": 3,
    }
    assert documents["site/seals.html"].format == "markdown"


def test_the_cli_refuses_a_named_binary_file(tmp_path: Path) -> None:
    (tmp_path / "COPYING").write_bytes(b"\x00\x01binary")
    with pytest.raises(InputError) as caught:
        collect_documents([tmp_path / "COPYING"], max_chars=100)
    assert str(caught.value) == f"{tmp_path / 'COPYING'}: a binary file (not UTF-8 text, Markdown, HTML or PDF)"
