"""POST /retrieve: the ranked chunks for a question, with their documents' metadata, pages and headings; nothing is
generated (what a LangChain or LlamaIndex retriever calls)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from service.api.deps import FacadeDep, http_error
from service.api.openapi import errors
from service.api.schemas import RetrieveIn
from service.api.validation import retrieve_request

NO_MATCH = "no chunk matches the filter"
router = APIRouter(tags=["retrieve"], responses=errors(401))


@router.post("/retrieve", responses=errors(400, 413, 422, 503))
async def retrieve(body: RetrieveIn, facade: FacadeDep) -> dict[str, Any]:
    """The `top_k` chunks for the question, best first (hybrid or dense search, within the filter)."""
    try:
        request = retrieve_request(facade.limits.answer, body.question, body.top_k, body.filter, body.hybrid)
        chunks = await facade.retrieve(request)
    except Exception as err:
        raise http_error(err) from err
    note = {"note": NO_MATCH} if body.filter is not None and not chunks else {}
    return {"chunks": chunks, **note}
