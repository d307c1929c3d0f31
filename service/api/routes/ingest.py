"""POST /ingest and GET /ingest/{job_id}: queue documents, and follow any job (ingest or delete)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, status
from fastapi.concurrency import run_in_threadpool

from service.api.deps import FacadeDep, http_error
from service.api.openapi import errors
from service.api.schemas import IngestAccepted, IngestRequest, JobStatusOut
from service.facade.types import Document

router = APIRouter(tags=["ingest"], responses=errors(401))


@router.post(
    "/ingest",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=IngestAccepted,
    responses=errors(400, 413, 422, 503),
)
async def ingest(body: IngestRequest, facade: FacadeDep) -> IngestAccepted:
    """Queue documents for ingestion; poll GET /ingest/{job_id}. 413 when the job holds more tokens than
    KVSTITCH_MAX_JOB_TOKENS."""
    documents = [Document(d.id, d.text, d.metadata, d.format) for d in body.documents]
    try:
        job_id = await run_in_threadpool(facade.submit_ingest, documents)
    except Exception as err:
        raise http_error(err) from err
    return IngestAccepted(job_id=job_id)


@router.get("/ingest/{job_id}", response_model=JobStatusOut, responses=errors(404, 422, 503))
async def job_status(job_id: Annotated[str, Path(max_length=128)], facade: FacadeDep) -> JobStatusOut:
    """Where a job stands (an ingest, or a delete queued by DELETE /documents/{id})."""
    try:
        job = await run_in_threadpool(facade.job_status, job_id)
    except Exception as err:
        raise http_error(err) from err
    if job is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"no ingest job {job_id!r} (unknown or expired)")
    return JobStatusOut.model_validate(job, from_attributes=True)


@router.delete("/ingest/{job_id}", response_model=JobStatusOut, responses=errors(404, 409, 422, 503))
async def cancel_job(job_id: Annotated[str, Path(max_length=128)], facade: FacadeDep) -> JobStatusOut:
    """Cancel a queued or running job: documents it has not finished are never published and their KV blocks
    are released (those finished stay); 404 unknown, 409 already finished."""
    try:
        job = await run_in_threadpool(facade.cancel_job, job_id)
    except Exception as err:
        raise http_error(err) from err
    return JobStatusOut.model_validate(job, from_attributes=True)
