"""POST /ingest/files: upload files (text, Markdown, HTML, PDF) as one ingest job, the same job as POST /ingest.

Each file becomes one document whose id is its file name; its kind is told by its bytes (`Facade.read_file`), its
title and page count go into the document's metadata. Bounds: at most KVSTITCH_MAX_UPLOAD_FILES files (422
naming `files`), each at most KVSTITCH_MAX_UPLOAD_FILE_MB (413 naming the file), the whole body at most
KVSTITCH_MAX_REQUEST_MB (413); a file that cannot be read is a 422 naming it. Nothing is queued unless every file
is good.

Reading a file to text runs in a child process bounded by KVSTITCH_EXTRACT_TIMEOUT_S (`Facade.read_file`); while it
runs the client is watched, and a client that leaves stops it at once (the child is killed). A client gone before
the job is queued gets no job: nothing of its upload is ingested.
"""

from __future__ import annotations

import asyncio
import re
import threading
from typing import Annotated

from fastapi import APIRouter, File, HTTPException, Request, UploadFile, status
from fastapi.concurrency import run_in_threadpool

from service.api.answers import CLIENT_CLOSED_REQUEST, DISCONNECT_POLL_S
from service.api.deps import FacadeDep, field_error, http_error
from service.api.openapi import errors
from service.api.schemas import IngestAccepted
from service.facade import Facade
from service.facade.errors import InvalidRequestError
from service.facade.types import MAX_DOC_ID_CHARS, Document

router = APIRouter(tags=["ingest"], responses=errors(401))

_DOCUMENT_INDEX = re.compile(r"documents\[(\d+)\](?:\.text)?")


@router.post(
    "/ingest/files",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=IngestAccepted,
    responses=errors(400, 413, 422, 503),
)
async def ingest_files(
    files: Annotated[list[UploadFile], File(description="text, Markdown, HTML or PDF files; id = file name")],
    facade: FacadeDep,
    request: Request,
) -> IngestAccepted:
    """Queue uploaded files for ingestion as one job; poll GET /ingest/{job_id}."""
    limits = facade.limits
    if len(files) > limits.max_upload_files:
        raise field_error("files", f"at most {limits.max_upload_files} files per upload, got {len(files)}")
    names = [_name(i, upload) for i, upload in enumerate(files)]
    documents = []
    for upload, name in zip(files, names, strict=True):
        data = await _read(upload, name, limits.max_upload_file_bytes)
        documents.append(await _read_while_connected(facade, request, name, data))
    if await request.is_disconnected():  # no one to tell the job id to: nothing is queued
        raise _gone()
    try:
        job_id = await run_in_threadpool(facade.submit_ingest, documents)
    except InvalidRequestError as err:  # name the file, not the document index the job contract uses
        message = _DOCUMENT_INDEX.sub(lambda m: names[int(m.group(1))], err.message)
        raise field_error("files", message) from err
    except Exception as err:
        raise http_error(err) from err
    return IngestAccepted(job_id=job_id)


def _name(index: int, upload: UploadFile) -> str:
    """The document id: the file's base name (browsers send no folders; other clients may)."""
    name = (upload.filename or "").replace("\\", "/").rsplit("/", 1)[-1].strip()
    if not name or len(name) > MAX_DOC_ID_CHARS or not name.isprintable():
        raise field_error("files", f"files[{index}] needs a printable file name of 1-{MAX_DOC_ID_CHARS} characters")
    return name


async def _read(upload: UploadFile, name: str, limit: int) -> bytes:
    data = await upload.read(limit + 1)
    if len(data) > limit:
        raise HTTPException(
            status.HTTP_413_CONTENT_TOO_LARGE, detail=f"{name}: larger than the {limit // 2**20} MiB a file may be"
        )
    if not data.strip():
        raise field_error("files", f"{name}: the file is empty")
    return data


async def _read_while_connected(facade: Facade, request: Request, name: str, data: bytes) -> Document:
    """The file read to a document, checking every DISCONNECT_POLL_S that the client is still there; a client gone
    stops the reading (499). A file that cannot be read, or not in time, is a 422 naming `files`."""
    stop = threading.Event()
    reading = asyncio.ensure_future(run_in_threadpool(facade.read_file, name, data, stop.is_set))
    while not reading.done():
        await asyncio.wait({reading}, timeout=DISCONNECT_POLL_S)
        if not reading.done() and await request.is_disconnected():
            stop.set()  # the reading process is killed within a poll of the reader
            await asyncio.wait({reading})
            if not reading.cancelled():
                reading.exception()  # its error (the stop) is expected: retrieved, so nothing logs it
            raise _gone()
    try:
        return reading.result()
    except InvalidRequestError as err:
        raise http_error(err) from err


def _gone() -> HTTPException:
    return HTTPException(CLIENT_CLOSED_REQUEST, detail="the client closed the request; nothing was queued")
