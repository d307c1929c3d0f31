"""Errors the core raises to its callers (the HTTP layer, the CLI), each meaning one answer to the client."""

from __future__ import annotations


class NotReadyError(RuntimeError):
    """The service is still starting (or its start failed): try again later."""


class BusyError(RuntimeError):
    """The line in front of the engine is full: try again shortly."""


class UnavailableError(RuntimeError):
    """A backing service (Qdrant, the KV index, the job queue) cannot be reached; the request may be retried."""

    def __init__(self, component: str, error: BaseException | str) -> None:
        reason = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        super().__init__(f"{component} is unreachable: {reason}")
        self.component = component


class InvalidRequestError(ValueError):
    """A request field is out of the bounds the settings allow; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class UnknownDocumentError(LookupError):
    """No document with this id was ever ingested or submitted."""


class TooLargeError(InvalidRequestError):
    """A request over a size bound (a job's tokens over KVSTITCH_MAX_JOB_TOKENS): 413, naming the field."""


class UnknownJobError(LookupError):
    """No job with this id (never submitted, or its status expired)."""


class JobFinishedError(RuntimeError):
    """The job already finished (done, failed or cancelled): there is nothing left to cancel."""
