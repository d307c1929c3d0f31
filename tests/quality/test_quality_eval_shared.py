"""`kvstitch eval --kv-path shared`: turbo rows answered through the shared chunk arena (the path a server with
`KVSTITCH_SHARED_CHUNKS=on` serves) give the copy path's answers, row for row, on a tiny CPU model (fp32: exact)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

import pytest

import service.engine.kv_path as kv_path_module
import service.quality.eval as eval_module
from service.cli import main
from service.engine.kv_layout import ModelSpec
from service.engine.kv_path import COPY_PATH, KVPath, KVPathReason
from service.engine.offline import OfflineScheduler
from service.engine.scheduler import Scheduler
from service.engine.shared_chunks import SharedChunks
from service.quality.generator import write_qa_file

SAMPLES = 3
TURBO_ROWS = 2  # reordered and composite, one chunk context


class _Recording(OfflineScheduler):
    """The eval's runner, keeping every shared-chunk mode it built (its counts outlive the runner's close)."""

    built: ClassVar[list[SharedChunks]] = []

    def scheduler_for(self, tokens: int, chunk_tokens: int = 0) -> Scheduler:
        scheduler = super().scheduler_for(tokens, chunk_tokens)
        if scheduler.shared is not None and scheduler.shared not in self.built:
            self.built.append(scheduler.shared)
        return scheduler


def _eval(model: Path, data: Path, out: Path, kv_path: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    answers = out.with_suffix(".jsonl")
    args = ["eval", "--model", str(model), "--data", str(data), "--device", "cpu", "--json", str(out)]
    args += ["--answers", str(answers), "--max-new-tokens", "6", "--kv-path", kv_path]
    assert main(args) == 0
    lines = [json.loads(line) for line in answers.read_text(encoding="utf-8").splitlines()]
    record: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
    return record, lines


def test_shared_turbo_rows_answer_as_the_copy_path(
    tiny_model_dirs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = write_qa_file(tmp_path / "qa.jsonl", questions=SAMPLES, chunks=3, seed=5, two_fact_share=0.5)
    model = tiny_model_dirs["qwen2"]
    monkeypatch.setattr(_Recording, "built", [])
    monkeypatch.setattr(eval_module, "OfflineScheduler", _Recording)
    copy, copy_answers = _eval(model, data, tmp_path / "copy.json", "copy")
    assert _Recording.built == []  # the copy path builds no arena
    shared, shared_answers = _eval(model, data, tmp_path / "shared.json", "shared")
    assert (copy["kv_path"], shared["kv_path"]) == ("copy", "shared")
    assert len(shared_answers) == len(copy_answers) == SAMPLES * (1 + TURBO_ROWS)
    for got, want in zip(shared_answers, copy_answers, strict=True):
        assert (got["variant"], got["answer"], got["correct"]) == (want["variant"], want["answer"], want["correct"])
        assert got["answer_agreement"] == want["answer_agreement"]
    drop = {"ttft_ms"}
    assert [{k: v for k, v in r.items() if k not in drop} for r in shared["rows"]] == [
        {k: v for k, v in r.items() if k not in drop} for r in copy["rows"]
    ]
    # Every turbo answer read the arena: the warm-up pass (each row once) and each sample's turbo rows.
    assert sum(s.answers for s in _Recording.built) == TURBO_ROWS * (1 + SAMPLES)


def test_shared_is_refused_where_segment_attention_cannot_run(
    tiny_model_dirs: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the engine cannot serve the shared path (here: a device without it, as `choose_kv_path` says) the
    eval exits 2 naming why, rather than answering through the copy path under a shared label."""
    data = write_qa_file(tmp_path / "qa.jsonl", questions=1, chunks=2, seed=5, two_fact_share=0.0)

    def no_segment_attention(requested: bool, spec: ModelSpec) -> KVPath:
        return COPY_PATH.fallback(KVPathReason.DEVICE, "segment attention runs on CUDA or the CPU, not elsewhere")

    monkeypatch.setattr(kv_path_module, "choose_kv_path", no_segment_attention)
    args = ["eval", "--model", str(tiny_model_dirs["llama"]), "--data", str(data), "--device", "cpu"]
    assert main([*args, "--kv-path", "shared"]) == 2
    assert "--kv-path shared cannot run here: segment attention runs on CUDA" in capsys.readouterr().err


def test_a_context_scale_adds_its_rows_through_the_shared_path(
    tiny_model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """`--context-scale 1 --context-scale 0.5`: turbo rows at each scale (labelled `:S0.5`), the S = 1 rows the
    copy path's answers; S = 0.5 weighs the context's attention down, so its answers move away from them."""
    data = write_qa_file(tmp_path / "qa.jsonl", questions=SAMPLES, chunks=3, seed=5, two_fact_share=0.5)
    model = tiny_model_dirs["qwen2"]
    _, copy_answers = _eval(model, data, tmp_path / "copy.json", "copy")
    out = tmp_path / "scaled.json"
    args = ["eval", "--model", str(model), "--data", str(data), "--device", "cpu", "--json", str(out), "--answers"]
    args += [str(out.with_suffix(".jsonl")), "--max-new-tokens", "6", "--kv-path", "shared"]
    assert main([*args, "--context-scale", "1", "--context-scale", "0.5"]) == 0
    lines = [json.loads(line) for line in out.with_suffix(".jsonl").read_text(encoding="utf-8").splitlines()]
    by_variant: dict[str, list[str]] = {}
    for line in lines:
        by_variant.setdefault(line["variant"], []).append(line["answer"])
    scaled = [v for v in by_variant if ":S0.5" in v]
    plain = [v for v in by_variant if v.startswith("turbo") and ":S" not in v]
    assert len(scaled) == len(plain) == TURBO_ROWS
    copied: dict[str, list[str]] = {}
    for line in copy_answers:
        copied.setdefault(line["variant"], []).append(line["answer"])
    assert all(by_variant[v] == copied[v] for v in plain)  # S = 1 is the block attention itself
    assert any(by_variant[s] != by_variant[s.replace(":S0.5", "")] for s in scaled)


def test_a_context_scale_is_refused_on_the_copy_path(
    tiny_model_dirs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = write_qa_file(tmp_path / "qa.jsonl", questions=1, chunks=2, seed=5, two_fact_share=0.0)
    args = ["eval", "--model", str(tiny_model_dirs["llama"]), "--data", str(data), "--device", "cpu"]
    assert main([*args, "--context-scale", "0.9"]) == 2
    assert "--context-scale needs --kv-path shared" in capsys.readouterr().err
    assert main([*args, "--kv-path", "shared", "--context-scale", "9"]) == 2
    assert "--context-scale 9 is outside 0.25..4" in capsys.readouterr().err


def test_shared_rows_answer_batched_as_one_at_a_time(
    tiny_model_dirs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--kv-path shared --batch 2` over 3 samples (a last batch of one), with a recompute row (served on the copy
    path beside the arena's answers): every record is the one-at-a-time run's, and every turbo answer without
    recompute read the arena (a batched run has no warm-up pass)."""
    data = write_qa_file(tmp_path / "qa.jsonl", questions=SAMPLES, chunks=3, seed=5, two_fact_share=0.5)
    model = tiny_model_dirs["qwen2"]
    monkeypatch.setattr(eval_module, "OfflineScheduler", _Recording)
    runs = []
    for batch in ("1", "2"):
        monkeypatch.setattr(_Recording, "built", [])
        out = tmp_path / f"batch{batch}.json"
        args = ["eval", "--model", str(model), "--data", str(data), "--device", "cpu", "--json", str(out)]
        args += ["--answers", str(out.with_suffix(".jsonl")), "--max-new-tokens", "6", "--kv-path", "shared"]
        assert main([*args, "--recompute", "none", "--recompute", "selective:0.5", "--batch", batch]) == 0
        lines = [json.loads(line) for line in out.with_suffix(".jsonl").read_text(encoding="utf-8").splitlines()]
        runs.append((lines, sum(s.answers for s in _Recording.built)))
    (one, one_arena), (two, two_arena) = runs
    assert len(one) == SAMPLES * (1 + TURBO_ROWS + 1) and [_untimed(r) for r in two] == [_untimed(r) for r in one]
    for batched, alone in zip(two, one, strict=True):  # the batched KL reads the logits the answer was picked from
        assert batched["kl_first_token"] == pytest.approx(alone["kl_first_token"], rel=1e-3, abs=1e-6)
    assert (one_arena, two_arena) == (TURBO_ROWS * (1 + SAMPLES), TURBO_ROWS * SAMPLES)


def _untimed(record: dict[str, object]) -> dict[str, object]:
    """An answers-file record without its timing and KL (a batched run times nothing; its KL is within rounding)."""
    return {k: v for k, v in record.items() if k not in {"ttft_ms", "kl_first_token"}}
