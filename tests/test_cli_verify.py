"""`kvstitch verify` passes on each tiny model and fails, with the diff, when stitching is broken."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import service.engine.engine as engine_module
import service.engine.shared_gate as shared_gate_module
from service.cli import main
from service.engine.gate import scaled_tolerance
from service.engine.segment_attention import ChunkRange
from service.engine.shared_decode import Placement, placements
from service.engine.stitch import StitchPlan, plan_positions

FINAL_LINE = re.compile(r"^max_abs_logit_diff=(\S+)$")


def _final_diff(output: str) -> float:
    match = FINAL_LINE.match(output.strip().splitlines()[-1])
    assert match, f"last line is not the diff line: {output!r}"
    return float(match.group(1))


def test_verify_passes_on_each_tiny_model(
    tiny_model_dirs: dict[str, Path], arch: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["verify", "--model", str(tiny_model_dirs[arch]), "--device", "cpu"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.count("positions=reordered") == 2 and out.count("positions=composite") == 2
    assert _final_diff(out) < 1e-4


def _off_by_one(mode: str, lengths: list[int], chunk_start: int = 0, temperature: float = 1.0) -> StitchPlan:
    plan = plan_positions(mode, lengths, chunk_start, temperature)
    return StitchPlan(plan.mode, plan.lengths, plan.slots, tuple(s + 1 for s in plan.starts), plan.key_scales)


def test_verify_fails_when_positions_are_off_by_one(
    tiny_model_dirs: dict[str, Path],
    arch: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(engine_module, "plan_positions", _off_by_one)
    code = main(["verify", "--model", str(tiny_model_dirs[arch]), "--device", "cpu"])
    out = capsys.readouterr().out
    assert code == 1
    assert "gate FAIL" in out
    assert _final_diff(out) > 1e-2


@pytest.mark.parametrize(
    ("dtype", "logit_scale", "bound"),
    [
        (torch.float32, 3.5, 1e-4),  # the tiny random models: the absolute floor
        (torch.float32, 40.0, 4e-4),  # a trained model (the H200 demo's base: 1.3e-4 of fp32 round-off)
        (torch.bfloat16, 40.0, 4.0),
        (torch.bfloat16, 6.8, 0.68),  # the random Qwen2-7B shape
    ],
)
def test_the_gate_bound_grows_with_the_logits(dtype: torch.dtype, logit_scale: float, bound: float) -> None:
    assert scaled_tolerance(dtype, logit_scale) == pytest.approx(bound)


def test_verify_runs_as_a_command(tiny_model_dirs: dict[str, Path]) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "service",
            "verify",
            "--model",
            str(tiny_model_dirs["qwen2"]),
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert _final_diff(done.stdout) < 1e-4


def test_verify_refuses_a_missing_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["verify", "--model", str(tmp_path / "nowhere"), "--device", "cpu"])
    assert code == 2
    assert "cannot load" in capsys.readouterr().err


def test_tiny_model_command_writes_a_loadable_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tiny-model", str(tmp_path / "m"), "--arch", "llama"]) == 0
    assert (tmp_path / "m" / "config.json").is_file()
    assert main(["verify", "--model", str(tmp_path / "m"), "--device", "cpu"]) == 0


ZERO_COPY_LINE = re.compile(r"^zero_copy_max_abs_logit_diff=(\S+)$", re.MULTILINE)


def _shifted_placements(plan: StitchPlan, ranges: list[ChunkRange]) -> tuple[Placement, ...]:
    return tuple(Placement(p.chunk, p.offset + 1) for p in placements(plan, ranges))


@pytest.mark.parametrize("broken", [False, True], ids=["zero-copy-right", "zero-copy-off-by-one"])
def test_verify_checks_the_zero_copy_path_when_asked(
    tiny_model_dirs: dict[str, Path],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    broken: bool,
) -> None:
    """`--kv-path shared`: the four cases on each path, the zero-copy path's largest diff on its own line; a zero-copy
    path whose chunk offsets are off fails the command though the copy path passes."""
    if broken:
        monkeypatch.setattr(shared_gate_module, "placements", _shifted_placements)
    code = main(["verify", "--model", str(tiny_model_dirs["llama"]), "--device", "cpu", "--kv-path", "shared"])
    out = capsys.readouterr().out
    assert out.count("path=copy ") == 4 and out.count("path=shared ") == 4
    match = ZERO_COPY_LINE.search(out)
    assert match is not None
    zero_copy = float(match.group(1))
    copy_line = re.search(r"^max_abs_logit_diff=(\S+)$", out, re.MULTILINE)
    assert copy_line is not None and float(copy_line.group(1)) < 1e-4
    if broken:
        assert code == 1 and "gate FAIL" in out and zero_copy > 1e-2
    else:
        assert code == 0 and "gate pass" in out and 0 < zero_copy < 1e-4
