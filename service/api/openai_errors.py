"""Errors under /v1 in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`, whatever raised them.

OpenAI clients (the official SDK, LangChain) read that body to name the problem: `param` is the request field
(OpenAI's names, `max_tokens` rather than the engine's `max_new_tokens`), `code` a short string or null. Routing's
404 and 405, the body limit's 413, the API key's 401, the service's 503 and anything unexpected (500) all come this
way under /v1; elsewhere FastAPI's own `{"detail": ...}` stays.

A body the server refuses is a 400 under /v1, as OpenAI answers it (FastAPI's 422 elsewhere): JSON that does not
parse (`param` null, no character offset), unknown fields ("Unrecognized request argument supplied: topk", `param`
null, as OpenAI words it), or a value malformed or out of bounds (`param` the field).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException

from service.api.validation import safe_errors

log = logging.getLogger(__name__)

# The `code` of an error that names none itself, by status.
CODES = {
    401: "invalid_api_key",
    404: "unknown_url",
    405: "method_not_allowed",
    413: "request_too_large",
    503: "service_unavailable",
}
INVALID_VALUE = "invalid_value"
NOT_JSON = "We could not parse the JSON body of your request: it is not valid JSON."
# The service's field names in the OpenAI API's words.
OPENAI_FIELDS = {"max_new_tokens": "max_tokens", "question": "messages", "history": "messages"}


class OpenAIError(HTTPException):
    """An error a /v1 route raises knowing its field and code (a 400 for an unsupported option, a 404 for an
    unknown model)."""

    def __init__(self, status_code: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(status_code, detail=message)
        self.param = param
        self.code = code


def error_body(status_code: int, message: str, param: str | None, code: str | None = None) -> dict[str, object]:
    kind = "server_error" if status_code >= 500 else "invalid_request_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code or CODES.get(status_code)}}


def install(app: FastAPI) -> None:
    """Handlers that answer in OpenAI's shape under /v1 and leave every other path as it was."""

    # Starlette's HTTPException, the parent of FastAPI's: FastAPI raises the parent itself for a body it cannot
    # parse (400), and so does routing (404, 405), and those must come in OpenAI's shape under /v1 too.
    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        if not _under_v1(request):
            return await http_exception_handler(request, exc)
        status = 400 if exc.status_code == 422 else exc.status_code  # a value out of the settings' bounds
        if isinstance(exc, OpenAIError):
            message, param, code = str(exc.detail), exc.param, exc.code
        else:
            message, param = _message_of(exc.detail)
            code = INVALID_VALUE if exc.status_code == 422 else None
            if exc.status_code == 404 and exc.detail == "Not Found":  # routing's: no such operation
                message = f"unknown URL: {request.method} {request.url.path}"
        reply = JSONResponse(error_body(status, message, param, code), status_code=status)
        reply.headers.update(exc.headers or {})
        return reply

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        # FastAPI's own handler echoes the refused input, which may be NaN or a lone surrogate: a 500 from the
        # JSON encoder instead of the 422. These errors are made writable first.
        errors = safe_errors(exc.errors())
        if not _under_v1(request):
            return JSONResponse({"detail": errors}, status_code=422)
        return JSONResponse(_refused_body(errors), status_code=400)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        log.error("unhandled error on %s", request.url.path, exc_info=exc)
        if not _under_v1(request):
            return PlainTextResponse("Internal Server Error", status_code=500)
        return JSONResponse(error_body(500, f"{type(exc).__name__}: {exc}", None), status_code=500)


def _refused_body(errors: list[Any]) -> dict[str, object]:
    """OpenAI's 400 for a body it will not take: not JSON, then unknown fields, then the values."""
    if any(error.get("type") == "json_invalid" for error in errors):
        return error_body(400, NOT_JSON, None)
    unknown = [_dotted(error["loc"][1:]) for error in errors if error.get("type") == "extra_forbidden"]
    unknown = [name for name in unknown if name]  # a name that is no text is refused on the body, below
    if unknown:
        arguments = "argument" if len(unknown) == 1 else "arguments"
        return error_body(400, f"Unrecognized request {arguments} supplied: {', '.join(unknown)}", None)
    message, param = _message_of(errors)
    return error_body(400, message, param, INVALID_VALUE)


def _dotted(loc: list[Any] | tuple[Any, ...]) -> str:
    return ".".join(str(part) for part in loc)


def _under_v1(request: Request) -> bool:
    return request.url.path == "/v1" or request.url.path.startswith("/v1/")


def _message_of(detail: object) -> tuple[str, str | None]:
    """A readable message (and the field, in OpenAI's words) from a FastAPI detail: a string or a list of
    {loc, msg}."""
    if isinstance(detail, list) and detail and isinstance(detail[0], dict):

        def field(error: dict[str, object]) -> str:
            loc = error.get("loc", ())
            parts = [str(p) for p in (loc if isinstance(loc, list | tuple) else ())[1:]]
            if parts:
                parts[0] = OPENAI_FIELDS.get(parts[0], parts[0])
            return ".".join(parts)

        first = field(detail[0]) or None
        return "; ".join(f"{field(e)}: {e.get('msg')}" for e in detail), first
    return str(detail), None
