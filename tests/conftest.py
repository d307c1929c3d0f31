"""Shared fixtures: tiny random-weight models of each supported family, built once per session.

They are written with `save_pretrained` and loaded back through the production `load_model` path.
Where CUDA exists, engine tests also run in bf16 on the GPU (marked `gpu`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from service.devtools.tiny_model import ARCHITECTURES, build_tiny_model
from service.engine.engine import StitchEngine
from service.engine.model import load_model

HAS_CUDA = torch.cuda.is_available()
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device here")]),
]


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: build_tiny_model(arch, root / arch) for arch in ARCHITECTURES}


_ENGINES: dict[tuple[str, str], StitchEngine] = {}


def engine_for(dirs: dict[str, Path], arch: str, device: str) -> StitchEngine:
    """One engine per (arch, device) for the whole session: loading is the slow part."""
    key = (arch, device)
    if key not in _ENGINES:
        _ENGINES[key] = StitchEngine(load_model(dirs[arch], device=device))
    return _ENGINES[key]


@pytest.fixture
def get_engine(tiny_model_dirs: dict[str, Path]) -> Callable[[str, str], StitchEngine]:
    """engine(arch, device) for tests that pick a family themselves."""
    return lambda arch, device="cpu": engine_for(tiny_model_dirs, arch, device)


@pytest.fixture(params=ARCHITECTURES)
def arch(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def engine(tiny_model_dirs: dict[str, Path], arch: str, device: str) -> StitchEngine:
    return engine_for(tiny_model_dirs, arch, device)
