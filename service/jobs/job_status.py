"""Where a job stands, as a plain value: what the status stores keep and the HTTP layer shows (no Redis here, so
the facade's types can carry it without importing a client)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class JobStatus:
    """Where a job stands. Timestamps are Unix seconds; `started_at` is the latest start."""

    job_id: str
    status: str
    created_at: float
    updated_at: float
    documents: int = 0
    documents_done: int = 0
    chunks: int = 0
    chunks_done: int = 0  # chunks whose KV is stored (reused at once, computed as their batches finish)
    chunks_precomputed: int = 0
    chunks_reused: int = 0
    chunks_deleted: int = 0
    blocks_released: int = 0
    kind: str = "ingest"
    error: str | None = None
    started_at: float | None = None
    finished_at: float | None = None
