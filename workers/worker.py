"""The worker loop: take a job (ingest or delete) from the queue, run it, record its status, ack it.

Each turn first claims jobs left pending by a worker that went silent for `claim_idle_ms` (it died), then reads
new ones. A job is acked only after its status says done, so a worker killed at any point leaves the job to be
delivered again; the ingest steps are idempotent, so no chunk is lost or doubled. While a job runs, the worker
renews its lease between document groups, so a long job is not claimed away from a live worker.

Failures: a malformed job (`JobError`) fails at once and goes to the dead letters with its error; any other
error re-queues the job, and after `max_attempts` deliveries it is dead-lettered. The status says which. A job
given up on is cleaned (`Ingestor.abandon`): its unpublished points go and the KV blocks no point names are
released. A full data disk (ENOSPC, SQLite's "database or disk is full") fails the job at once, after releasing
what it wrote, so that the failure can be recorded on that disk and the disk does not stay full. Nothing a job
contains can stop the loop.

Stopping (SIGTERM): `stop()` makes the running ingest return between two document groups; the rest of the job is
handed back to the queue (`release`: not acked, the attempt not counted) with the status `queued` and a note, and
the next worker (or the next start, in the embedded form) resumes it; the groups done are not redone.

Taking turns: after each document group, when other jobs wait in the queue, the rest of the running job (its
documents not done, with its counts so far) goes to the end of the queue and the next job runs: jobs take
document groups round-robin, so a small job sent behind a large one waits for one group, not the whole job.

Cancelling (`DELETE /ingest/{id}` marks the status `cancelled`): a queued job is dropped when it is delivered and a
running one stops before its next document is published; either way its unfinished documents are withdrawn
(`Ingestor.withdraw`) and the message is acked.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import sqlite3
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from service.jobs.documents import DeleteJob, DocumentLimits, IngestJob, JobError, job_id_of, parse_job
from service.jobs.queue import Delivery, JobQueue
from service.jobs.status import JobStatusStore
from service.outage import OutageLog
from service.serving.runtime import JobFinished, Runtime
from service.usecases.ingest import (
    DeleteCounts,
    IngestCancelledError,
    IngestCounts,
    IngestInterruptedError,
    Ingestor,
    IngestYieldedError,
    JobControl,
)

log = logging.getLogger(__name__)

DEFAULT_CLAIM_IDLE_MS = 60_000
MAX_ERROR_CHARS = 2000
MAX_CAUSES = 8  # how far down an error's causes `is_no_space` looks
NO_SPACE_TEXTS = ("No space left on device", "database or disk is full", "Disk quota exceeded")


def default_consumer_name() -> str:
    """Unique per process, readable in `XINFO CONSUMERS`."""
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True)
class WorkerConfig:
    name: str
    claim_idle_ms: int = DEFAULT_CLAIM_IDLE_MS
    poll_ms: int = 1000
    limits: DocumentLimits = field(default_factory=DocumentLimits)


class IngestWorker:
    """Consumes ingest jobs until stopped; safe to run in a thread of the gateway (embedded mode)."""

    def __init__(self, ingestor: Ingestor, queue: JobQueue, jobs: JobStatusStore, config: WorkerConfig) -> None:
        self.ingestor = ingestor
        self.queue = queue
        self.jobs = jobs
        self.config = config
        self.stopping = threading.Event()
        self.jobs_done = 0
        self.jobs_failed = 0
        # Called with ("done" | "failed" | "retry", counts or None) as each delivery ends (for metrics).
        self.on_job_finished: Callable[[str, IngestCounts | None], None] | None = None
        queue.on_dead_letter = self._dead_lettered
        # While Redis is away every turn fails, once a second: one warning per outage, not a traceback per turn.
        self._queue_outage = OutageLog(log, f"ingest worker {config.name}: the job queue")

    def run(self) -> None:
        """Work until `stop()`; errors of the queue itself (Redis away) are logged once per outage and retried."""
        log.info("ingest worker %s started", self.config.name)
        while not self.stopping.is_set():
            try:
                self.run_once()
            except Exception as err:
                self._queue_outage.failed(err)
                self.stopping.wait(1.0)
            else:
                self._queue_outage.succeeded()
        log.info("ingest worker %s stopped", self.config.name)

    def stop(self) -> None:
        self.stopping.set()

    def run_once(self) -> int:
        """Handle the stale jobs this worker can claim, else wait up to `poll_ms` for new ones; how many ran."""
        deliveries = self.queue.claim_stale(self.config.name, self.config.claim_idle_ms, count=1)
        if not deliveries:
            deliveries = self.queue.consume(self.config.name, block_ms=self.config.poll_ms, count=1)
        for delivery in deliveries:
            self.handle(delivery)
        return len(deliveries)

    def handle(self, delivery: Delivery) -> None:
        job_id = job_id_of(delivery.payload)
        try:
            job = parse_job(delivery.payload, self.config.limits)
        except JobError as err:
            self._reject(delivery, job_id, str(err))
            return
        documents = job.total_documents if isinstance(job, IngestJob) else 1
        if self._is_cancelled(job.job_id):
            self._drop_cancelled(delivery, job)
            return
        self._status(job.job_id, documents, status="running", error=None, kind=job.kind)
        this_turn = len(job.documents) if isinstance(job, IngestJob) else 1
        log.info("%s job %s: %d documents (attempt %d)", job.kind, job.job_id, this_turn, delivery.attempt)
        try:
            counts = self._run(job, delivery)
        except IngestYieldedError as paused:
            self._take_turns(delivery, job, paused)
        except IngestInterruptedError as stopped:
            self._release(delivery, job, stopped)
        except IngestCancelledError as cancelled:
            self._cancelled(delivery, job.job_id, cancelled.counts)
        except JobError as err:
            self._reject(delivery, job.job_id, str(err))
            self._abandon(job)
        except Exception as err:
            if is_no_space(err):
                self._out_of_space(delivery, job, err)
                return
            log.exception("job %s failed on attempt %d", job.job_id, delivery.attempt)
            self._retry(delivery, job.job_id, f"{type(err).__name__}: {err}")
        else:
            self._done(delivery, job, documents, counts)

    def _run(self, job: IngestJob | DeleteJob, delivery: Delivery) -> IngestCounts | DeleteCounts:
        if isinstance(job, DeleteJob):
            return self.ingestor.delete(job)
        control = JobControl(
            should_stop=self.stopping.is_set,
            should_yield=self._others_waiting,
            cancelled=lambda: self._is_cancelled(job.job_id),
        )
        return self.ingestor.ingest(job, progress=lambda c: self._progress(delivery, job.job_id, c), control=control)

    def _others_waiting(self) -> bool:
        """Whether another job waits for a turn (a queue that cannot say lets the running job go on)."""
        try:
            return self.queue.waiting_count() > 0
        except Exception:
            return False

    def _is_cancelled(self, job_id: str) -> bool:
        try:
            job = self.jobs.get(job_id)
        except Exception:  # the status store is away: go on; the cancel is seen at the next check
            return False
        return job is not None and job.status == "cancelled"

    # ---- outcomes -------------------------------------------------------------------------------------------

    def _done(
        self, delivery: Delivery, job: IngestJob | DeleteJob, documents: int, counts: IngestCounts | DeleteCounts
    ) -> None:
        """Count the job, say it is done, ack it. The counters move first: a client that sees `done` (and then
        scrapes /metrics) must find the job counted. Acked last, so a worker killed before the status is written
        leaves the job to be delivered again (counted twice then: a counter may overcount, a status may not lie)."""
        self.jobs_done += 1
        self._finished("done", counts if isinstance(counts, IngestCounts) else None)
        self._status(job.job_id, documents, status="done", kind=job.kind, **counts.status_fields())
        self.queue.ack(delivery)
        log.info("job %s done: %s", job.job_id, counts)

    def _progress(self, delivery: Delivery, job_id: str, counts: IngestCounts) -> None:
        self.queue.keep_alive(delivery)
        self.jobs.update(job_id, **counts.status_fields())

    def _reject(self, delivery: Delivery, job_id: str | None, error: str) -> None:
        log.warning("job %s rejected: %s", job_id or delivery.message_id, error)
        self.queue.reject(delivery, error)
        self.jobs_failed += 1
        self._finished("failed", None)
        if job_id is not None:
            self._status(job_id, _document_count(delivery), status="failed", error=_clip(error))

    def _release(self, delivery: Delivery, job: IngestJob | DeleteJob, stopped: IngestInterruptedError) -> None:
        documents, counts = _document_count(delivery), stopped.counts
        if isinstance(job, IngestJob):
            self.queue.release(delivery, job.rest(stopped.done, counts.status_fields()).to_payload())
        else:
            self.queue.release(delivery)
        note = f"interrupted after {counts.documents_done} of {documents} documents (the worker stopped); queued again"
        self._finished("retry", None)
        self._status(job.job_id, documents, status="queued", error=note)
        log.info("job %s handed back: %s", job.job_id, note)

    def _take_turns(self, delivery: Delivery, job: IngestJob | DeleteJob, paused: IngestYieldedError) -> None:
        """Other jobs wait: the rest of this one goes to the end of the queue (its status stays `running`)."""
        assert isinstance(job, IngestJob)  # only ingests take turns
        self.queue.release(delivery, job.rest(paused.done, paused.counts.status_fields()).to_payload())
        log.info("job %s: %d documents done, the rest queued behind waiting jobs", job.job_id, paused.done)

    def _drop_cancelled(self, delivery: Delivery, job: IngestJob | DeleteJob) -> None:
        """A job cancelled while it waited: withdraw what earlier turns or a dead worker may have left, ack."""
        try:
            released = self.ingestor.withdraw(job)
        except Exception as err:  # Qdrant or the index away: retried like any failed step, attempts counted
            log.exception("withdrawing cancelled job %s failed", job.job_id)
            self.queue.fail(delivery, f"withdrawing the cancelled job failed: {type(err).__name__}: {err}")
            return
        progress = job.progress if isinstance(job, IngestJob) else {}
        counts = IngestCounts.carried(progress)
        counts.blocks_released = released
        self._cancelled(delivery, job.job_id, counts)

    def _cancelled(self, delivery: Delivery, job_id: str, counts: IngestCounts) -> None:
        self.queue.ack(delivery)
        self.jobs.update(job_id, blocks_released=counts.blocks_released, **counts.status_fields())
        self._finished("cancelled", None)
        log.info("job %s cancelled after %d documents", job_id, counts.documents_done)

    def _out_of_space(self, delivery: Delivery, job: IngestJob | DeleteJob, err: Exception) -> None:
        """The data disk is full: what the job wrote is released first (so the failure itself can be written, on
        the same disk), then it fails for good. A retry would only fill the disk again; sent again once space is
        back, it resumes from what it published (each document is all or nothing)."""
        log.error("job %s: no space left on the data disk (%s); releasing what it wrote", job.job_id, err)
        self._abandon(job)
        message = (
            f"no space left on the data disk ({type(err).__name__}: {err}); the job's unpublished chunks and KV "
            "blocks were released, documents it had finished stay: free space and send it again"
        )
        self._reject(delivery, job.job_id, message)

    def _abandon(self, job: IngestJob | DeleteJob) -> None:
        """Clean what a job given up on left (unpublished points, blocks no point names); never raises."""
        if not isinstance(job, IngestJob):
            return
        try:
            released = self.ingestor.abandon(job)
        except Exception:
            log.exception("cleaning after job %s failed; the next start sweeps what is left", job.job_id)
            return
        if released:
            log.info("job %s given up: %d KV blocks released", job.job_id, released)

    def _retry(self, delivery: Delivery, job_id: str, error: str) -> None:
        dead = self.queue.fail(delivery, error)
        self._finished("failed" if dead else "retry", None)
        if dead:
            self.jobs_failed += 1
            message = f"failed after {delivery.attempt} attempts: {error}"
            self._status(job_id, _document_count(delivery), status="failed", error=_clip(message))
            self._abandon_payload(delivery.payload)
        else:
            message = f"attempt {delivery.attempt} failed, will retry: {error}"
            self._status(job_id, _document_count(delivery), status="queued", error=_clip(message))

    def _dead_lettered(self, data: str, error: str) -> None:
        """A message the queue gave up on by itself (its workers kept dying, or it was unreadable)."""
        try:
            payload = json.loads(data)
        except ValueError:
            return
        job_id = job_id_of(payload) if isinstance(payload, dict) else None
        self.jobs_failed += 1
        self._finished("failed", None)  # before the status says failed, like every outcome (see `_done`)
        if job_id is not None:
            documents = payload.get("documents")
            count = len(documents) if isinstance(documents, list) else 0
            self._status(job_id, count, status="failed", error=_clip(error))
            self._abandon_payload(payload)

    def _abandon_payload(self, payload: dict[str, object]) -> None:
        try:
            job = parse_job(payload, self.config.limits)
        except JobError:
            return  # nothing of it was written: it never got past parsing
        self._abandon(job)

    def _finished(self, outcome: str, counts: IngestCounts | None) -> None:
        if self.on_job_finished is not None:
            try:
                self.on_job_finished(outcome, counts)
            except Exception:
                log.exception("job-finished hook failed")

    def _status(self, job_id: str, documents: int, kind: str = "ingest", **fields: object) -> None:
        """Update the job's status, creating it when the producer did not (or it expired)."""
        if self.jobs.get(job_id) is None:
            with contextlib.suppress(ValueError):  # created meanwhile by the producer
                self.jobs.create(job_id, documents, kind=kind)
        self.jobs.update(job_id, **fields)


def is_no_space(err: BaseException) -> bool:
    """Whether an error, or one it was raised from, says the disk is full (ENOSPC, EDQUOT, SQLite's
    SQLITE_FULL), wherever it came from: a KV file, the SQLite stores, embedded Qdrant."""
    seen: BaseException | None = err
    for _ in range(MAX_CAUSES):
        if seen is None:
            return False
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if isinstance(seen, sqlite3.Error) and getattr(seen, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL:
            return True
        if any(text in str(seen) for text in NO_SPACE_TEXTS):  # wrapped by a library into its own error type
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _document_count(delivery: Delivery) -> int:
    """The whole job's document count (a job taking turns carries it; its payload lists only the rest)."""
    progress = delivery.payload.get("progress")
    if isinstance(progress, dict) and isinstance(progress.get("documents"), int):
        return int(progress["documents"])
    documents = delivery.payload.get("documents")
    return len(documents) if isinstance(documents, list) else 0


def _clip(text: str) -> str:
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 1] + "…"


def in_process_worker(runtime: Runtime, on_job_finished: JobFinished | None = None) -> IngestWorker:
    """The worker `kvstitch serve` runs in a thread of the gateway (embedded form): polls often, so a job sent
    by the chat page starts at once."""
    return runtime_worker(runtime, name="in-process", poll_ms=200, on_job_finished=on_job_finished)


def runtime_worker(
    runtime: Runtime, name: str | None = None, poll_ms: int = 1000, on_job_finished: JobFinished | None = None
) -> IngestWorker:
    """A worker over a runtime's ingestor, queue and job statuses."""
    config = WorkerConfig(
        name=name or default_consumer_name(),
        claim_idle_ms=runtime.settings.job_claim_idle_ms,
        poll_ms=poll_ms,
        limits=runtime.limits,
    )
    worker = IngestWorker(runtime.ingestor(), runtime.queue, runtime.jobs, config)
    worker.on_job_finished = on_job_finished
    return worker
