"""The service's errors as the HTTP layer maps them to statuses (422, 413, 404, 409, 503).

They are defined in `service.errors`, a module that imports nothing, because the core raises some of them too
(retrieval raises `UnavailableError` when Qdrant or the embedding process is away) and the core never imports the
facade; this module is where the HTTP layer takes them from.
"""

from __future__ import annotations

from service.errors import (
    BusyError,
    InvalidRequestError,
    JobFinishedError,
    NotReadyError,
    TooLargeError,
    UnavailableError,
    UnknownDocumentError,
    UnknownJobError,
)

__all__ = [
    "BusyError",
    "InvalidRequestError",
    "JobFinishedError",
    "NotReadyError",
    "TooLargeError",
    "UnavailableError",
    "UnknownDocumentError",
    "UnknownJobError",
]
