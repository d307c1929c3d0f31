"""The producer side of ingestion: give a job a status, then queue it (the gateway and `kvstitch ingest`)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from workers.documents import Document, IngestJob
from workers.job_status import JobStatusStore
from workers.queue import JobQueue


def new_job_id() -> str:
    return uuid.uuid4().hex


def submit_job(queue: JobQueue, jobs: JobStatusStore, documents: Sequence[Document], job_id: str | None = None) -> str:
    """Queue the documents as one job; its status exists before any worker can see the job."""
    job = IngestJob(job_id or new_job_id(), tuple(documents))
    jobs.create(job.job_id, len(job.documents))
    try:
        queue.enqueue(job.to_payload())
    except Exception as err:
        jobs.update(job.job_id, status="failed", error=f"could not queue the job: {err}")
        raise
    return job.job_id
