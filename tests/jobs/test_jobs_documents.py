"""The job payloads both sides share: ingest and delete jobs, their sequence numbers, and refusals naming the
field."""

from __future__ import annotations

import re
from typing import Any

import pytest

from service.jobs.documents import DeleteJob, Document, DocumentLimits, IngestJob, JobError, parse_job

LIMITS = DocumentLimits()


def test_ingest_and_delete_jobs_survive_their_payloads() -> None:
    ingest = IngestJob("j1", (Document("a", "text"), Document("b", "more")), {"a": 3, "b": 1})
    delete = DeleteJob("j2", "a", {"a": 4})
    assert parse_job(ingest.to_payload(), LIMITS) == ingest
    assert parse_job(delete.to_payload(), LIMITS) == delete
    assert delete.to_payload()["kind"] == "delete"


def test_a_payload_from_an_older_version_is_an_unordered_ingest() -> None:
    job = parse_job({"job_id": "old", "documents": [{"id": "a", "text": "t"}]}, LIMITS)
    assert isinstance(job, IngestJob) and job.sequence == {}


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({"job_id": "j", "kind": "rename", "doc_id": "a"}, "kind must be one of ingest, delete"),
        ({"job_id": "j", "kind": "delete"}, "doc_id must be a non-blank string"),
        ({"job_id": "j", "kind": "delete", "doc_id": "a\x00"}, "doc_id must not contain control characters"),
        ({"job_id": "j", "kind": "delete", "doc_id": "a", "sequence": {"b": 1}}, "not a document of this job"),
        ({"job_id": "j", "kind": "delete", "doc_id": "a", "sequence": {"a": 0}}, "must be a positive integer"),
        ({"job_id": "j", "kind": "delete", "doc_id": "a", "sequence": {"a": True}}, "must be a positive integer"),
        ({"job_id": "j", "kind": "delete", "doc_id": "a", "sequence": [1]}, "sequence must be an object"),
        (
            {"job_id": "j", "documents": [{"id": "a", "text": "t"}], "sequence": {"a": "1"}},
            "must be a positive integer",
        ),
    ],
)
def test_malformed_job_fields_are_refused_by_name(payload: dict[str, Any], message: str) -> None:
    with pytest.raises(JobError, match=message):
        parse_job(payload, LIMITS)


def test_the_rest_of_a_job_carries_its_counts_and_the_whole_jobs_size() -> None:
    job = IngestJob("j1", tuple(Document(d, "text") for d in "abcd"), {"a": 1, "b": 2, "c": 3, "d": 4})
    rest = job.rest(3, {"documents_done": 3, "chunks": 7, "chunks_precomputed": 5, "chunks_reused": 2})

    assert [d.id for d in rest.documents] == ["d"] and rest.sequence == {"d": 4}
    assert rest.total_documents == 4 and rest.progress["documents_done"] == 3
    assert parse_job(rest.to_payload(), LIMITS) == rest
    assert rest.rest(0, {"documents_done": 3}).total_documents == 4  # the size stays the whole job's


@pytest.mark.parametrize(
    ("progress", "message"),
    [
        ([3], "progress must be an object"),
        ({"documents_done": -1}, "progress['documents_done'] must be a non-negative integer"),
        ({"documents_done": True}, "progress['documents_done'] must be a non-negative integer"),
        ({"blocks": 1}, "progress names 'blocks'"),
    ],
)
def test_carried_progress_is_checked_naming_the_field(progress: Any, message: str) -> None:
    payload = {"job_id": "j", "documents": [{"id": "a", "text": "t"}], "progress": progress}
    with pytest.raises(JobError, match=re.escape(message)):
        parse_job(payload, LIMITS)
