"""The docs stay true: CI runs the README's set-up and test commands verbatim, and docs/settings.md documents every
setting and every variable read anywhere."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from service.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
# Where a variable is read outside `Settings`: os.environ.get / os.getenv / os.environ[...] / `in os.environ` in
# Python, `${VAR}` / `${VAR:-default}` in compose files and shell scripts.
ENV_READS = (
    re.compile(r"""(?:environ\.get|getenv|environ\[)\(?\s*["'](KVSTITCH_[A-Z0-9_]+)["']"""),
    re.compile(r"""["'](KVSTITCH_[A-Z0-9_]+)["']\s+(?:not\s+)?in\s+os\.environ"""),
    re.compile(r"\$\{(KVSTITCH_[A-Z0-9_]+)"),
)
SOURCES = ("service", "workers", "loadtest", "tests", "deploy", "docker-compose.yml", "Dockerfile", ".ci")


def _readme() -> str:
    return (ROOT / "README.md").read_text(encoding="utf-8")


def test_ci_runs_exactly_the_readme_set_up_and_test_commands() -> None:
    first_block = _readme().split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line for line in first_block.splitlines() if line.strip()]
    ci_lines = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()

    assert len(commands) == 2 and commands[1] == ".venv/bin/pytest"
    assert ci_lines[-2:] == commands


CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _torch_install() -> str:
    """The set-up line's torch install, as written (`.venv/bin/pip install torch==… …`)."""
    set_up = _readme().split("```bash\n", 1)[1].splitlines()[0]
    return next(step.strip() for step in set_up.split(" && ") if "pip install torch" in step)


def _pip_arguments(command: str, **env: str) -> list[str]:
    """The arguments bash hands pip for `command` (pip itself replaced by printf, so nothing is installed)."""
    shown = command.replace(".venv/bin/pip", "printf '%s\\n'", 1)
    clean = {k: v for k, v in os.environ.items() if k != "KVSTITCH_TORCH_INDEX"}
    done = subprocess.run(["bash", "-c", shown], env={**clean, **env}, capture_output=True, text=True, check=True)
    return done.stdout.splitlines()


def test_the_torch_install_takes_the_cpu_index_when_asked_and_pips_own_otherwise() -> None:
    command = _torch_install()

    # unset (CI here: pip's local CPU wheel; a GPU machine: PyPI's CUDA build): plain `pip install torch==2.13.0`
    assert _pip_arguments(command) == ["install", "torch==2.13.0"]
    assert _pip_arguments(command, KVSTITCH_TORCH_INDEX=CPU_INDEX) == [
        "install",
        "torch==2.13.0",
        "--index-url",
        CPU_INDEX,
    ]
    # the text under the commands says which value gives which build
    notes = _readme().split("```bash\n", 1)[1].split("```", 1)[1].split("## Run", 1)[0]
    assert f"KVSTITCH_TORCH_INDEX={CPU_INDEX}" in notes
    assert "https://download.pytorch.org/whl/cu128" in notes and "CUDA build" in notes


def _settings_table() -> set[str]:
    """The variables docs/settings.md's tables have a row for."""
    settings_page = (ROOT / "docs" / "settings.md").read_text(encoding="utf-8")
    return set(re.findall(r"^\| `(KVSTITCH_[A-Z0-9_]+)` \|", settings_page, flags=re.MULTILINE))


def _variables_read_outside_settings() -> set[str]:
    files = [p for name in SOURCES for p in ([ROOT / name] if (ROOT / name).is_file() else (ROOT / name).rglob("*"))]
    texts = [p.read_text(encoding="utf-8", errors="ignore") for p in files if p.is_file() and p.suffix != ".pyc"]
    return {name for text in texts for pattern in ENV_READS for name in pattern.findall(text)}


def test_the_settings_page_documents_every_setting() -> None:
    table = _settings_table()
    missing = [name for name in Settings.model_fields if f"KVSTITCH_{name.upper()}" not in table]
    assert missing == []


def test_the_settings_page_documents_every_variable_read_anywhere() -> None:
    read = _variables_read_outside_settings()

    assert {"KVSTITCH_URL", "KVSTITCH_API_KEY", "KVSTITCH_TARGET"} <= read  # the scan finds the CLI's and compose's
    assert sorted(read - _settings_table()) == []


LINK = re.compile(r"\]\(([^)\s]+)\)")


def _broken_links(page: Path) -> list[str]:
    """Relative links of a Markdown page whose file does not exist (web links and bare anchors skipped)."""
    targets = [t.split("#", 1)[0] for t in LINK.findall(page.read_text(encoding="utf-8"))]
    local = [t for t in targets if t and "://" not in t]
    return [t for t in local if not (page.parent / t).exists()]


def test_the_readme_and_the_docs_pages_link_only_to_files_that_exist() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

    assert {p.name for p in pages} >= {"README.md", "settings.md", "api.md", "operations.md", "architecture.md"}
    assert {p.name: _broken_links(p) for p in pages} == {p.name: [] for p in pages}
