"""POST /ingest, GET /ingest/{job_id}, DELETE /documents/{doc_id}."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Path, status
from fastapi.concurrency import run_in_threadpool

from service.api.deps import GatewayDep, field_error, ready_runtime, require_api_key, unavailable
from service.api.openapi import errors
from service.api.schemas import DocumentDeleted, IngestAccepted, IngestRequest, JobStatusOut
from workers.documents import Document, IngestJob, JobError, parse_job
from workers.runtime import Runtime
from workers.submit import new_job_id, submit_job

router = APIRouter(tags=["ingest"], dependencies=[Depends(require_api_key)], responses=errors(401))
RuntimeDep = Annotated[Runtime, Depends(ready_runtime)]


@router.post(
    "/ingest",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=IngestAccepted,
    responses=errors(400, 413, 422, 503),
)
def ingest(body: IngestRequest, gateway: GatewayDep, runtime: RuntimeDep) -> IngestAccepted:
    """Queue documents for ingestion; poll GET /ingest/{job_id}."""
    documents = [Document(d.id, d.text, d.metadata, d.format) for d in body.documents]
    job_id = new_job_id()
    try:
        parse_job(
            IngestJob(job_id, tuple(documents)).to_payload(), runtime.limits
        )  # the worker's own checks, answered now instead of as a failed job
    except JobError as err:
        raise field_error("documents", str(err)) from err
    try:
        submit_job(runtime.queue, runtime.jobs, documents, job_id)
    except Exception as err:  # Redis away: the job was not queued, say so
        raise unavailable(f"cannot queue the job: {type(err).__name__}: {err}") from err
    gateway.metrics.ingest_jobs.labels("submitted").inc()
    return IngestAccepted(job_id=job_id)


@router.get("/ingest/{job_id}", response_model=JobStatusOut, responses=errors(404, 422, 503))
def job_status(job_id: Annotated[str, Path(max_length=128)], runtime: RuntimeDep) -> JobStatusOut:
    """Where an ingest job stands."""
    job = runtime.jobs.get(job_id)
    if job is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"no ingest job {job_id!r} (unknown or expired)")
    return JobStatusOut.model_validate(job, from_attributes=True)


@router.delete("/documents/{doc_id:path}", response_model=DocumentDeleted, responses=errors(404, 422, 503))
async def delete_document(doc_id: Annotated[str, Path(max_length=256)], runtime: RuntimeDep) -> DocumentDeleted:
    """Remove a document's chunks and release KV blocks no other document uses."""
    deleted, released = await run_in_threadpool(runtime.ingestor().delete, doc_id)
    if deleted == 0:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"no document {doc_id!r}")
    return DocumentDeleted(doc_id=doc_id, deleted_chunks=deleted, released_blocks=released)
