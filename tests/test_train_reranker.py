"""The reranker's training script (loadtest/train_reranker.py): its text cannot come from the recall set, and what
it trains and saves is a folder that the service's `Reranker` (KVSTITCH_RERANK_MODEL) loads and ranks by."""

from __future__ import annotations

import argparse
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from sentence_transformers import CrossEncoder
from transformers import AutoModelForSequenceClassification

from loadtest import train_reranker as tr
from service.devtools.tiny_cross_encoder import build_tiny_cross_encoder
from service.retrieval.collection import RetrievedChunk
from service.retrieval.reranker import Reranker
from service.serving.runtime import open_reranker
from service.settings import Settings

GPL_LIKE = (
    "This program is free software: you can redistribute it and/or modify it under the terms of the GNU General "
    "Public License as published by the Free Software Foundation, either version 3 of the License, or (at your "
    "option) any later version. This program is distributed in the hope that it will be useful, but without any "
    "warranty; without even the implied warranty of merchantability or fitness for a particular purpose."
)


def test_a_chunk_that_shares_an_eight_word_run_with_the_recall_set_is_dropped() -> None:
    blocked = tr.recall_shingles()
    apache = (tr.RECALL_CORPUS / "apache-2.0.txt").read_text()
    quoted = apache[apache.index("Legal Entity") - 200 :][:1500]
    kept = tr.chunk_documents([("license:quoted", quoted), ("license:gpl-like", GPL_LIKE * 3)], blocked)
    assert {doc for doc, _ in kept} == {"license:gpl-like"}
    assert all(not tr.shingles(text) & blocked for _, text in kept)
    # One shared run is enough: a GPL-like chunk with twelve words of Apache in it goes too.
    head = " ".join(GPL_LIKE.split()[:30])
    assert len(tr.chunk_documents([("license:head", head)], blocked)) == 1
    mixed = head + " " + " ".join(quoted.split()[40:52])
    assert tr.chunk_documents([("license:mixed", mixed)], blocked) == []


def test_the_recall_documents_and_their_parent_are_never_read() -> None:
    if not tr.COMMON_LICENSES.is_dir():
        pytest.skip("no /usr/share/common-licenses on this machine")
    names = {doc for doc, _ in tr.licence_documents()}
    assert names, "no licence read"
    assert not {f"license:{n}" for n in tr.EXCLUDED_LICENSES} & names
    assert "license:GPL-3" in names


def test_real_passage_samples_quote_no_recall_licence() -> None:
    blocked = tr.recall_shingles()
    samples = tr.real_samples(blocked)
    assert len(samples) >= 100
    for sample in samples:
        assert not set(sample["chunk_sources"]) & tr.EXCLUDED_SOURCES
        assert not any(tr.shingles(t) & blocked for t in [sample["question"], *sample["chunks"]])


def test_cloze_questions_are_sentences_of_the_chunk_and_mostly_cut_from_it() -> None:
    import random

    rng = random.Random(0)
    chunk = " ".join(GPL_LIKE.split())
    made = [tr.cloze(rng, chunk) for _ in range(200)]
    assert all(m is not None and m[0] in chunk for m in made)
    cut = sum(m is not None and m[0] not in m[1] for m in made)
    assert 0.75 * len(made) < cut < len(made)  # about 1 - KEEP_SENTENCE of them


def test_mined_negatives_skip_the_positive_and_its_repeats() -> None:
    import random

    import numpy as np

    pool = [GPL_LIKE, GPL_LIKE + " extra words here", "gzip compresses files with Lempel-Ziv coding of the data"]
    pool += [f"unrelated passage number {i} about rivers and stones and kelp" for i in range(12)]
    chosen = tr.mine(random.Random(1), np.arange(len(pool)), pool, GPL_LIKE, {0}, 3)
    assert len(chosen) == 3
    assert GPL_LIKE not in chosen and pool[1] not in chosen  # a repeat of the positive is no negative


def test_the_trained_folder_loads_as_the_services_reranker_and_ranks_by_its_scores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = build_tiny_cross_encoder(tmp_path / "base")
    rows = [("where do otters sleep?", "Sea otters sleep holding hands.", 1.0)]
    rows += [("where do otters sleep?", f"Bread rises with yeast, batch {i}.", 0.0) for i in range(7)]
    args = argparse.Namespace(
        out=tmp_path / "trained", base=base, seed=0, batch_size=4, lr=1e-3, max_minutes=5.0, max_steps=None
    )
    summary = tr.train(rows, args)
    assert summary["steps"] == 2 == summary["planned_steps"]

    before = AutoModelForSequenceClassification.from_pretrained(base).classifier.weight
    after = AutoModelForSequenceClassification.from_pretrained(args.out).classifier.weight
    assert not torch.equal(before, after)  # trained, not copied

    monkeypatch.chdir(tmp_path)  # no .env of the checkout
    monkeypatch.setenv("KVSTITCH_RERANK_MODEL", str(args.out))
    reranker = open_reranker(Settings(), SimpleNamespace(device="cpu"))  # type: ignore[arg-type]
    assert isinstance(reranker, Reranker) and reranker.model_name == str(args.out)
    texts = [r[1] for r in rows]
    hits = [
        RetrievedChunk(str(i), "d", i, 0.0, t, (), "v", "", 0, 0)
        for i, t in enumerate(texts)
    ]  # fmt: skip
    ranked = reranker.rerank(rows[0][0], hits)
    scores = CrossEncoder(str(args.out), device="cpu").predict([(rows[0][0], t) for t in texts])
    assert [h.index for h in ranked] == sorted(range(len(texts)), key=lambda i: -float(scores[i]))
    assert [h.score for h in ranked] == pytest.approx(sorted((float(s) for s in scores), reverse=True), abs=1e-5)


def test_listwise_batches_keep_each_question_whole_and_score_its_positive_against_its_negatives() -> None:
    rows = [("a", "pa", 1.0), ("a", "n1", 0.0), ("a", "n2", 0.0), ("b", "pb", 1.0), ("b", "n3", 0.0)]
    rows += [("c", "pc", 1.0), ("c", "n4", 0.0), ("c", "n5", 0.0), ("c", "n6", 0.0)]
    assert [len(b) for b in tr.batches(rows, 5, "listwise")] == [5, 4]
    assert [len(b) for b in tr.batches(rows, 4, "bce")] == [4, 4, 1]
    logits = torch.tensor([2.0, 0.0, 1.0, -1.0, 1.0])
    loss = tr.batch_loss(logits, rows[:5], "listwise")
    a = -torch.log_softmax(torch.tensor([2.0, 0.0, 1.0]), 0)[0]
    b = -torch.log_softmax(torch.tensor([-1.0, 1.0]), 0)[0]
    assert float(loss) == pytest.approx(float((a + b) / 2))
