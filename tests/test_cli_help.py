"""Every argument of every `kvstitch` subcommand explains itself in `--help`."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import get_args

from service.cli import build_parser
from service.formats.extract import EXTENSIONS, Kind

ROOT = Path(__file__).resolve().parent.parent


def _subcommands(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """(full command name, parser) of the parser and every subcommand below it, nested ones included."""
    yield parser.prog, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _subcommands(sub)


def _undocumented(parser: argparse.ArgumentParser) -> list[str]:
    return [
        "/".join(action.option_strings) or action.dest
        for action in parser._actions
        if not isinstance(action, argparse._SubParsersAction) and not (action.help or "").strip()
    ]


def test_every_option_of_every_subcommand_has_help_text() -> None:
    commands = dict(_subcommands(build_parser()))
    missing = {name: args for name, parser in commands.items() if (args := _undocumented(parser))}

    assert {"kvstitch ask", "kvstitch verify", "kvstitch tiny-model", "kvstitch serve"} <= set(commands)
    assert missing == {}


def test_every_subcommand_has_a_summary() -> None:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    summaries = {choice.dest: choice.help for choice in subparsers._choices_actions}

    assert set(summaries) == set(subparsers.choices)
    assert [name for name, text in summaries.items() if not (text or "").strip()] == []


def test_the_ingest_help_names_every_kind_a_folder_walk_reads() -> None:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    ingest = subparsers.choices["ingest"]
    (paths,) = [a for a in ingest._actions if a.dest == "paths"]
    named = re.findall(r"\.[a-z]+\b", paths.help or "")

    assert named == list(EXTENSIONS)
    summary = next(c.help for c in subparsers._choices_actions if c.dest == "ingest")
    assert summary == "ingest text, Markdown, HTML and PDF files and folders, via a server or embedded"
    assert set(get_args(Kind)) == {"text", "markdown", "html", "pdf"}  # the four kinds the summary names


def test_the_client_commands_start_without_torch() -> None:
    """ask, documents, ingest and cancel only talk HTTP: a run of each (here against a closed port) loads no torch,
    so they start in a fraction of a second."""
    script = (
        "import sys\n"
        "from service.cli import main\n"
        "for argv in (['ask', 'q'], ['documents'], ['ingest', 'README.md'], ['cancel', 'j']):\n"
        "    assert main([*argv, '--url', 'http://127.0.0.1:9']) != 0, argv\n"
        "print(sorted(m for m in ('torch', 'transformers', 'qdrant_client') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)

    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
