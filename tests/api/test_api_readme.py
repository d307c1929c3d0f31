"""Every example command of the README runs as written: the `kvstitch` commands, curl and the Python snippet after
the set-up block, in order, from a copy of the repository root (its entries linked, a `data/` of its own), against a
real server on the embedded default settings with the tiny model the README's own `tiny-model` command writes.

What the test changes, all in `EXCEPTIONS` and `run_as_written`: the server's address (the README's port 8000 is
the test server's free port); `.venv` in the copy is the virtual environment running the tests (on a fresh clone, the
repository's own); the commands run with one torch thread. What it does not run, and why, is in `EXCEPTIONS` too."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from app_server import LiveServer

from service.api.app import create_app
from service.engine.engine import StitchEngine
from service.engine.model import load_model
from service.retrieval.embedder import Embedder
from service.serving.server import Server
from service.settings import Settings
from workers.worker import in_process_worker

ROOT = Path(__file__).resolve().parents[2]
README_PORT = "8000"
STEP_TIMEOUT_S = 180

# Commands the test does not run as written, and why (matched against each command's text).
EXCEPTIONS = {
    "serve": "`kvstitch serve` runs until stopped: the test serves the same app in-process, from the model folder and "
    "with the settings that command names (the embedded defaults), on a free port, and stops it where the README "
    "says to stop the server",
    "worker": "the distributed form (`kvstitch serve` and `kvstitch worker` with Redis and a Qdrant server) runs "
    "until stopped; tests/workers and the `redis` API tests run it",
}

# What each command prints when it worked (a command not listed must only exit with 0).
EXPECTED = {
    "kvstitch tiny-model": "wrote a tiny random-weight qwen2 model to data/tiny",
    "kvstitch ingest": "done — 2 documents",
    "kvstitch ask": "TTFT",
    "kvstitch documents --limit": "README.md",
    "kvstitch documents show README.md": "id:        README.md",
    "curl -s localhost:8000/ingest": '{"job_id":',
    "curl -N localhost:8000/ask": "event: done",
    "from openai import OpenAI": "'gpu': 0",
    "kvstitch eval": "turbo@prefix",
}


@dataclass(frozen=True)
class Example:
    language: str  # "bash" or "python"
    text: str  # one shell command (continuation lines joined) or one Python snippet


def readme_examples(readme: str) -> list[Example]:
    """The fenced bash and Python examples after the set-up block, each shell command on its own (a line's
    `a && b` split in two, so a server command can be told apart from the one before it)."""
    blocks = re.findall(r"```(bash|python)\n(.*?)```", readme, flags=re.DOTALL)
    examples: list[Example] = []
    # blocks[0], the set-up and test lines, are not run here: CI (`.ci/run`) runs exactly them (tests/test_docs.py)
    for language, body in blocks[1:]:
        if language == "python":
            examples.append(Example(language, body))
            continue
        for line in body.replace("\\\n", " ").splitlines():
            examples.extend(Example(language, step.strip()) for step in line.split(" && ") if step.strip())
    return examples


def exception_for(example: Example) -> str | None:
    words = example.text.split()
    if len(words) > 1 and words[0].endswith("kvstitch") and words[1] in EXCEPTIONS:
        return words[1]
    return None


def run_as_written(example: Example, cwd: Path, url: str) -> subprocess.CompletedProcess[str]:
    """The example run in `cwd` with one change: the README's address (port 8000) is the test server's."""
    text = example.text.replace(f"http://127.0.0.1:{README_PORT}", url).replace(f"localhost:{README_PORT}", url)
    command = ["bash", "-c", text] if example.language == "bash" else [".venv/bin/python", "-c", text]
    # KVSTITCH_URL: the client commands' documented variable. One torch thread: the tiny model's ops gain nothing
    # from two, and on a 2-core box shared with other work two threads made `kvstitch eval` 4x slower.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KVSTITCH_URL": url, "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=STEP_TIMEOUT_S)


@pytest.fixture
def clone(tmp_path: Path) -> Path:
    """The repository root as a fresh clone has it: its entries linked, no `data/`; `.venv` the running one."""
    root = tmp_path / "kvstitch"
    root.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in ("data", ".venv", "questions.txt"):
            (root / entry.name).symlink_to(entry)
    (root / ".venv").symlink_to(Path(sys.executable).parent.parent)
    return root


class Served:
    """The server the README's `kvstitch serve --model M` starts, in this process: M as the served name, loaded
    from the copy, the embedded defaults, `data/` under the copy."""

    def __init__(self, clone: Path, embedder: Embedder) -> None:
        self.clone = clone
        self.embedder = embedder
        self.live: LiveServer | None = None

    def start(self, command: str) -> str:
        model = command.split("--model", 1)[1].split()[0]
        settings = Settings(model=model, data_dir=self.clone / "data", device="cpu")
        engine = StitchEngine(load_model(self.clone / model, device="cpu"))
        server = Server(settings, engine, self.embedder, worker_factory=in_process_worker)
        self.live = LiveServer(create_app(server)).__enter__()
        return self.live.url

    def stop(self) -> None:
        if self.live is not None:
            self.live.__exit__(None, None, None)
            self.live = None


@pytest.fixture
def served(clone: Path, api_embedder: Embedder) -> Iterator[Served]:
    server = Served(clone, api_embedder)
    yield server
    server.stop()


def test_the_readme_examples_run_as_written(clone: Path, served: Served) -> None:
    examples = readme_examples((ROOT / "README.md").read_text(encoding="utf-8"))
    url = f"http://127.0.0.1:{README_PORT}"  # until the README's server command starts the test server
    ran: list[str] = []
    no_curl: list[str] = []  # a machine without curl runs the rest and skips the test at the end, saying so
    for example in examples:
        kind = exception_for(example)
        if kind == "serve" and served.live is None and "--model" in example.text:
            url = served.start(example.text)
            continue
        if kind is not None:
            continue
        if example.text.startswith("curl ") and shutil.which("curl") is None:
            no_curl.append(example.text)
            continue
        if "kvstitch eval" in example.text:
            served.stop()  # the README: "stop the server first" (embedded Qdrant: one process per data dir)
        done = run_as_written(example, clone, url)
        assert done.returncode == 0, f"{example.text}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        expected = next((out for start, out in EXPECTED.items() if start in example.text), "")
        assert expected in done.stdout, f"{example.text}: {expected!r} not in\n{done.stdout[-2000:]}"
        ran.append(example.text)

    assert len(ran) + len(no_curl) == len(examples) - 3  # all but `kvstitch serve` (twice) and `kvstitch worker`
    assert all(any(start in text for text in ran + no_curl) for start in EXPECTED)  # each met, none parsed away
    if no_curl:
        pytest.skip(f"curl is not installed: every other README example ran; these did not: {no_curl}")


def test_the_readme_examples_are_parsed_as_commands() -> None:
    readme = (
        "```bash\nset-up\n.venv/bin/pytest\n```\ntext\n```bash\n.venv/bin/kvstitch tiny-model d && "
        ".venv/bin/kvstitch serve --model d\n\ncurl -N x \\\n  -d '{}'   # note\n```\n```python\nprint(1)\n```\n"
    )
    examples = readme_examples(readme)

    assert [e.text for e in examples] == [
        ".venv/bin/kvstitch tiny-model d",
        ".venv/bin/kvstitch serve --model d",
        "curl -N x    -d '{}'   # note",
        "print(1)\n",
    ]
    assert [exception_for(e) for e in examples] == [None, "serve", None, None]
    assert exception_for(Example("bash", "kvstitch worker  # a worker")) == "worker"
