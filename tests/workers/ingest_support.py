"""A small corpus and helpers shared by the ingestion tests."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from service.jobs.documents import Document
from service.jobs.job_status import JobStatus
from service.jobs.submit import submit_ingest
from service.serving.runtime import Runtime
from workers.worker import runtime_worker

OpenRuntime = Callable[..., Runtime]

CORPUS = (
    Document(
        "otters.md",
        "# Otters\n\nSea otters hold hands while they sleep so they do not drift apart.\n\n"
        "They keep a favourite stone in a pouch of skin under the forearm and use it to crack shells.",
        {"topic": "animals"},
        "markdown",
    ),
    Document(
        "volcanoes.txt",
        "Shield volcanoes are built almost entirely of fluid lava flows.\n\n"
        "Mauna Loa on Hawaii is the largest active volcano on Earth by volume. "
        "Its eruptions are rarely explosive.",
    ),
    Document(
        "bread.txt",
        "Sourdough rises because wild yeast and lactic acid bacteria ferment the flour. "
        "A starter is fed with flour and water every day.\n\n"
        "Baking at a high temperature with steam gives the crust its shine.",
        {"topic": "food"},
    ),
    Document("chess.txt", "In chess the knight is the only piece that can jump over other pieces."),
)


@dataclass(frozen=True)
class ExpectedChunk:
    doc_id: str
    index: int
    text: str
    token_ids: tuple[int, ...]
    kv_key: str


def expected_chunks(runtime: Runtime, documents: Sequence[Document]) -> list[ExpectedChunk]:
    """What the ingest must produce, computed here with the runtime's own chunker, template and store keys."""
    expected = []
    for doc in documents:
        for chunk in runtime.chunker.chunk(doc.id, doc.text, markdown=doc.format == "markdown"):
            key = runtime.store.key_of(runtime.engine.template.chunk_block(chunk.token_ids))
            expected.append(ExpectedChunk(doc.id, chunk.index, chunk.text, chunk.token_ids, key))
    return expected


def run_job(runtime: Runtime, documents: Sequence[Document], max_turns: int = 20) -> JobStatus:
    """Submit the documents as one job and work the queue until the job is done or failed."""
    job_id = submit_ingest(runtime.queue, runtime.jobs, runtime.order, documents)
    worker = runtime_worker(runtime, poll_ms=10)
    for _ in range(max_turns):
        worker.run_once()
        status = runtime.jobs.get(job_id)
        assert status is not None
        if status.status in ("done", "failed"):
            return status
    raise AssertionError(f"job {job_id} did not finish in {max_turns} turns: {runtime.jobs.get(job_id)}")
