"""A small corpus ingested into an embedded data dir, for the tests that read an ingested corpus (eval's corpus
form, fine-tuning over a corpus)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import pytest

from service.cli import main


def ingest_corpus(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    model_dir: Path,
    settings: Mapping[str, str],
    documents: Mapping[str, str],
) -> Path:
    """`documents` (file name -> text) ingested with `kvstitch ingest --embedded` under a clean KVSTITCH_*
    environment (`settings` only) and a working dir without a .env; returns the data dir."""
    for name in [n for n in os.environ if n.upper().startswith("KVSTITCH_")]:
        monkeypatch.delenv(name)
    for name, value in settings.items():
        monkeypatch.setenv(f"KVSTITCH_{name}", value)
    monkeypatch.chdir(tmp_path)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name, text in documents.items():
        (corpus / name).write_text(text, encoding="utf-8")
    data = tmp_path / "data"
    argv = ["ingest", "--embedded", "--model", str(model_dir), "--device", "cpu"]
    assert main([*argv, "--data-dir", str(data), str(corpus)]) == 0
    return data
