"""The producer side of jobs (the gateway and `kvstitch ingest`): give a job a status, then queue it.

Each job takes its documents' next sequence numbers first (`ordering.py`), so jobs for one document apply in the
order they were submitted, whichever worker runs them.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from service.jobs.documents import DeleteJob, Document, IngestJob, Job
from service.jobs.ordering import DocumentOrder
from service.jobs.queue import JobQueue
from service.jobs.status import JobStatusStore


def new_job_id() -> str:
    return uuid.uuid4().hex


def submit_ingest(
    queue: JobQueue,
    jobs: JobStatusStore,
    order: DocumentOrder,
    documents: Sequence[Document],
    job_id: str | None = None,
) -> str:
    """Queue the documents as one ingest job; its status exists before any worker can see the job."""
    sequence = order.claim([d.id for d in documents])
    return _submit(queue, jobs, IngestJob(job_id or new_job_id(), tuple(documents), sequence), len(documents))


def submit_delete(queue: JobQueue, jobs: JobStatusStore, order: DocumentOrder, doc_id: str) -> str:
    """Queue the removal of a document, ordered after every job for it submitted before."""
    return _submit(queue, jobs, DeleteJob(new_job_id(), doc_id, order.claim([doc_id])), 1)


def _submit(queue: JobQueue, jobs: JobStatusStore, job: Job, documents: int) -> str:
    jobs.create(job.job_id, documents, kind=job.kind)
    try:
        queue.enqueue(job.to_payload())
    except Exception as err:
        jobs.update(job.job_id, status="failed", error=f"could not queue the job: {err}")
        raise
    return job.job_id
