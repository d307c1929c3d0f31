"""Dependencies shared by the routes: the facade, and the service's errors as HTTP statuses (the API key is
checked before routing, `service/api/auth.py`)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, HTTPException, Request, status

from service.facade import Facade
from service.facade.errors import (
    BusyError,
    InvalidRequestError,
    JobFinishedError,
    NotReadyError,
    TooLargeError,
    UnavailableError,
    UnknownDocumentError,
    UnknownJobError,
)


async def get_facade(request: Request) -> Facade:
    """Async though it never waits: FastAPI runs a plain function dependency on its thread pool, a thread hop (and
    a wake-up) per request for one attribute read."""
    facade: Facade = request.app.state.facade
    return facade


FacadeDep = Annotated[Facade, Depends(get_facade)]


def http_error(err: Exception) -> HTTPException:
    """A service error as the status the client should see (500 for anything unexpected)."""
    if isinstance(err, TooLargeError):
        return HTTPException(status.HTTP_413_CONTENT_TOO_LARGE, detail=f"{err.field}: {err.message}")
    if isinstance(err, InvalidRequestError):
        return field_error(err.field, err.message)
    if isinstance(err, NotReadyError):
        return unavailable(f"not ready: {err}")
    if isinstance(err, BusyError):
        return unavailable(str(err), retry_after_s=2)
    if isinstance(err, UnavailableError):
        return unavailable(str(err))
    if isinstance(err, UnknownDocumentError | UnknownJobError):
        return HTTPException(status.HTTP_404_NOT_FOUND, detail=str(err))
    if isinstance(err, JobFinishedError):
        return HTTPException(status.HTTP_409_CONFLICT, detail=str(err))
    return HTTPException(500, detail=f"generation failed: {type(err).__name__}: {err}")


def field_error(field: str, message: str, where: str = "body") -> HTTPException:
    """A 422 shaped like FastAPI's own validation errors, for bounds that come from settings."""
    detail: list[dict[str, Any]] = [{"loc": [where, field], "msg": message, "type": "value_error"}]
    return HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, detail=detail)


def unavailable(message: str, retry_after_s: int = 5) -> HTTPException:
    return HTTPException(
        status.HTTP_503_SERVICE_UNAVAILABLE, detail=message, headers={"Retry-After": str(retry_after_s)}
    )
