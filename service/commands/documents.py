"""`kvstitch documents [show ID | delete ID]`: what a running server has stored, through its documents API.

Listing pages through `GET /documents` (`--offset`, `--limit`), `show` reads `GET /documents/{id}`, `delete`
queues the removal with `DELETE /documents/{id}` and, with `--wait`, follows its job. Everything printed from the
server passes `printable`, like `kvstitch ask`'s output.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, TextIO
from urllib.parse import quote

import httpx

from service.commands.ask import printable

POLL_S = 0.2
# The server's bounds (service/api/routes/documents.py; a test keeps them equal), checked before asking it.
MAX_LIMIT = 1000
MAX_OFFSET = 10_000_000
FINISHED = ("done", "failed")
TIMEOUT = httpx.Timeout(30.0)


class ServerError(RuntimeError):
    """The server answered with an error status, or could not be reached; the message says which."""


class DocumentsClient:
    """The documents routes of one gateway, over one HTTP connection pool."""

    def __init__(self, url: str, api_key: str | None) -> None:
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=TIMEOUT)

    def list(self, offset: int, limit: int) -> dict[str, Any]:
        return self._json("GET", "/documents", params={"offset": offset, "limit": limit})

    def get(self, doc_id: str) -> dict[str, Any]:
        return self._json("GET", f"/documents/{_path(doc_id)}")

    def delete(self, doc_id: str) -> dict[str, Any]:
        return self._json("DELETE", f"/documents/{_path(doc_id)}")

    def job(self, job_id: str) -> dict[str, Any]:
        return self._json("GET", f"/ingest/{_path(job_id)}")

    def close(self) -> None:
        self.http.close()

    def _json(self, method: str, path: str, params: Mapping[str, int] | None = None) -> dict[str, Any]:
        try:
            reply = self.http.request(method, path, params=params)
        except httpx.HTTPError as err:
            raise ServerError(f"cannot talk to the server at {self.url}: {err}") from err
        if reply.status_code >= 400:
            raise ServerError(f"HTTP {reply.status_code}: {_detail(reply)}")
        body: dict[str, Any] = reply.json()
        return body


def list_documents(client: DocumentsClient, offset: int, limit: int, as_json: bool, out: TextIO) -> int:
    """One page of documents as a table (or the server's JSON), and where the next page starts."""
    page = client.list(offset, limit)
    if as_json:
        print(json.dumps(page, indent=2, ensure_ascii=False), file=out)
        return 0
    documents, total = page["documents"], int(page["total"])
    if documents:
        rows = [("ID", "CHUNKS", "TOKENS", "INGESTED (UTC)", "VERSION")]
        rows += [
            (d["id"], str(d["chunks"]), str(d["tokens"]), _when(d["ingested_at"]), d["version"]) for d in documents
        ]
        widths = [max(len(printable(row[i])) for row in rows) for i in range(len(rows[0]))]
        for row in rows:
            print(
                printable("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))).rstrip(),
                file=out,
            )
    print(_footer(offset, len(documents), total), file=out)
    return 0


def show_document(client: DocumentsClient, doc_id: str, as_json: bool, out: TextIO) -> int:
    """One document's fields, metadata as JSON."""
    document = client.get(doc_id)
    if as_json:
        print(json.dumps(document, indent=2, ensure_ascii=False), file=out)
        return 0
    fields = {
        "id": document["id"],
        "version": document["version"],
        "chunks": document["chunks"],
        "tokens": document["tokens"],
        "ingested": _when(document["ingested_at"]),
        "metadata": json.dumps(document["metadata"], ensure_ascii=False, sort_keys=True),
    }
    for name, value in fields.items():
        print(printable(f"{name + ':':<10} {value}"), file=out)
    return 0


def delete_document(client: DocumentsClient, doc_id: str, wait: bool, out: TextIO) -> int:
    """Queue the removal; with `wait`, follow its job until it is done (0) or failed (1)."""
    accepted = client.delete(doc_id)
    job_id = str(accepted["job_id"])
    print(printable(f"deleting {accepted['doc_id']}: job {job_id}"), file=out, flush=True)
    if not wait:
        return 0
    while (status := client.job(job_id))["status"] not in FINISHED:
        time.sleep(POLL_S)
    if status["status"] == "done":
        print(printable(f"deleted {doc_id}: {status.get('chunks_deleted', 0)} chunks"), file=out)
        return 0
    print(printable(f"error: the delete job {job_id} failed: {status.get('error')}"), file=sys.stderr)
    return 1


def _footer(offset: int, shown: int, total: int) -> str:
    if not shown:
        return f"no documents at offset {offset} ({total} stored)"
    last = offset + shown
    more = f"; next page: --offset {last}" if last < total else ""
    return f"documents {offset + 1}-{last} of {total}{more}"


def _when(timestamp: float | None) -> str:
    """Seconds since the epoch as UTC to the second; `-` for documents stored before the time was recorded."""
    if timestamp is None:
        return "-"
    return datetime.fromtimestamp(timestamp, UTC).strftime("%Y-%m-%d %H:%M:%S")


def _path(segment: str) -> str:
    """An id as one URL path segment ('/', '?' and '#' escaped), so any document id reaches its route."""
    return quote(segment, safe="")


def _detail(reply: httpx.Response) -> str:
    try:
        body = reply.json()
    except ValueError:
        return reply.text
    detail = body.get("detail", body) if isinstance(body, dict) else body
    if isinstance(detail, list):  # FastAPI's 422: name each refused field
        return "; ".join(f"{'.'.join(map(str, e.get('loc', ())[1:]))}: {e.get('msg')}" for e in detail)
    return str(detail)
