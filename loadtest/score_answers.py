"""Score `kvstitch eval --answers` files together: the shards of one run, side by side with another model's run.

An eval split into shards (`--offset`/`--limit`, run side by side on one GPU) writes one answers file per shard,
and each shard's table is tested on its own few samples. This joins the files and tests every row against one
reference row over all samples: accuracy, share of the reference's kept, the paired difference with its bootstrap
95 % CI and McNemar's exact p (`service.quality.significance`), and first-token agreement with the row's own run's
naive answer.

    python -m loadtest.score_answers "base=base_*.jsonl" "tuned=tuned_*.jsonl" --reference base:naive/-/none

Each argument is `NAME=GLOB` (or a bare glob, named by its first file; the glob is in the file name only);
`--reference NAME:VARIANT` names the row the others are paired against (default: the first run's naive row).
Rows whose samples differ from the reference's are reported as such, not tested; `--common` instead scores every
row on the samples that every row answered (a run cut off by a time limit), and says how many that is.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from service.quality.significance import paired

NAIVE = "naive/-/none"


@dataclass(frozen=True)
class Scored:
    run: str
    variant: str
    samples: int
    accuracy: float
    kept: float
    difference: float
    ci_low: float
    ci_high: float
    p_value: float
    first_token_agreement: float


def read_run(paths: list[str]) -> dict[str, dict[str, dict[str, object]]]:
    """{variant: {sample id: record}} over every file; a sample twice in one variant is an error (overlapping
    shards)."""
    rows: dict[str, dict[str, dict[str, object]]] = {}
    for path in paths:
        for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            record = json.loads(line)
            key = str(record["id"] if record.get("id") is not None else record["line"])
            variant = rows.setdefault(str(record["variant"]), {})
            if key in variant:
                raise ValueError(f"{path}:{number}: sample {key} of {record['variant']} is in two files")
            variant[key] = record
    return rows


def score(runs: dict[str, dict[str, dict[str, dict[str, object]]]], reference: tuple[str, str]) -> list[Scored]:
    """Every row of every run against the reference row, on the reference's samples in one order."""
    ref = runs[reference[0]][reference[1]]
    ids = sorted(ref)
    truth = [bool(ref[i]["correct"]) for i in ids]
    scored = []
    for run, rows in runs.items():
        for variant, records in rows.items():
            if set(records) != set(ids):
                print(f"{run} {variant}: {len(records)} samples, not the reference's {len(ids)}; not tested")
                continue
            got = [bool(records[i]["correct"]) for i in ids]
            test = paired(got, truth)
            agree = sum(bool(records[i]["first_token_agreement"]) for i in ids) / len(ids)
            accuracy = sum(got) / len(got)
            kept = accuracy / (sum(truth) / len(truth)) if any(truth) else float("nan")
            scored.append(
                Scored(
                    run,
                    variant,
                    len(ids),
                    accuracy,
                    kept,
                    test.difference,
                    test.ci_low,
                    test.ci_high,
                    test.p_value,
                    agree,
                )
            )
    return scored


def common_samples(runs: dict[str, dict[str, dict[str, dict[str, object]]]]) -> set[str]:
    """The ids of the samples that every row of every run answered."""
    rows = [set(records) for variants in runs.values() for records in variants.values()]
    return set.intersection(*rows) if rows else set()


def on_common_samples(
    runs: dict[str, dict[str, dict[str, dict[str, object]]]],
) -> tuple[dict[str, dict[str, dict[str, dict[str, object]]]], int, int]:
    """`runs` cut to the samples every row of every run answered, with how many those are and how many samples any
    row answered (equal when no row lacks one)."""
    answered = set().union(*(set(records) for rows in runs.values() for records in rows.values()))
    common = common_samples(runs)
    return restricted(runs, common), len(common), len(answered)


def restricted(
    runs: dict[str, dict[str, dict[str, dict[str, object]]]], ids: set[str]
) -> dict[str, dict[str, dict[str, dict[str, object]]]]:
    """`runs` with every row cut to the samples in `ids`."""
    return {
        run: {variant: {key: rec for key, rec in records.items() if key in ids} for variant, records in rows.items()}
        for run, rows in runs.items()
    }


def table(scored: list[Scored]) -> str:
    lines = [
        "| run | row | n | accuracy | kept | Δ vs reference [95 % CI] | p | first token = naive |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in scored:
        lines.append(
            f"| {s.run} | {s.variant} | {s.samples} | {s.accuracy:.3f} | {s.kept:.0%} | {s.difference:+.3f} "
            f"[{s.ci_low:+.3f}, {s.ci_high:+.3f}] | {s.p_value:.2g} | {s.first_token_agreement:.3f} |"
        )
    return "\n".join(lines)


def parse_runs(arguments: list[str]) -> dict[str, list[str]]:
    runs: dict[str, list[str]] = {}
    for argument in arguments:
        name, _, pattern = argument.rpartition("=")
        where = Path(pattern)
        paths = sorted(str(p) for p in where.parent.glob(where.name))
        if not paths:
            raise ValueError(f"{pattern}: no answers file matches")
        runs.setdefault(name or Path(paths[0]).stem, []).extend(paths)
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="NAME=GLOB of answers files (a run's shards)")
    parser.add_argument("--reference", default=None, help="NAME:VARIANT of the row to pair against")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    parser.add_argument("--common", action="store_true", help="score every row on the samples all rows answered")
    args = parser.parse_args(argv)
    try:
        paths = parse_runs(args.runs)
        runs = {name: read_run(files) for name, files in paths.items()}
    except (ValueError, OSError, KeyError, json.JSONDecodeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    name, _, variant = (args.reference or f"{next(iter(runs))}:{NAIVE}").partition(":")
    if variant not in runs.get(name, {}):
        print(f"error: no row {variant!r} in run {name!r}", file=sys.stderr)
        return 2
    if args.common:
        runs, common, _ = on_common_samples(runs)
        if not common:
            print("error: no sample was answered by every row", file=sys.stderr)
            return 2
        print(f"{common} samples answered by every row")
    scored = score(runs, (name, variant))
    print(table(scored))
    if args.json is not None:
        args.json.write_text(json.dumps([s.__dict__ for s in scored], indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
