"""The eval's answers file (`kvstitch eval --answers`): one JSON record per sample per row, appended as each sample
is scored, and read back by `--resume`.

A run cut off by a time limit leaves the samples it finished, each with a record for every row, and at most one
sample with only some rows (the one it was answering). `--resume` keeps the finished samples (their records carry
everything a row of the table reads, so the resumed table covers them too), removes the partial sample's records
by rewriting the file atomically, and answers the rest. A record is matched to its sample as `score_answers`
matches it: by id, or where the sample has none by its line in the data file. Every record carries its run's
fingerprint (`run_fingerprint`): `--resume` refuses the records of a run with other settings, which would otherwise
be tabled as this run's.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.quality.atomic_file import replace_lines
from service.quality.dataset import QADataError

AnswerRecord = dict[str, Any]
AnswerSink = Callable[[AnswerRecord], None]  # receives one record per sample per row

# Every field of a record and the JSON types it may take. `bool` is not an `int` here: types match exactly.
_FIELDS: dict[str, tuple[type, ...]] = {
    "id": (str, type(None)),
    "line": (int,),
    "variant": (str,),
    "answer": (str,),
    "gold": (list,),
    "correct": (bool, type(None)),
    "contains": (bool, type(None)),
    "f1": (float, int, type(None)),
    "reference_correct": (bool, type(None)),
    "first_token_agreement": (bool,),
    "answer_agreement": (bool,),
    "kl_first_token": (float, int),
    "ttft_ms": (float, int, type(None)),  # null: answered in a batch (`--batch N`), not timed
    "run": (str,),  # the settings' fingerprint (`run_fingerprint`)
}
# Why an older eval's record lacks a field, where the generic "an older eval" says too little.
_MISSING_BECAUSE = {
    "run": "written before --resume checked the run's settings, so which run wrote it is unknown: start the run "
    "afresh, without --resume",
}
# Set exactly when the sample has gold answers: the table pairs `correct` with `reference_correct` per sample.
_ANSWER_FIELDS = ("correct", "contains", "f1", "reference_correct")


def sample_key(sample_id: str | None, line: int) -> str:
    """The key a record is matched to its sample by (and `score_answers` reads it by): the id, else the line."""
    return str(sample_id if sample_id is not None else line)


def run_fingerprint(model: str, data: str, max_new_tokens: int, instruction: str, dtype: str) -> str:
    """The fingerprint of the settings that change a file-form eval's answers, which each of its records carries
    (`"run"`): 16 hex digits of the SHA-256 of their canonical JSON. `--resume` keeps only records of its own.

    In: `model` as given (another model, or another checkpoint folder, answers otherwise); the `data` file's name,
    not its folder (the same file resumed from another directory is the same run; the samples' gold answers are
    checked one by one besides); `max_new_tokens` (a longer limit gives longer answers); `instruction` (it is in
    every prompt); `dtype` as loaded, the device's default resolved (fp32 and bf16 part at near ties).
    Out: the device (CPU and GPU runs in fp32 give the same answers, so a GPU run resumed on the CPU is legitimate);
    `--kv-path` and `--batch` (ways to compute the same answers: equal in fp32, tests/quality/
    test_quality_eval_shared.py and test_quality_eval_batch.py); `--offset`/`--limit` (a resume may cover another
    range: each record's sample is checked to be in this one); the rows (`--recompute`, `--chunk-context`,
    `--context-temperature`, `--context-scale`: each record's row label is checked to be one of this run's).
    """
    settings = {
        "model": model,
        "data": Path(data).name,
        "max_new_tokens": max_new_tokens,
        "instruction": instruction,
        "dtype": dtype,
    }
    canonical = json.dumps(settings, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]


def parse_record(text: str, where: str) -> AnswerRecord:
    """One line of an answers file as a record; QADataError naming `where` when it is not one the eval writes."""
    try:
        record = json.loads(text)
    except json.JSONDecodeError as err:
        raise QADataError(f"{where}: not a JSON record ({err.msg})") from None
    if not isinstance(record, dict):
        raise QADataError(f"{where}: not a JSON object")
    for name, types in _FIELDS.items():
        if name not in record:
            why = _MISSING_BECAUSE.get(name, "an answers file of an older eval cannot be resumed")
            raise QADataError(f'{where}: no "{name}" ({why})')
        if type(record[name]) not in types:
            allowed = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            raise QADataError(f'{where}: "{name}" must be {allowed}, not {json.dumps(record[name])}')
    if record["line"] < 1 or not all(isinstance(g, str) for g in record["gold"]):
        raise QADataError(f'{where}: "line" must be at least 1 and "gold" a list of strings')
    if any((record[name] is None) == bool(record["gold"]) for name in _ANSWER_FIELDS):
        raise QADataError(f'{where}: {", ".join(_ANSWER_FIELDS)} must be set exactly when "gold" is not empty')
    return record


def read_answers(path: Path) -> list[tuple[int, str, AnswerRecord]]:
    """(line number, line, record) of every non-blank line; QADataError naming the file and line of any line that
    is not a whole record, a line cut off by a killed write included: none is dropped silently."""
    entries = []
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, start=1):
            where = f"{path} line {number}"
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise QADataError(f"{where}: not UTF-8 text") from None
            if not text.strip():
                continue
            try:
                entries.append((number, text.rstrip("\n"), parse_record(text, where)))
            except QADataError as err:
                cut = "" if text.endswith("\n") else " (the file's last line, without a newline: a cut-off write?)"
                raise QADataError(f"{err}{cut}") from None
    return entries


@dataclass(frozen=True)
class Resume:
    """What `--resume` found in an answers file."""

    kept: list[AnswerRecord]  # the records of every sample all rows answered, in file order: not answered again
    done: frozenset[str]  # those samples' keys
    dropped: int  # records of samples only some rows answered: removed from the file, the samples answered again


NOTHING_TO_RESUME = Resume([], frozenset(), 0)


def resume_answers(path: Path, golds: Mapping[str, Sequence[str]], labels: Sequence[str], run: str) -> Resume:
    """Read an answers file for `--resume` (none yet: nothing to resume). `golds`: each sample of this run's range
    by key, with its gold answers; `labels`: the rows this run produces; `run`: this run's `run_fingerprint`.

    Keeps every sample that all rows answered and rewrites the file without the records of the others. A record
    of a run with other settings, of a sample outside the range, of a row this run does not produce, with other
    gold answers, or a second one of a sample and row, is refused (QADataError naming file and line; the file
    untouched): another run wrote it (other flags, another shard's range, another data file), and scoring it as
    this run's would be wrong.
    """
    if not path.exists():
        return NOTHING_TO_RESUME
    entries = read_answers(path)
    rows: dict[str, set[str]] = {}
    for number, _, record in entries:
        where = f"{path} line {number}"
        key, variant = sample_key(record["id"], record["line"]), record["variant"]
        if record["run"] != run:
            raise QADataError(
                f"{where}: written by a run of other settings (run {record['run']}, this run's is {run}: another "
                "--model, --data file, --max-new-tokens, --instruction or --dtype); resume with that run's settings, "
                "or start afresh without --resume"
            )
        if key not in golds:
            raise QADataError(f"{where}: sample {key} is not in this run's --offset/--limit range")
        if variant not in labels:
            raise QADataError(f"{where}: row {variant} is not one of this run's ({', '.join(labels)})")
        if record["gold"] != list(golds[key]):
            raise QADataError(f"{where}: sample {key}'s gold answers differ from the data file's")
        if variant in rows.setdefault(key, set()):
            raise QADataError(f"{where}: sample {key} of row {variant} is in the file twice")
        rows[key].add(variant)
    done = frozenset(key for key, answered in rows.items() if answered == set(labels))
    kept = [(text, record) for _, text, record in entries if sample_key(record["id"], record["line"]) in done]
    if len(kept) < len(entries) or not _ends_with_newline(path):  # an append must start on a line of its own
        replace_lines(path, [text for text, _ in kept])
    return Resume([record for _, record in kept], done, len(entries) - len(kept))


def _ends_with_newline(path: Path) -> bool:
    with path.open("rb") as data:
        if data.seek(0, os.SEEK_END) == 0:
            return True
        data.seek(-1, os.SEEK_END)
        return data.read(1) == b"\n"


@contextlib.contextmanager
def answers_sink(path: Path, append: bool, run: str | None = None) -> Iterator[AnswerSink]:
    """A writer of records to `path`, one JSON line each, flushed as written (a stopped run keeps what it
    finished); the file is emptied first unless `append` (a resumed run). `run`: the `run_fingerprint` each
    record gets as `"run"` (None: none, as the corpus form, which cannot be resumed, writes them)."""
    stamp = {} if run is None else {"run": run}
    with path.open("a" if append else "w", encoding="utf-8") as out:

        def write(record: AnswerRecord) -> None:
            out.write(json.dumps({**record, **stamp}, ensure_ascii=False) + "\n")
            out.flush()

        yield write
