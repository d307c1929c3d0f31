"""`kvstitch import-gguf FILE --out DIR`: a GGUF checkpoint (llama.cpp's format) as a plain HF folder.

Pretrained weights often come only as a GGUF file. transformers reads one (`from_pretrained(folder,
gguf_file=name)`, with the optional `gguf` and `accelerate` packages), dequantising every tensor to fp32, but
the model it returns refuses `save_pretrained`. So the weights are copied into a freshly built model of the same
architecture and that one is saved: safetensors, config, generation config, and the tokenizer with its chat
template, which is the folder `load_model` opens and `kvstitch verify` checks.

The architecture is checked against the engine's supported set (`model.check_supported`) from the file's
metadata alone, before the slow part (the tokenizer conversion and the dequantisation): a family the engine
cannot stitch is refused by name, never converted and then refused at `serve`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

GGUF_MAGIC = b"GGUF"
# The short names are the brief's and llama.cpp's; the long ones are what every other kvstitch command takes.
IMPORT_DTYPES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
# The optional packages transformers needs to read a GGUF file (pyproject's `gguf` extra).
REQUIRED_PACKAGES = ("gguf", "accelerate")
# Config keys that describe the GGUF source, not the model: with `quantization_config` left in, transformers would
# look for the GGUF file again when the saved folder is loaded; the name is the GGUF's own title, not a path.
GGUF_ONLY_KEYS = ("quantization_config", "_model_name_or_path")
INSTALL_HINT = "pip install 'kvstitch[gguf]' (or: pip install gguf accelerate)"


class GGUFImportError(ValueError):
    """The file cannot be imported: missing, not GGUF, an architecture the engine cannot stitch, no packages."""


@dataclass(frozen=True)
class ImportedModel:
    out: Path
    model_type: str
    parameters: int
    dtype: torch.dtype


def check_gguf_file(path: str | Path) -> Path:
    """The path when it names a readable GGUF file (by its magic bytes), else GGUFImportError saying why."""
    source = Path(path)
    if not source.exists():
        raise GGUFImportError(f"{source}: no such file")
    if not source.is_file():
        raise GGUFImportError(f"{source}: not a regular file")
    with source.open("rb") as head:
        magic = head.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        raise GGUFImportError(f"{source}: not a GGUF file (it does not start with the GGUF magic bytes)")
    return source


def missing_packages() -> list[str]:
    """The optional packages that do not import here."""
    missing = []
    for name in REQUIRED_PACKAGES:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    return missing


def check_out_dir(out: str | Path) -> Path:
    """The output folder, refused when it already holds files (a mix of two models would load as neither)."""
    folder = Path(out)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise GGUFImportError(f"{folder}: exists and is not an empty folder; choose a new --out")
    return folder


def read_config(source: Path) -> Any:
    """The HF config transformers derives from the file's metadata; GGUFImportError for an architecture it (or
    the engine) does not support."""
    from transformers import AutoConfig

    from service.engine.model import SUPPORTED_MODEL_TYPES, UnsupportedModelError, check_supported

    try:
        config = AutoConfig.from_pretrained(str(source.parent), gguf_file=source.name)
    except ValueError as err:  # "GGUF model with architecture X is not supported yet."
        supported = ", ".join(SUPPORTED_MODEL_TYPES)
        raise GGUFImportError(
            f"{source.name}: transformers cannot read it ({err}); kvstitch stitches {supported}"
        ) from None
    try:
        check_supported(config)
    except UnsupportedModelError as err:
        raise GGUFImportError(f"{source.name}: {err}") from None
    return config


def rebuild(gguf_model: Any, dtype: torch.dtype) -> Any:
    """A plain model of the same class and config holding the GGUF model's (dequantised) weights."""
    from transformers import AutoModelForCausalLM

    settings = gguf_model.config.to_dict()
    for name in GGUF_ONLY_KEYS:
        settings.pop(name, None)
    config = type(gguf_model.config).from_dict(settings)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(gguf_model.state_dict(), strict=True)
    plain.generation_config = gguf_model.generation_config
    return plain.to(dtype).eval()


def import_gguf(path: str | Path, out: str | Path, dtype: torch.dtype | None = None) -> ImportedModel:
    """Convert the GGUF file at `path` into an HF folder at `out` (weights in `dtype`, default the fp32 they
    dequantise to)."""
    source = check_gguf_file(path)
    folder = check_out_dir(out)
    missing = missing_packages()
    if missing:
        raise GGUFImportError(f"reading a GGUF file needs the optional {' and '.join(missing)}: {INSTALL_HINT}")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    config = read_config(source)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
        gguf_model = AutoModelForCausalLM.from_pretrained(
            str(source.parent), gguf_file=source.name, dtype=torch.float32
        )
    except ValueError as err:  # a tokenizer kind or tensor layout transformers' GGUF reader does not know
        raise GGUFImportError(f"{source.name}: transformers cannot read it ({err})") from None
    chosen = dtype or torch.float32
    plain = rebuild(gguf_model, chosen)
    folder.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    count = sum(p.numel() for p in plain.parameters())
    return ImportedModel(folder, str(config.model_type), count, chosen)


def run_import_gguf(file: str, out: str, dtype_name: str | None) -> int:
    """`kvstitch import-gguf`: 0 done, 2 with one line on stderr for a file that cannot be imported."""
    import sys

    try:
        result = import_gguf(file, out, IMPORT_DTYPES[dtype_name] if dtype_name else None)
    except (GGUFImportError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    dtype = str(result.dtype).removeprefix("torch.")
    print(
        f"imported {result.model_type} ({result.parameters / 1e6:.1f}M parameters, {dtype}) to {result.out}; "
        f"check it with: kvstitch verify --model {result.out}"
    )
    return 0
