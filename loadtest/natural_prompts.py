"""Self-distillation prompts over natural text this machine ships, disjoint from the real-passage eval's sources.

`kvstitch finetune --distill-data FILE` distils on any QA file's questions over its chunks (the teacher answers
them). `kvstitch make-qa`'s synthetic passages are templated sentences about invented entities; the eval reads
manual pages, docstrings and licences. This writes prompts shaped like the eval's samples over other texts of
the same kinds: four passages of one source (90-200 words each, consecutive paragraphs, whitespace collapsed),
one of them asked about with `corpus_prompts`' question forms (the ones `finetune --data-dir` asks), shuffled.
Sources: Python standard-library modules' docstrings (module, classes, functions) and Debian's section-1 manual
pages, minus every source named in `loadtest/qa/real_passages.jsonl` (a module or page the eval reads is skipped
whole, so no eval passage or its neighbours is trained on).

    python -m loadtest.natural_prompts --out natural.jsonl --samples 2048 --seed 0

The "answers" field holds the sentence asked about: the file is in the eval's format, and distillation never
reads it.
"""

from __future__ import annotations

import argparse
import gzip
import importlib
import inspect
import json
import random
import re
import shutil
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

from workers.training.corpus_prompts import question_from, sentences

EVAL_SET = Path(__file__).resolve().parent / "qa" / "real_passages.jsonl"
PASSAGE_WORDS = (90, 200)  # the eval's passages are 60-200 words; joining stops at the first bound, so ~100 on average
CHUNKS_PER_SAMPLE = 4
MAN_PAGES = 400  # manual pages read at most (rendering is ~50 ms each)
MAN_DIR = Path("/usr/share/man/man1")
# Modules whose import has side effects (opens windows, prints, starts things) or is slow.
SKIPPED_MODULES = {"antigravity", "this", "idlelib", "tkinter", "turtledemo", "lib2to3", "test", "pydoc_data"}


def eval_sources() -> tuple[set[str], set[str]]:
    """(module roots, manual pages) the eval reads; `python:json.JSONDecoder.__init__` excludes all of `json`."""
    modules: set[str] = set()
    pages: set[str] = set()
    for line in EVAL_SET.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        for source in {record["source"], *record.get("chunk_sources", [])}:
            kind, _, name = source.partition(":")
            if kind == "python":
                modules.add(name.split(".")[0])
            elif kind == "man":
                pages.add(name)
    return modules, pages


def passages(text: str) -> list[str]:
    """Consecutive paragraphs joined until each passage has 60-200 words; longer paragraphs are cut at sentences."""
    low, high = PASSAGE_WORDS
    found: list[str] = []
    current: list[str] = []
    for paragraph in re.split(r"\n\s*\n", text):
        for piece in _bounded(" ".join(paragraph.split()), high):
            if current and len(" ".join([*current, piece]).split()) > high:
                _keep(found, current, low)
                current = []
            current.append(piece)
            if len(" ".join(current).split()) >= low:
                _keep(found, current, low)
                current = []
    _keep(found, current, low)
    return found


def _bounded(paragraph: str, high: int) -> Iterator[str]:
    """The paragraph, or its sentences grouped under `high` words where it is longer."""
    if len(paragraph.split()) <= high:
        if paragraph:
            yield paragraph
        return
    group: list[str] = []
    for sentence in re.split(r"(?<=[.!?])\s+", paragraph):
        if group and len(" ".join([*group, sentence]).split()) > high:
            yield " ".join(group)
            group = []
        group.append(sentence)
    if group and len(" ".join(group).split()) <= high:
        yield " ".join(group)


def _keep(found: list[str], pieces: list[str], low: int) -> None:
    text = " ".join(pieces)
    if len(text.split()) >= low:
        found.append(text)


def module_texts(skip: set[str]) -> Iterator[tuple[str, str]]:
    """(source, text) per standard-library module: its docstring and its public classes' and functions'."""
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in skip or name in SKIPPED_MODULES:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(name)
        except Exception:  # platform modules fail to import here; skipping them is the point
            continue
        docs = [inspect.getdoc(module) or ""]
        for attribute, value in sorted(vars(module).items()):
            if attribute.startswith("_") or getattr(value, "__module__", None) != name:
                continue
            if inspect.isclass(value) or inspect.isfunction(value):
                docs.append(inspect.getdoc(value) or "")
        yield f"python:{name}", "\n\n".join(d for d in docs if d)


def man_texts(skip: set[str], limit: int, rng: random.Random) -> Iterator[tuple[str, str]]:
    """(source, text) per rendered section-1 manual page, `limit` of them in a seeded order."""
    if shutil.which("man") is None or not MAN_DIR.is_dir():
        return
    # Names with "_" are generated families (hundreds of near-identical `gcloud_*` pages): one family, one voice.
    # Links and `.so` redirects are another name for a page: they are skipped, so `bzcat` never brings back
    # `bzip2`'s text.
    names = sorted({path.name.split(".")[0] for path in MAN_DIR.iterdir() if _own_page(path)} - skip)
    names = [name for name in names if "_" not in name and not _kin(name, skip)]
    rng.shuffle(names)
    for name in names[:limit]:
        done = subprocess.run(
            ["man", "-P", "cat", "1", name], capture_output=True, text=True, env={"MANWIDTH": "2000"}, check=False
        )
        if done.returncode == 0:
            yield f"man:{name}", done.stdout


def _kin(name: str, pages: set[str]) -> bool:
    """A page of the same tool family as an eval page (`ssh-add` of `ssh`, `rrsync` of `rsync`)."""
    return any(name.startswith(page + "-") or name.endswith(page) for page in pages)


def _own_page(path: Path) -> bool:
    if path.is_symlink() or not path.name.endswith(".gz"):
        return False
    with gzip.open(path, "rt", encoding="utf-8", errors="replace") as page:
        return not page.read(64).startswith(".so ")


def samples(count: int, seed: int) -> list[dict[str, object]]:
    """`count` prompts, sources visited round-robin in a seeded order so that no source dominates."""
    rng = random.Random(seed)
    modules, pages = eval_sources()
    pools: list[tuple[str, list[str]]] = []
    for source, text in [*module_texts(modules), *man_texts(pages, MAN_PAGES, rng)]:
        found = passages(text)
        if len(found) >= CHUNKS_PER_SAMPLE and any(sentences(p) for p in found):
            pools.append((source, found))
    if not pools:
        raise SystemExit("no source has four passages of 90-200 words")
    rng.shuffle(pools)
    made: list[dict[str, object]] = []
    while len(made) < count:
        for source, found in pools:
            if len(made) == count:
                break
            chunks = rng.sample(found, CHUNKS_PER_SAMPLE)
            asked = [c for c in chunks if sentences(c)]
            if not asked:
                continue
            gold = rng.choice(asked)
            sentence = rng.choice(sentences(gold))
            made.append(
                {
                    "id": f"{source}-{len(made)}",
                    "question": question_from(sentence, rng),
                    "chunks": chunks,
                    "answers": [sentence],
                    "source": source,
                }
            )
    return made


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    made = samples(args.samples, args.seed)
    args.out.write_text("".join(json.dumps(s, ensure_ascii=False) + "\n" for s in made), encoding="utf-8")
    sources = {str(s["source"]) for s in made}
    print(f"{len(made)} prompts over {len(sources)} sources -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
