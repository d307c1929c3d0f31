"""The recompute a model was measured to need: `kvstitch eval --recommend` writes it beside the model's weights, and
a server whose `KVSTITCH_RECOMPUTE` is `measured` (the default) gives it to the turbo answers that name none.

Why per model and not one fixed default: what plain turbo costs in answers depends on the model (TurboRAG's 7B
models keep ~95 % of naive's accuracy, SmolLM2-135M keeps 44 %: docs/quality.md), while every recompute costs time
to the first token (`selective:0.25` is 8x plain turbo's at 8K). So the measurement on the user's own model decides,
and only for the weights, dtype and chunk context it was made with; otherwise the default is `none`, and the
start-up log and `/readyz` say why (a default silently not applied is the failure users report most).

The file is plain JSON (never unpickled), bounded in size, checked field by field, written atomically.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from service.engine.recompute_spec import NO_RECOMPUTE, RecomputeSpec, parse_recompute
from service.quality.atomic_file import replace_lines

MEASURED = "measured"  # the KVSTITCH_RECOMPUTE value that reads the model folder's measurement
MEASURED_FILE = "kvstitch-measured.json"
FORMAT = "kvstitch-measured-recompute/1"
MAX_FILE_BYTES = 256 * 1024  # a measurement is a few hundred bytes; anything larger is not one
DEFAULT_KEEP = 0.85  # the share of naive's accuracy a default must keep (issue 26's training-free target)
CHUNK_CONTEXTS = ("alone", "prefix")


class MeasuredFileError(ValueError):
    """A measurement file that cannot be trusted: named, with what is wrong."""


@dataclass(frozen=True)
class Candidate:
    """One turbo row the eval measured: its recompute and chunk context, accuracy and the share of naive's kept."""

    recompute: str
    chunk_context: str
    accuracy: float
    kept: float


@dataclass(frozen=True)
class MeasuredRecompute:
    """What `kvstitch eval --recommend` found: the chosen setting, whether it kept `keep` of naive's accuracy, for
    which model (`fingerprint`: weights, config and dtype) and on what evidence (`candidates`, `samples`)."""

    recompute: str
    chunk_context: str
    met: bool
    keep: float
    fingerprint: str
    dtype: str
    samples: int
    naive_accuracy: float
    data: str
    candidates: tuple[Candidate, ...]

    @property
    def chosen(self) -> Candidate:
        chosen = (self.recompute, self.chunk_context)
        return next(c for c in self.candidates if (c.recompute, c.chunk_context) == chosen)

    def as_json(self) -> dict[str, Any]:
        return {"format": FORMAT, **asdict(self), "candidates": [asdict(c) for c in self.candidates]}


def choose(candidates: Sequence[Candidate], keep: float = DEFAULT_KEEP) -> tuple[Candidate, bool]:
    """The first recompute, in the order measured (cheapest first, as the user lists them), of which some chunk
    context keeps at least `keep` of naive's accuracy (the more accurate context of that recompute); when none
    does, the most accurate candidate, and False. Quality first: a default that keeps too little is never chosen
    over one that keeps more."""
    if not candidates:
        raise ValueError("no turbo reordered row was measured: nothing to choose from")
    for recompute in dict.fromkeys(c.recompute for c in candidates):
        passing = [c for c in candidates if c.recompute == recompute and c.kept >= keep]
        if passing:
            return max(passing, key=lambda c: c.accuracy), True
    return max(candidates, key=lambda c: c.accuracy), False


def measured_path(model: str | Path) -> Path:
    return Path(model) / MEASURED_FILE


def write_measured(model_dir: Path, measured: MeasuredRecompute) -> Path:
    """Write `measured` beside the model's weights, atomically (a reader sees the old file or the new one)."""
    path = measured_path(model_dir)
    replace_lines(path, json.dumps(measured.as_json(), indent=2).splitlines())
    return path


def read_measured(path: Path) -> MeasuredRecompute:
    """The measurement in `path`; MeasuredFileError naming the file and what is wrong with it."""
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as err:
        raise MeasuredFileError(f"{path}: cannot read it: {err}") from err
    if len(raw) > MAX_FILE_BYTES:
        raise MeasuredFileError(f"{path}: larger than {MAX_FILE_BYTES} bytes: not a kvstitch measurement")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise MeasuredFileError(f"{path}: not JSON: {err}") from err
    try:
        return _parsed(data)
    except (KeyError, TypeError, ValueError) as err:
        raise MeasuredFileError(f"{path}: {err} (write it again with kvstitch eval --recommend)") from err


def _parsed(data: Any) -> MeasuredRecompute:
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"its format is not {FORMAT!r}")
    candidates = data["candidates"]
    if not isinstance(candidates, list) or not 1 <= len(candidates) <= 1000:
        raise ValueError("candidates must be a list of 1..1000 rows")
    measured = MeasuredRecompute(
        recompute=_spec(data["recompute"]),
        chunk_context=_context(data["chunk_context"]),
        met=_typed(data, "met", bool),
        keep=_share(data["keep"], "keep"),
        fingerprint=_typed(data, "fingerprint", str),
        dtype=_typed(data, "dtype", str),
        samples=_typed(data, "samples", int),
        naive_accuracy=_share(data["naive_accuracy"], "naive_accuracy"),
        data=_typed(data, "data", str),
        candidates=tuple(_candidate(c) for c in candidates),
    )
    if measured.samples < 1:
        raise ValueError("samples must be at least 1")
    chosen = (measured.recompute, measured.chunk_context)
    if not any((c.recompute, c.chunk_context) == chosen for c in measured.candidates):
        raise ValueError("the chosen setting is none of its candidates")
    return measured


def _candidate(row: Any) -> Candidate:
    if not isinstance(row, dict):
        raise TypeError("every candidate must be an object")
    kept = row["kept"]
    if not isinstance(kept, (int, float)) or isinstance(kept, bool) or not math.isfinite(kept) or kept < 0:
        raise ValueError(f"a candidate's kept must be a number ≥ 0, not {kept!r}")
    accuracy = _share(row["accuracy"], "accuracy")
    return Candidate(_spec(row["recompute"]), _context(row["chunk_context"]), accuracy, float(kept))


def _typed(data: dict[str, Any], name: str, kind: type) -> Any:
    value = data[name]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise TypeError(f"{name} must be a {kind.__name__}, not {type(value).__name__}")
    return value


def _share(value: Any, name: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be a number within 0..1, not {value!r}")
    return float(value)


def _spec(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"a recompute must be a string, not {type(value).__name__}")
    return str(parse_recompute(value))


def _context(value: Any) -> str:
    if value not in CHUNK_CONTEXTS:
        raise ValueError(f"chunk_context must be one of {', '.join(CHUNK_CONTEXTS)}, not {value!r}")
    return str(value)


@dataclass(frozen=True)
class DefaultRecompute:
    """The recompute turbo answers naming none get, and why (the start-up log and `/readyz`); `unapplied`: a
    measurement was found but is for other weights, dtype or chunk context (a warning, never a silent `none`)."""

    spec: RecomputeSpec
    source: str
    unapplied: bool = False

    def as_json(self) -> dict[str, str]:
        return {"spec": str(self.spec), "source": self.source}


def default_recompute(setting: str, model: str, fingerprint: str, chunk_context: str) -> DefaultRecompute:
    """`setting` (KVSTITCH_RECOMPUTE) as it serves: a spec as given, or for `measured` the model folder's
    measurement where it was made on these weights and dtype (`fingerprint`) and this chunk context, else `none`
    with the reason. MeasuredFileError where the folder holds a file that is no measurement (start-up fails,
    naming it: a corrupt file is not silently ignored)."""
    if setting != MEASURED:
        return DefaultRecompute(parse_recompute(setting), f"KVSTITCH_RECOMPUTE={setting}")
    path = measured_path(model)
    if not path.is_file():
        reason = f"no {MEASURED_FILE} beside the model (kvstitch eval --recommend writes it)"
        return DefaultRecompute(NO_RECOMPUTE, f"measured: {reason}")
    measured = read_measured(path)
    if measured.fingerprint != fingerprint:
        reason = f"{path} was measured on other weights or another dtype ({measured.dtype}); measure again"
        return DefaultRecompute(NO_RECOMPUTE, f"measured: not applied: {reason}", unapplied=True)
    if measured.chunk_context != chunk_context:
        reason = f"{path} was measured with chunk context {measured.chunk_context}, this server's is {chunk_context}"
        return DefaultRecompute(NO_RECOMPUTE, f"measured: not applied: {reason}", unapplied=True)
    chosen = measured.chosen
    verdict = "" if measured.met else f", below the {measured.keep:.0%} asked: consider mode naive"
    evidence = f"kept {chosen.kept:.0%} of naive's accuracy on {measured.samples} samples{verdict}"
    return DefaultRecompute(parse_recompute(measured.recompute), f"measured: {path}: {evidence}")
