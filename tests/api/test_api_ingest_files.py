"""POST /ingest/files against the real app: real PDF and HTML files uploaded, searchable with their pages and
titles in the sources; bad uploads refused naming the file; chunks_done moving while a multi-batch job runs."""

from __future__ import annotations

import time
from typing import Any

from api_support import ask_events, wait_job
from app_server import MakeApp, wait_ready
from fastapi.testclient import TestClient

from tests.samples import HARBOUR_HTML, OTTER_PAGES, OTTER_TITLE, make_pdf

LICENSE_TEXT = "Licensed to the otter trust under the Apache License, Version 2.0.\n"


def upload(client: TestClient, files: list[tuple[str, bytes]]) -> Any:
    return client.post("/ingest/files", files=[("files", (name, data)) for name, data in files])


def sources_for(client: TestClient, question: str) -> list[dict[str, Any]]:
    events = ask_events(client, question=question, top_k=20, max_new_tokens=1)
    assert events[0][0] == "retrieval"
    chunks: list[dict[str, Any]] = events[0][1]["chunks"]
    return chunks


def test_uploaded_pdf_html_and_license_are_searchable_with_pages_and_titles(make_app: MakeApp) -> None:
    app = make_app()
    with TestClient(app) as client:
        wait_ready(app)
        reply = upload(
            client,
            [("guide.pdf", make_pdf()), ("seals.html", HARBOUR_HTML.encode()), ("LICENSE", LICENSE_TEXT.encode())],
        )
        assert reply.status_code == 202, reply.text
        status = wait_job(client, reply.json()["job_id"])
        assert (status["status"], status["documents_done"]) == ("done", 3)
        assert status["chunks_done"] == status["chunks"] > 3

        by_doc: dict[str, list[dict[str, Any]]] = {}
        for source in sources_for(client, "Where do otter pups shelter in kelp?"):
            by_doc.setdefault(source["doc_id"], []).append(source)
        assert set(by_doc) == {"guide.pdf", "seals.html", "LICENSE"}

        pdf = by_doc["guide.pdf"]
        assert {s["title"] for s in pdf} == {OTTER_TITLE}
        for number, text in enumerate(OTTER_PAGES, 1):  # every page's chunks carry that page's number
            first_words = " ".join(text.split()[:4])
            pages = {(s["page"], s["last_page"]) for s in pdf if first_words in s["text"]}
            assert pages == {(number, number)}

        html = by_doc["seals.html"]
        assert {s["title"] for s in html} == {"Harbour Seals"}
        diving = [s for s in html if "thirty minutes" in s["text"]]
        assert diving and diving[0]["headings"] == ["Harbour seals", "Diving"] and "page" not in diving[0]
        assert not any("scriptSecret" in s["text"] or "styleSecret" in s["text"] for s in html)

        assert [s["text"] for s in by_doc["LICENSE"]] == [LICENSE_TEXT.strip()]

        # /retrieve (what a LangChain or LlamaIndex retriever reads) carries the same pages, headings and titles.
        retrieved = client.post("/retrieve", json={"question": "Where do otter pups shelter in kelp?", "top_k": 20})
        assert retrieved.status_code == 200, retrieved.text
        placed = {(c["doc_id"], c["text"]): c for c in retrieved.json()["chunks"]}
        for source in [*pdf, *html]:
            chunk = placed[(source["doc_id"], source["text"])]
            for key in ("title", "page", "last_page", "headings"):
                assert chunk.get(key) == source.get(key), key
        assert placed[("seals.html", diving[0]["text"])]["headings"] == ["Harbour seals", "Diving"]

        document = client.get("/documents/guide.pdf").json()
        assert document["metadata"] == {
            "source": "upload",
            "filename": "guide.pdf",
            "content_type": "pdf",
            "title": OTTER_TITLE,
            "pages": 3,
        }


def test_bad_uploads_are_refused_naming_the_file_and_nothing_is_queued(make_app: MakeApp) -> None:
    app = make_app(max_upload_files=2, max_upload_file_mb=1)
    with TestClient(app) as client:
        wait_ready(app)
        good = ("good.txt", b"Fine text.")

        binary = upload(client, [good, ("COPYING", b"\x00\x01\x02binary")])
        assert binary.status_code == 422
        assert binary.json()["detail"][0]["loc"] == ["body", "files"]
        assert binary.json()["detail"][0]["msg"] == "COPYING: a binary file (not UTF-8 text, Markdown, HTML or PDF)"

        broken = upload(client, [("paper.pdf", b"%PDF-1.7 not really")])
        assert broken.status_code == 422 and broken.json()["detail"][0]["msg"].startswith(
            "paper.pdf: not a readable PDF"
        )

        too_many = upload(client, [good, ("b.txt", b"b"), ("c.txt", b"c")])
        assert too_many.status_code == 422
        assert too_many.json()["detail"][0]["msg"] == "at most 2 files per upload, got 3"

        too_large = upload(client, [("big.txt", b"x" * (2**20 + 1))])
        assert too_large.status_code == 413 and "big.txt" in too_large.json()["detail"]

        too_long = upload(client, [("long.txt", b"word " * 2000)])  # 10,000 characters; the limit is 5,000
        assert too_long.status_code == 422
        assert too_long.json()["detail"][0]["msg"] == "long.txt has 10,000 characters; the limit is 5,000"

        empty = upload(client, [("empty.md", b"  \n")])
        assert empty.status_code == 422 and empty.json()["detail"][0]["msg"] == "empty.md: the file is empty"

        assert client.post("/ingest/files").status_code == 422  # no files at all
        assert client.get("/documents").json()["total"] == 0


def test_chunks_done_moves_while_the_batches_of_a_job_finish(make_app: MakeApp) -> None:
    # The smallest precompute batch the settings allow (256 tokens: 4 blocks of a 48-token chunk and its markers),
    # so a document of ~60 chunks is ~15 batches.
    app = make_app(max_precompute_tokens=256)
    text = " ".join(f"Sentence {n} tells of otter number {n} and its favourite stone." for n in range(70))
    with TestClient(app) as client:
        wait_ready(app)
        reply = client.post("/ingest", json={"documents": [{"id": "many", "text": text[:4900]}]})
        assert reply.status_code == 202
        job_id = reply.json()["job_id"]
        seen: list[tuple[int, int]] = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            status = client.get(f"/ingest/{job_id}").json()
            seen.append((status["chunks_done"], status["chunks"]))
            if status["status"] in ("done", "failed"):
                break
        assert status["status"] == "done"
        total = status["chunks"]
        assert total > 20 and status["chunks_done"] == total
        assert any(0 < done < total == chunks for done, chunks in seen), seen[:: max(1, len(seen) // 20)]
        done_values = [done for done, _ in seen]
        assert done_values == sorted(done_values)  # never goes back
