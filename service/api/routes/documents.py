"""DELETE /documents/{doc_id}: queue a document's removal behind every earlier job for it."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, status
from fastapi.concurrency import run_in_threadpool

from service.api.deps import FacadeDep, http_error, require_api_key
from service.api.schemas import DeleteAccepted

router = APIRouter(tags=["documents"], dependencies=[Depends(require_api_key)])


@router.delete("/documents/{doc_id:path}", status_code=status.HTTP_202_ACCEPTED, response_model=DeleteAccepted)
async def delete_document(doc_id: Annotated[str, Path(max_length=256)], facade: FacadeDep) -> DeleteAccepted:
    """Remove a document's chunks and release KV blocks no other document uses; poll GET /ingest/{job_id}.
    Ordered after any ingest of the same document sent before it; 404 for a document never ingested."""
    try:
        job_id = await run_in_threadpool(facade.submit_delete, doc_id)
    except Exception as err:
        raise http_error(err) from err
    return DeleteAccepted(doc_id=doc_id, job_id=job_id)
