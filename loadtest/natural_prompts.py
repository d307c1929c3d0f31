"""Self-distillation prompts over natural text this machine ships, disjoint from the real-passage eval's sources.

`kvstitch finetune --distill-data FILE` distils on any QA file's questions over its chunks (the teacher answers
them). `kvstitch make-qa`'s synthetic passages are templated sentences about invented entities; the eval reads
manual pages, docstrings and licences. This writes prompts shaped like the eval's samples over other texts of
the same kinds: four passages of one source (90-200 words each, consecutive paragraphs, whitespace collapsed),
one of them asked about with `corpus_prompts`' question forms (the ones `finetune --data-dir` asks), shuffled.
Sources, of the eval's four kinds: Python standard-library modules' docstrings (module, classes, functions),
Debian's section-1 manual pages, licence texts (`/usr/share/common-licenses` and a sample of the packages'
`/usr/share/doc/*/copyright` files) and installed Python distributions' long descriptions (their READMEs), minus
every source named in the real-passage sets, `loadtest/qa/real_passages.jsonl` and `real_passages_b.jsonl` (a
module, page, licence or package either set reads is skipped whole, with its aliases and kin). Copyright files
quote licences verbatim, so any passage sharing eight consecutive words with a chunk of either set is dropped as
well: no eval passage is trained on, whatever file it sits in.

    python -m loadtest.natural_prompts --out natural.jsonl --samples 2048 --seed 0

The "answers" field holds the sentence asked about: the file is in the eval's format, and distillation never
reads it.
"""

from __future__ import annotations

import argparse
import gzip
import importlib
import importlib.metadata
import inspect
import json
import random
import re
import shutil
import subprocess
import sys
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers.training.corpus_prompts import EDGE_PUNCTUATION, question_from, sentences

QA_DIR = Path(__file__).resolve().parent / "qa"
# Every real-passage eval set: set B confirms what set A finds, so neither may be trained on.
EVAL_SETS = (QA_DIR / "real_passages.jsonl", QA_DIR / "real_passages_b.jsonl")
PASSAGE_WORDS = (90, 200)  # the eval's passages are 60-200 words; joining stops at the first bound, so ~100 on average
# The eval's passages are at most ~1,550 characters. A passage of 200 words but many more characters is markup, an
# embedded image or a run of URLs (one package README gave a 50,000-character "passage" of 28,000 tokens, past the
# model's context): not prose of the eval's kind, and too long to train on in a batch.
PASSAGE_CHARS = 1600
CHUNKS_PER_SAMPLE = 4
MAN_PAGES = 400  # manual pages read at most (rendering is ~50 ms each)
MAN_DIR = Path("/usr/share/man/man1")
LICENCE_DIR = Path("/usr/share/common-licenses")
DOC_DIR = Path("/usr/share/doc")
COPYRIGHT_FILES = 150  # copyright files read at most: most are boilerplate, a few hundred would outvote the rest
OWN_DISTRIBUTION = "kvstitch"  # this project's README is not a third party's text
SHINGLE_WORDS = 8  # a passage sharing this many consecutive words with an eval chunk is the eval's text
# Modules whose import has side effects (opens windows, prints, starts things) or is slow.
SKIPPED_MODULES = {"antigravity", "this", "idlelib", "tkinter", "turtledemo", "lib2to3", "test", "pydoc_data"}


@dataclass(frozen=True)
class EvalSources:
    """What the eval reads, by kind: module roots, manual pages, licences and packages (lower-case names)."""

    modules: frozenset[str]
    pages: frozenset[str]
    licences: frozenset[str]
    packages: frozenset[str]
    shingles: frozenset[tuple[str, ...]]


def eval_sources(paths: Iterable[Path] = EVAL_SETS) -> EvalSources:
    """The eval sets' sources (`python:json.JSONDecoder.__init__` excludes all of `json`) and their chunks'
    shingles, over every set in `paths`."""
    names: dict[str, set[str]] = {"python": set(), "man": set(), "license": set(), "pkg": set()}
    shingles: set[tuple[str, ...]] = set()
    for record in _records(paths):
        for source in {record["source"], *record.get("chunk_sources", [])}:
            kind, _, name = source.partition(":")
            if kind in names:
                names[kind].add(name.split(".")[0] if kind == "python" else name.lower())
        for chunk in record["chunks"]:
            shingles.update(shingles_of(chunk))
    return EvalSources(
        modules=frozenset(names["python"]),
        pages=frozenset(names["man"]),
        licences=frozenset(names["license"]),
        packages=frozenset(_distribution_key(name) for name in names["pkg"]),
        shingles=frozenset(shingles),
    )


def _records(paths: Iterable[Path]) -> Iterator[dict[str, Any]]:
    for path in paths:
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                yield json.loads(line)


def shingles_of(text: str) -> set[tuple[str, ...]]:
    """Every run of SHINGLE_WORDS consecutive words, lower-cased, punctuation at the words' edges dropped."""
    words = [word.strip(EDGE_PUNCTUATION).lower() for word in text.split()]
    words = [word for word in words if word]
    return {tuple(words[i : i + SHINGLE_WORDS]) for i in range(len(words) - SHINGLE_WORDS + 1)}


def passages(text: str) -> list[str]:
    """Consecutive paragraphs joined until each passage has 90-200 words; longer paragraphs are cut at sentences.
    A passage over PASSAGE_CHARS characters is dropped."""
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
    if len(text.split()) >= low and len(text) <= PASSAGE_CHARS:
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


def licence_texts(directory: Path, skip: frozenset[str]) -> Iterator[tuple[str, str]]:
    """(source, text) per licence file; an eval licence, its aliases (`GPL` links to `GPL-3`) and its other
    versions' files of the same family (`LGPL-3` beside `GPL-3`) are left out."""
    if not directory.is_dir():
        return
    for path in sorted(directory.iterdir()):
        names = {path.name.lower(), path.resolve().name.lower()}
        if path.is_file() and not any(_licence_kin(name, skip) for name in names):
            yield f"license:{path.name}", path.read_text(encoding="utf-8", errors="replace")


def _licence_kin(name: str, skip: frozenset[str]) -> bool:
    return any(name == licence or name.endswith(licence) for licence in skip)


def copyright_texts(directory: Path, skip: frozenset[str], limit: int, rng: random.Random) -> Iterator[tuple[str, str]]:
    """(source, text) of `limit` packages' copyright files in a seeded order, packages named like an eval source
    (`openssh-client` of `ssh` is caught by the shingles instead) left out."""
    if not directory.is_dir():
        return
    files = sorted(path for path in directory.glob("*/copyright") if path.is_file() and not path.is_symlink())
    files = [path for path in files if not any(name in path.parent.name.lower() for name in skip)]
    rng.shuffle(files)
    for path in files[:limit]:
        yield f"copyright:{path.parent.name}", path.read_text(encoding="utf-8", errors="replace")


def package_texts(skip: frozenset[str]) -> Iterator[tuple[str, str]]:
    """(source, text) per installed distribution's long description, the eval's packages and this one left out."""
    seen: set[str] = set()
    for distribution in importlib.metadata.distributions():
        name = _distribution_key(distribution.metadata["Name"] or "")
        if not name or name in seen or name in skip or name == OWN_DISTRIBUTION:
            continue
        seen.add(name)
        description = distribution.metadata.get_payload() or distribution.metadata["Description"] or ""  # type: ignore[attr-defined]
        if description.strip():
            yield f"pkg:{name}", description


def _distribution_key(name: str) -> str:
    """A distribution's name as pip compares them (`Foo_Bar` is `foo-bar`)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _kin(name: str, pages: set[str]) -> bool:
    """A page of the same tool family as an eval page (`ssh-add` of `ssh`, `rrsync` of `rsync`)."""
    return any(name.startswith(page + "-") or name.endswith(page) for page in pages)


def _own_page(path: Path) -> bool:
    if path.is_symlink() or not path.name.endswith(".gz"):
        return False
    with gzip.open(path, "rt", encoding="utf-8", errors="replace") as page:
        return not page.read(64).startswith(".so ")


def source_texts(eval_set: EvalSources, rng: random.Random) -> Iterator[tuple[str, str]]:
    """(source, text) of every kind this machine ships, the eval's own sources left out."""
    yield from module_texts(set(eval_set.modules))
    yield from man_texts(set(eval_set.pages), MAN_PAGES, rng)
    yield from licence_texts(LICENCE_DIR, eval_set.licences)
    yield from copyright_texts(DOC_DIR, eval_set.pages | eval_set.packages, COPYRIGHT_FILES, rng)
    yield from package_texts(eval_set.packages)


def samples(
    count: int, seed: int, texts: Iterable[tuple[str, str]] | None = None, eval_set: EvalSources | None = None
) -> list[dict[str, object]]:
    """`count` prompts, sources visited round-robin in a seeded order so that no source dominates; `texts`
    defaults to every source this machine ships (`source_texts`)."""
    rng = random.Random(seed)
    eval_set = eval_set or eval_sources()
    pools: list[tuple[str, list[str]]] = []
    for source, text in texts if texts is not None else source_texts(eval_set, rng):
        found = [p for p in passages(text) if not shingles_of(p) & eval_set.shingles]
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
            sample = _sample(source, found, len(made), rng)
            if sample is not None:
                made.append(sample)
    return made


def _sample(source: str, found: list[str], index: int, rng: random.Random) -> dict[str, object] | None:
    """Four of a source's passages, a question on a sentence of one of them (None if none has a sentence)."""
    chunks = rng.sample(found, CHUNKS_PER_SAMPLE)
    asked = [c for c in chunks if sentences(c)]
    if not asked:
        return None
    sentence = rng.choice(sentences(rng.choice(asked)))
    return {
        "id": f"{source}-{index}",
        "question": question_from(sentence, rng),
        "chunks": chunks,
        "answers": [sentence],
        "source": source,
    }


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
