"""`kvstitch ingest FOLDER` lists every file its walk leaves out, with the reason, before anything is sent."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.cli import main
from service.commands.ingest import Skipped, collect_documents
from service.devtools.ports import free_port

KINDS = ".txt, .text, .md, .markdown, .html, .htm, .xhtml, .pdf"


def licensed_folder(root: Path) -> Path:
    """A folder as a project ships one: text files beside licence files without an extension."""
    folder = root / "project"
    (folder / "sub").mkdir(parents=True)
    (folder / ".git").mkdir()
    (folder / ".git" / "HEAD.txt").write_text("walked into, it would be ingested")
    (folder / "notes.txt").write_text("Otters hold hands while they sleep.")
    (folder / "sub" / "guide.md").write_text("# Guide\n\nSeals rest on sandbanks.")
    (folder / "LICENSE").write_text("Apache License 2.0")
    (folder / "sub" / "COPYING").write_text("GNU GPL")
    (folder / "logo.png").write_bytes(b"\x89PNG\r\n")
    (folder / ".env").write_text("SECRET=1")
    (folder / "loop").symlink_to(folder, target_is_directory=True)
    return folder


def test_a_folder_walk_reports_each_file_it_skips_and_why(tmp_path: Path) -> None:
    folder = licensed_folder(tmp_path)
    skipped: list[Skipped] = []

    documents = collect_documents([folder], max_chars=1000, on_skip=skipped.append)

    assert [d.id for d in documents] == ["project/notes.txt", "project/sub/guide.md"]
    no_extension = f"no extension (a folder walk reads {KINDS}; name the file to ingest it)"
    assert [(s.path, s.reason) for s in skipped] == [
        (folder / ".env", "a hidden file"),
        (folder / ".git", "a hidden folder (not walked)"),
        (folder / "LICENSE", no_extension),
        (folder / "logo.png", f"a .png file (a folder walk reads {KINDS})"),
        (folder / "loop", "a link to a folder (not walked)"),
        (folder / "sub" / "COPYING", no_extension),
    ]


def test_the_cli_prints_the_skipped_files_on_stderr_before_it_sends(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = licensed_folder(tmp_path)
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens: the command stops after the walk

    code = main(["ingest", str(folder), "--url", url])

    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert code == 1 and captured.out == ""
    assert lines[:6] == [
        f"skipped {folder / '.env'}: a hidden file",
        f"skipped {folder / '.git'}: a hidden folder (not walked)",
        f"skipped {folder / 'LICENSE'}: no extension (a folder walk reads {KINDS}; name the file to ingest it)",
        f"skipped {folder / 'logo.png'}: a .png file (a folder walk reads {KINDS})",
        f"skipped {folder / 'loop'}: a link to a folder (not walked)",
        f"skipped {folder / 'sub' / 'COPYING'}: no extension (a folder walk reads {KINDS}; name the file to ingest it)",
    ]
    assert len(lines) == 7 and lines[6].startswith(f"error: cannot talk to the server at {url}: ")


def test_a_file_named_explicitly_is_not_skipped_whatever_its_name(tmp_path: Path) -> None:
    folder = licensed_folder(tmp_path)
    skipped: list[Skipped] = []

    documents = collect_documents([folder / "LICENSE"], max_chars=1000, on_skip=skipped.append)

    assert [(d.id, d.text) for d in documents] == [("LICENSE", "Apache License 2.0")]
    assert skipped == []
