"""`kvstitch documents` against the real app under a real uvicorn server: list (paged, table and JSON), show, delete,
the API key, and refusals that name what is wrong."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator

import httpx
import pytest
from api_support import DOCS, ingest
from app_server import LiveServer

from service.cli import main
from service.commands.documents import MAX_LIMIT, MAX_OFFSET

API_KEY = "documents-cli-key-0123"
Run = Callable[..., tuple[int, str, str]]


@pytest.fixture
def served(live_server: Callable[..., LiveServer]) -> Iterator[LiveServer]:
    """A live server with an API key, holding DOCS plus one document whose id has a slash in it."""
    with live_server(api_key=API_KEY, redis_url=None) as server:
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}) as client:
            status = ingest(client, [*DOCS, {"id": "notes/tides.md", "text": "Tides follow the moon."}])
            assert status["status"] == "done", status
        yield server


@pytest.fixture
def run(served: LiveServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Run:
    """`kvstitch documents …` in this process, its URL and key from the environment as a user would set them."""
    monkeypatch.setenv("KVSTITCH_URL", served.url)
    monkeypatch.setenv("KVSTITCH_API_KEY", API_KEY)

    def run_cli(*args: str) -> tuple[int, str, str]:
        code = main(["documents", *args])
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run_cli


IDS = sorted([*(d["id"] for d in DOCS), "notes/tides.md"])  # bread, notes/tides.md, otters, volcano


def test_documents_lists_a_page_as_a_table(run: Run) -> None:
    code, out, err = run("--limit", "2")

    assert code == 0, err
    header, *rows, footer = out.splitlines()
    assert header.split() == ["ID", "CHUNKS", "TOKENS", "INGESTED", "(UTC)", "VERSION"]
    assert [row.split()[0] for row in rows] == IDS[:2]
    assert all(re.fullmatch(r"\S+\s+[1-9]\d*\s+[1-9]\d*\s+\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\s+\S+", r) for r in rows)
    assert footer == f"documents 1-2 of {len(IDS)}; next page: --offset 2"

    code, out, _ = run("--offset", "2", "--limit", "2")
    assert code == 0 and [row.split()[0] for row in out.splitlines()[1:-1]] == IDS[2:]
    assert out.splitlines()[-1] == f"documents 3-4 of {len(IDS)}"

    code, out, _ = run("--offset", "10")
    assert code == 0 and out == f"no documents at offset 10 ({len(IDS)} stored)\n"


def test_documents_json_is_the_servers_page(run: Run, served: LiveServer) -> None:
    code, out, _ = run("--offset", "1", "--limit", "2", "--json")
    direct = httpx.get(
        f"{served.url}/documents", params={"offset": 1, "limit": 2}, headers={"Authorization": f"Bearer {API_KEY}"}
    )

    assert code == 0
    assert json.loads(out) == direct.json()
    assert json.loads(out)["total"] == len(IDS) and [d["id"] for d in json.loads(out)["documents"]] == IDS[1:3]


def test_documents_show_prints_one_document(run: Run) -> None:
    code, out, _ = run("show", "otters")
    code_json, out_json, _ = run("show", "otters", "--json")

    assert code == 0 and code_json == 0
    shown = dict(line.split(":", 1) for line in out.splitlines())
    document = json.loads(out_json)
    assert {k: v.strip() for k, v in shown.items()} == {
        "id": "otters",
        "version": document["version"],
        "chunks": str(document["chunks"]),
        "tokens": str(document["tokens"]),
        "ingested": shown["ingested"].strip(),
        "metadata": '{"k": 1}',
    }
    assert document["metadata"] == {"k": 1} and document["chunks"] >= 1
    # an id with a slash reaches its document (one escaped path segment)
    code, out, _ = run("show", "notes/tides.md", "--json")
    assert code == 0 and json.loads(out)["id"] == "notes/tides.md"


def test_documents_delete_removes_the_document(run: Run) -> None:
    code, out, err = run("delete", "notes/tides.md", "--wait")

    assert code == 0, err
    first, last = out.splitlines()
    assert re.fullmatch(r"deleting notes/tides\.md: job \S+", first)
    assert re.fullmatch(r"deleted notes/tides\.md: [1-9]\d* chunks", last)
    code, out, err = run("show", "notes/tides.md")
    assert code == 1 and out == "" and err.startswith("error: HTTP 404: ")
    code, out, _ = run("--json")
    assert json.loads(out)["total"] == len(IDS) - 1


def test_documents_refusals_name_what_is_wrong(run: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    code, _, err = run("delete", "never-ingested")
    assert (code, err) == (1, "error: HTTP 404: no document 'never-ingested'\n")
    assert run("--limit", "0") == (2, "", "error: --limit must be 1-1,000, got 0\n")
    assert run("--offset", "-1") == (2, "", "error: --offset must be 0-10,000,000, got -1\n")
    code, _, err = run("--api-key", "wrong", "--json")
    assert code == 1 and err.startswith("error: HTTP 401: ")
    monkeypatch.setenv("KVSTITCH_URL", "http://127.0.0.1:9")
    code, _, err = run("show", "otters")
    assert code == 1 and err.startswith("error: cannot talk to the server at http://127.0.0.1:9")


def test_the_cli_bounds_are_the_servers(served: LiveServer) -> None:
    schema = httpx.get(f"{served.url}/openapi.json", headers={"Authorization": f"Bearer {API_KEY}"}).json()
    params = {p["name"]: p["schema"] for p in schema["paths"]["/documents"]["get"]["parameters"]}

    assert (params["offset"]["minimum"], params["offset"]["maximum"]) == (0, MAX_OFFSET)
    assert (params["limit"]["minimum"], params["limit"]["maximum"]) == (1, MAX_LIMIT)


@pytest.mark.parametrize("args", [("show", "otters"), ("--json",)], ids=["show", "list-json"])
def test_documents_into_a_closed_pipe_end_quietly(served: LiveServer, args: tuple[str, ...]) -> None:
    """`kvstitch documents show X | head`: the reader is gone before the command writes (its read end is closed
    first, so every write fails at once); the command stops with status 1 and nothing on stderr."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    env = {**os.environ, "KVSTITCH_URL": served.url, "KVSTITCH_API_KEY": API_KEY}
    try:
        done = subprocess.run(
            [sys.executable, "-m", "service", "documents", *args],
            stdout=write_end,
            stderr=subprocess.PIPE,
            env=env,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        os.close(write_end)

    assert (done.returncode, done.stderr) == (1, "")
