"""GET /documents (paged), GET /documents/{doc_id}, and DELETE /documents/{doc_id}: queue a document's removal
behind every earlier job for it."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, status
from fastapi.concurrency import run_in_threadpool

from service.api.deps import FacadeDep, http_error
from service.api.openapi import errors
from service.api.schemas import DeleteAccepted, DocumentList, DocumentOut

router = APIRouter(tags=["documents"], responses=errors(401))
MAX_PAGE = 1000
DocId = Annotated[str, Path(max_length=256)]


@router.get("/documents", response_model=DocumentList, responses=errors(422, 503))
async def list_documents(
    facade: FacadeDep,
    offset: Annotated[int, Query(ge=0, le=10_000_000)] = 0,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 100,
) -> DocumentList:
    """The stored documents sorted by id: version, chunks, tokens, ingested time, metadata."""
    try:
        page = await run_in_threadpool(facade.list_documents, offset, limit)
    except Exception as err:
        raise http_error(err) from err
    documents = [DocumentOut.model_validate(d, from_attributes=True) for d in page.documents]
    return DocumentList(total=page.total, offset=page.offset, documents=documents)


@router.get("/documents/{doc_id:path}", response_model=DocumentOut, responses=errors(404, 422, 503))
async def get_document(doc_id: DocId, facade: FacadeDep) -> DocumentOut:
    """One stored document; 404 when it is not stored."""
    try:
        document = await run_in_threadpool(facade.get_document, doc_id)
    except Exception as err:
        raise http_error(err) from err
    return DocumentOut.model_validate(document, from_attributes=True)


@router.delete(
    "/documents/{doc_id:path}",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=DeleteAccepted,
    responses=errors(404, 422, 503),
)
async def delete_document(doc_id: DocId, facade: FacadeDep) -> DeleteAccepted:
    """Remove a document's chunks and release KV blocks no other document uses; poll GET /ingest/{job_id}.
    Ordered after any ingest of the same document sent before it; 404 for a document never ingested."""
    try:
        job_id = await run_in_threadpool(facade.submit_delete, doc_id)
    except Exception as err:
        raise http_error(err) from err
    return DeleteAccepted(doc_id=doc_id, job_id=job_id)
