"""Fine-tune variants side by side, evaluate each and the base model in shards, and score them together.

One run of issue 26's loop — `kvstitch finetune` per variant, `kvstitch eval` per model in shards, then
`loadtest.score_answers` against the base model's naive row — as one command, so a short GPU lease spends its
minutes on the GPU and none between steps:

    python -m loadtest.quality_sweep --model smol --distill-data natural.jsonl --out sweep \\
      --finetune-args "--device cuda --batch-size 32 --answer-tokens 32 --generate-batch-size 128 --instruction \\
        'Answer with a short phrase copied from the documents, without explanation.'" \\
      --variant a:steps=150 --variant b:steps=300 --variant c:steps=200,full-attention-share=0.3 \\
      --eval-data loadtest/qa/real_passages.jsonl --eval-args "--device cuda --dtype float32" --shards 8

A variant is `NAME:flag=value,...`, each pair passed to `kvstitch finetune` as `--flag value` after
--finetune-args. Fine-tunes run side by side (a 135M model leaves an H100 mostly idle; its launches, not its
arithmetic, set the pace), then every model's eval shards side by side (at most --parallel processes). The base
model's eval takes --base-eval-args too (recompute rows, say); `--base-answers GLOB` reuses an earlier base run
instead. A sweep cut off by a time limit resumes where it stopped: a variant whose folder already holds a finished
fine-tune is not trained again, and every eval shard runs with `--resume`, answering only the samples its answers
file lacks. Writes under --out: the models, `logs/`, `answers/NAME_i.jsonl`, and `scores.md` / `scores.json`
(every row of every model paired against the base model's naive row); prints the table. Where some row lacks
samples (a failed shard, an earlier base run cut off), every row is scored on the samples all rows answered, and
the table says how many that is.
Several --eval-data files (the real-passage sets A and B, say) are evaluated as one joined file (`eval_data.jsonl`,
their ids must differ) and scored together and then each alone.
A failed step is named with its log's last lines, and the sweep goes on with what is left (exit status 1).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from loadtest.score_answers import NAIVE, on_common_samples, parse_runs, read_run, restricted, score, table
from workers.training.finetune import REPORT_NAME

Record = dict[str, object]
Runs = dict[str, dict[str, dict[str, Record]]]  # {run: {row: {sample key: record}}}, as score_answers reads them
BASE = "base"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,31}")
FLAG = re.compile(r"[a-z][a-z0-9-]*")
LOG_TAIL = 6
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


@dataclass(frozen=True)
class Variant:
    name: str
    flags: tuple[str, ...]  # `--flag value` pairs for `kvstitch finetune`


@dataclass(frozen=True)
class Job:
    """One child process: what it is, its command and its log."""

    label: str
    command: tuple[str, ...]
    log: Path


@dataclass(frozen=True)
class Outcome:
    label: str
    returncode: int
    seconds: float
    log: Path


def parse_variant(text: str) -> Variant:
    """`NAME:flag=value,flag=value` (or a bare `NAME` for the shared flags alone)."""
    name, _, pairs = text.partition(":")
    if not NAME.fullmatch(name) or name == BASE:
        raise ValueError(f"variant {text!r}: a name of letters, digits, '-' or '_' (not {BASE!r}) comes first")
    flags: list[str] = []
    for pair in filter(None, pairs.split(",")):
        flag, equals, value = pair.partition("=")
        if not equals or not FLAG.fullmatch(flag) or not value:
            raise ValueError(f"variant {text!r}: {pair!r} is not flag=value (e.g. steps=150)")
        flags += [f"--{flag}", value]
    return Variant(name, tuple(flags))


def shard_bounds(samples: int, shards: int) -> list[tuple[int, int]]:
    """(offset, limit) of each shard, together covering every sample once; no empty shard."""
    size = math.ceil(samples / shards)
    return [(offset, min(size, samples - offset)) for offset in range(0, samples, size)]


def finetune_jobs(args: argparse.Namespace, variants: list[Variant]) -> list[Job]:
    """A job per variant whose folder holds no finished fine-tune."""
    jobs = []
    for variant in variants:
        if (args.out / variant.name / REPORT_NAME).is_file():
            continue
        command = (
            *kvstitch(),
            "finetune",
            "--model",
            args.model,
            "--distill-data",
            str(args.distill_data),
            "--out",
            str(args.out / variant.name),
            *shlex.split(args.finetune_args),
            *variant.flags,
        )
        jobs.append(Job(f"finetune {variant.name}", command, args.out / "logs" / f"{variant.name}.finetune.log"))
    return jobs


def eval_jobs(args: argparse.Namespace, models: dict[str, str], samples: int) -> list[Job]:
    """A job per model and shard of the joined eval file's `samples`; the base model's carry --base-eval-args."""
    jobs = []
    bounds = shard_bounds(samples, args.shards)
    for name, model in models.items():
        extra = shlex.split(args.base_eval_args) if name == BASE else []
        for index, (offset, limit) in enumerate(bounds):
            answers = args.out / "answers" / f"{name}_{index}.jsonl"
            command = (
                *kvstitch(),
                "eval",
                "--model",
                model,
                "--data",
                str(joined_eval_data(args)),
                *shlex.split(args.eval_args),
                *extra,
                "--offset",
                str(offset),
                "--limit",
                str(limit),
                "--answers",
                str(answers),
                "--resume",
            )
            jobs.append(Job(f"eval {name} shard {index}", command, args.out / "logs" / f"{name}_{index}.eval.log"))
    return jobs


def joined_eval_data(args: argparse.Namespace) -> Path:
    return Path(args.out) / "eval_data.jsonl"


def join_eval_data(paths: list[Path], out: Path) -> dict[str, set[str]]:
    """The eval files as one (written to `out`), and each file's samples keyed as `score_answers` keys the answers:
    by id, or where a sample has none by its line in the joined file; a key in two files is an error."""
    sets: dict[str, set[str]] = {}
    lines: list[str] = []
    seen: set[str] = set()
    for path in paths:
        ids: set[str] = set()
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            sample_id = json.loads(line).get("id")
            key = str(sample_id if sample_id is not None else len(lines) + 1)
            if key in seen:
                raise ValueError(f"{path}:{number}: sample id {key} is in two eval files")
            seen.add(key)
            ids.add(key)
            lines.append(line)
        sets[path.stem] = ids
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return sets


def kvstitch() -> tuple[str, ...]:
    """The CLI of this checkout, whichever interpreter runs the sweep."""
    return (sys.executable, "-m", "service")


def child_environment(processes: int, cores: int | None = None) -> dict[str, str]:
    """This process's environment, with the CPU threads of each of `processes` children bounded to its share of the
    cores (unless set already): torch starts a thread per core in every process, and two dozen eval shards on 16
    cores then spend their CPU spinning against each other instead of launching the GPU's kernels."""
    environment = dict(os.environ)
    share = max(1, (cores or os.cpu_count() or 1) // max(1, processes))
    for name in THREAD_VARIABLES:
        environment.setdefault(name, str(share))
    return environment


def run_jobs(jobs: list[Job], parallel: int) -> list[Outcome]:
    """Every job, at most `parallel` at once; each one's stdout and stderr go to its log."""
    environment = child_environment(min(parallel, len(jobs)))
    waiting, done = list(jobs), []
    running: list[tuple[Job, subprocess.Popen[bytes], float]] = []
    while waiting or running:
        while waiting and len(running) < parallel:
            job = waiting.pop(0)
            job.log.parent.mkdir(parents=True, exist_ok=True)
            with job.log.open("w", encoding="utf-8") as log:
                process = subprocess.Popen(job.command, stdout=log, stderr=subprocess.STDOUT, env=environment)
            running.append((job, process, time.monotonic()))
        time.sleep(0.2)
        for entry in [r for r in running if r[1].poll() is not None]:
            job, process, began = entry
            running.remove(entry)
            done.append(Outcome(job.label, int(process.returncode), time.monotonic() - began, job.log))
    return done


def report_failures(outcomes: list[Outcome]) -> bool:
    """Print each failed job with its log's last lines; True when none failed."""
    failed = [o for o in outcomes if o.returncode != 0]
    for outcome in failed:
        lines = outcome.log.read_text(encoding="utf-8", errors="replace").splitlines()[-LOG_TAIL:]
        print(f"{outcome.label} failed (exit {outcome.returncode}), {outcome.log}:", file=sys.stderr)
        print("\n".join(f"    {line}" for line in lines), file=sys.stderr)
    return not failed


def scores(args: argparse.Namespace, names: list[str], sets: dict[str, set[str]]) -> str:
    """Every row of every model against the base model's naive row over all samples, then over each eval file's
    alone (where there are several), written as scores.md and scores.json; on the samples every row answered
    where some row lacks some (`common_rows`)."""
    patterns = [f"{BASE}={args.base_answers or args.out / 'answers' / f'{BASE}_*.jsonl'}"]
    patterns += [f"{name}={args.out / 'answers' / f'{name}_*.jsonl'}" for name in names]
    runs, note = common_rows({name: read_run(files) for name, files in parse_runs(patterns).items()})
    parts = {"all": None, **(sets if len(sets) > 1 else {})}
    texts: list[str] = []
    records: dict[str, list[Record]] = {}
    for part, ids in parts.items():
        part_runs = runs if ids is None else restricted(runs, ids)
        if not part_runs[BASE][NAIVE]:
            texts.append(f"{part}: no sample answered by every row")
            records[part] = []
            continue
        scored = score(part_runs, (BASE, NAIVE))
        texts.append(f"{part}:\n\n{table(scored)}" if len(parts) > 1 else table(scored))
        records[part] = [asdict(s) for s in scored]
    rows = "\n\n".join([note, *texts] if note else texts)
    (args.out / "scores.md").write_text(rows + "\n", encoding="utf-8")
    flat = records["all"] if len(parts) == 1 else records
    (args.out / "scores.json").write_text(json.dumps(flat, indent=2) + "\n", encoding="utf-8")
    return rows


def common_rows(runs: Runs) -> tuple[Runs, str]:
    """`runs` cut to the samples every row of every run answered, with a line saying how many of how many that is,
    where some row lacks samples (else `runs` and no line); ValueError where no sample is common to all rows."""
    cut, common, answered = on_common_samples(runs)
    if common == answered:
        return runs, ""
    if not common:
        raise ValueError(f"no sample of the {answered} answered was answered by every row of every run")
    return cut, f"scored on the {common} of {answered} samples answered by every row"


def sweep(args: argparse.Namespace, variants: list[Variant]) -> int:
    sets = join_eval_data(args.eval_data, joined_eval_data(args))
    trained = run_jobs(finetune_jobs(args, variants), parallel=len(variants))
    ok = report_failures(trained)
    ready = [v.name for v in variants if (args.out / v.name / REPORT_NAME).is_file()]
    models = {} if args.base_answers else {BASE: args.model}
    models |= {name: str(args.out / name) for name in ready}
    (args.out / "answers").mkdir(exist_ok=True)
    samples = sum(len(ids) for ids in sets.values())
    evaluated = run_jobs(eval_jobs(args, models, samples), parallel=args.parallel)
    ok = report_failures(evaluated) and ok
    failed_models = {o.label.split()[1] for o in evaluated if o.returncode != 0}
    if BASE in failed_models:
        print("the base model's eval failed: nothing to score against", file=sys.stderr)
        return 1
    print(scores(args, [name for name in ready if name not in failed_models], sets))
    for outcome in trained:
        print(f"{outcome.label}: {outcome.seconds:.0f} s")
    return 0 if ok else 1


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[Variant]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="the base model's folder")
    parser.add_argument("--distill-data", type=Path, required=True, help="finetune --distill-data prompts")
    parser.add_argument(
        "--eval-data", type=Path, action="append", required=True, help="eval --data file (repeatable: joined)"
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--variant", action="append", default=[], help="NAME:flag=value,... (repeatable)")
    parser.add_argument("--finetune-args", default="", help="flags every fine-tune gets (one shell-quoted string)")
    parser.add_argument("--eval-args", default="", help="flags every eval shard gets")
    parser.add_argument("--base-eval-args", default="", help="flags the base model's eval shards also get")
    parser.add_argument("--base-answers", default=None, help="GLOB of an earlier base eval's answers: not rerun")
    parser.add_argument("--shards", type=int, default=8, help="eval processes per model (default 8)")
    parser.add_argument("--parallel", type=int, default=32, help="eval processes at once (default 32)")
    args = parser.parse_args(argv)
    if not 1 <= args.shards <= 64 or not 1 <= args.parallel <= 128:
        parser.error("--shards takes 1-64 and --parallel 1-128")
    for path in (args.distill_data, *args.eval_data):
        if not path.is_file():
            parser.error(f"{path}: no such file")
    try:
        variants = [parse_variant(text) for text in args.variant]
    except ValueError as err:
        parser.error(str(err))
    if len({v.name for v in variants}) != len(variants):
        parser.error("two variants share a name")
    return args, variants


def main(argv: list[str] | None = None) -> int:
    args, variants = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        return sweep(args, variants)
    except ValueError as err:  # eval files sharing a sample id, rows with no sample in common
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
