"""A stored document as the listing reports it, as a plain value (no Qdrant here, so the facade's types can carry
it without importing a client)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class DocumentSummary:
    """One stored document: its current version, chunks and tokens, when it was written, its metadata."""

    id: str
    version: str
    chunks: int
    tokens: int
    ingested_at: float | None  # None for points written before the time was recorded
    metadata: dict[str, Any] = field(default_factory=dict)
