"""QA data sets as JSONL: one `{"question": str, "chunks": [str, ...], "answers": [str, ...]}` per line.

Chunks are in stitching order; any listed answer counts. A string `id` is kept (it names the sample in an answers
file); other fields (the number of hops, a source) are kept out of the sample but allowed, so files can carry
metadata. Errors name the file, the line and the field,
because a data set of thousands of lines is fixed by hand.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.quality.metrics import normalize_answer


class QADataError(ValueError):
    """A line of a QA file that cannot be used; the message names the file, line and field."""


@dataclass(frozen=True)
class QASample:
    question: str
    chunks: tuple[str, ...]
    answers: tuple[str, ...]
    line: int  # 1-based line number in its file, for messages about this sample later on
    id: str | None = None


def _strings(record: dict[str, Any], field: str, where: str) -> tuple[str, ...]:
    value = record.get(field)
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v.strip() for v in value):
        raise QADataError(f'{where}: "{field}" must be a non-empty list of strings')
    return tuple(value)


def parse_line(text: str, line: int, source: str = "data") -> QASample:
    """One JSONL line as a sample, or `QADataError` naming `source`, `line` and the offending field."""
    where = f"{source} line {line}"
    try:
        record = json.loads(text)
    except json.JSONDecodeError as err:
        raise QADataError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(record, dict):
        raise QADataError(f"{where}: must be a JSON object with question, chunks and answers")
    question = record.get("question")
    if not isinstance(question, str) or not question.strip():
        raise QADataError(f'{where}: "question" must be a non-empty string')
    chunks = _strings(record, "chunks", where)
    answers = _strings(record, "answers", where)
    for index, answer in enumerate(answers):
        if not normalize_answer(answer):
            # It would match every prediction (an empty string is contained in everything).
            raise QADataError(f'{where}: "answers"[{index}] {answer!r} is empty after answer normalisation')
    sample_id = record.get("id")
    if sample_id is not None and not isinstance(sample_id, str | int):
        raise QADataError(f'{where}: "id" must be a string or a number')
    return QASample(question, chunks, answers, line, None if sample_id is None else str(sample_id))


def read_samples(path: str | Path, limit: int | None = None, offset: int = 0) -> list[QASample]:
    """Every sample of a JSONL file (blank lines skipped); with `offset` and `limit`, the `limit` samples after
    the first `offset` (a shard).

    The whole file is checked even with a limit: a broken file is reported before any model time is spent.
    """
    source = Path(path)
    samples = list(_parse_lines(source))
    if not samples:
        raise QADataError(f"{source.name}: no samples")
    return window(samples, offset, limit, source.name)


def window(items: list[Any], offset: int, limit: int | None, source: str, noun: str = "samples") -> list[Any]:
    """items[offset : offset + limit]; QADataError when the offset leaves nothing."""
    if offset < 0 or (limit is not None and limit < 1):
        raise ValueError("the offset must be at least 0 and the limit at least 1")
    if offset >= len(items):
        raise QADataError(f"{source}: --offset {offset} leaves nothing of its {len(items)} {noun}")
    return items[offset:] if limit is None else items[offset : offset + limit]


def _parse_lines(source: Path) -> Iterator[QASample]:
    # Read as bytes and decode line by line: a text stream decodes ahead in blocks, so its error would name
    # the wrong line.
    with source.open("rb") as lines:
        for number, raw in enumerate(lines, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise QADataError(f"{source.name} line {number}: not UTF-8 text") from None
            if text.strip():
                yield parse_line(text, number, source.name)
