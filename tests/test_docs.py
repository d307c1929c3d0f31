"""The README stays true: CI runs its set-up and test commands verbatim, and it documents every setting."""

from __future__ import annotations

from pathlib import Path

from service.settings import Settings

ROOT = Path(__file__).resolve().parent.parent


def _readme() -> str:
    return (ROOT / "README.md").read_text(encoding="utf-8")


def test_ci_runs_exactly_the_readme_set_up_and_test_commands() -> None:
    first_block = _readme().split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line for line in first_block.splitlines() if line.strip()]
    ci_lines = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()

    assert len(commands) == 2 and commands[1] == ".venv/bin/pytest"
    assert ci_lines[-2:] == commands


def test_the_readme_documents_every_setting() -> None:
    readme = _readme()
    missing = [name for name in Settings.model_fields if f"`KVSTITCH_{name.upper()}`" not in readme]
    assert missing == []
