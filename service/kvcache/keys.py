"""Identities of models and of cached blocks.

A cached block may be reused only by the exact model, template and layout that produced it, so everything
that changes the bytes of a block is folded into its key. Keys are sha256 digests over an explicit,
length-prefixed encoding; Python's `hash()` is salted per process and is never used.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import torch

from service.engine.kv_layout import LAYOUT_NAME, LAYOUT_VERSION, ModelSpec

# Bumped whenever the material hashed below changes, so old fingerprints and keys can never match new ones.
FINGERPRINT_VERSION = 1
BLOCK_KEY_VERSION = 1
BLOCK_KEY_HEX_CHARS = 32  # 128 bits; a collision is still caught because each file stores its token ids
BLOCK_KEY_PATTERN = re.compile(rf"[0-9a-f]{{{BLOCK_KEY_HEX_CHARS}}}")

# Config fields that describe the saving run or runtime switches, not the function the model computes.
VOLATILE_CONFIG_FIELDS = frozenset(
    {
        "transformers_version",
        "_name_or_path",
        "_commit_hash",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
    }
)
SAMPLE_BYTES = 1 << 20  # read from each end of a weights file
STRIDE_SAMPLES = 16  # extra windows spread across the middle of a weights file
STRIDE_SAMPLE_BYTES = 64 << 10
MAX_SAFETENSORS_HEADER = 100 << 20  # larger than any real header; bounds what a damaged file makes us read
PARAM_SAMPLE_ELEMENTS = 4096


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> `bfloat16`: the spelling used in keys and file headers."""
    return str(dtype).removeprefix("torch.")


def is_block_key(text: str) -> bool:
    """True when `text` has the exact shape of a `block_key` (safe to use in file and Redis key names)."""
    return BLOCK_KEY_PATTERN.fullmatch(text) is not None


# ---- model fingerprint -------------------------------------------------------------------------------------


class FingerprintedModel(Protocol):
    """What a fingerprint reads of a loaded model (the engine's `LoadedModel`)."""

    hf: Any
    spec: ModelSpec
    source: str
    fingerprint: str | None


def model_fingerprint(model: FingerprintedModel) -> str:
    """Stable hex digest of what the model computes: its config, its weights and the dtype it runs in (or the
    identity a model without weight files names itself, `LoadedModel.fingerprint`)."""
    if model.fingerprint is not None:
        return model.fingerprint
    digest = hashlib.sha256()
    _add_field(digest, f"kvstitch-model-fingerprint/{FINGERPRINT_VERSION}")
    _add_field(digest, canonical_config(model.hf.config.to_dict()))
    _add_field(digest, dtype_name(model.spec.dtype))
    weight_files = safetensors_files(model.source)
    if weight_files:
        for path in weight_files:
            _add_field(digest, _safetensors_identity(path))
    else:
        _add_field(digest, _parameters_identity(model.hf.state_dict()))
    return digest.hexdigest()


def canonical_config(config: dict[str, Any]) -> str:
    """The config as sorted, compact JSON without the fields that change when nothing real did."""
    kept = {k: v for k, v in config.items() if k not in VOLATILE_CONFIG_FIELDS and not k.startswith("_")}
    # default=str covers odd values (dtypes, enums) some configs carry; they are stable within a version.
    return json.dumps(kept, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str)


def safetensors_files(source: str) -> list[Path]:
    """The weight files of a local model folder, sorted; empty for a hub id or a folder without them."""
    folder = Path(source)
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.glob("*.safetensors") if p.is_file())


def _safetensors_identity(path: Path) -> str:
    """Name, size and a sha256 of the header plus sampled windows of one weights file.

    Hashing every byte of a 15 GB model costs tens of seconds at each start. The safetensors header names
    every tensor with its dtype, shape and offset, and a fine-tune or re-quantisation rewrites nearly every
    byte, so the header, both 1 MiB ends and a few windows across the middle tell models apart in
    milliseconds.
    An in-place edit of a few weights in the middle of a large shard would go unnoticed; such a model must
    be saved under a changed config or a new file to get fresh cache keys.
    """
    size = path.stat().st_size
    sample = hashlib.sha256()
    with path.open("rb") as f:
        sample.update(_read_safetensors_header(f, size))
        for offset, length in _sample_windows(size):
            f.seek(offset)
            sample.update(f.read(length))
    return f"{path.name}:{size}:{sample.hexdigest()}"


def _read_safetensors_header(f: BinaryIO, size: int) -> bytes:
    """The 8-byte length prefix and the JSON header, clipped to the file and a sane maximum."""
    prefix = f.read(8)
    if len(prefix) < 8:
        return prefix
    (declared,) = struct.unpack("<Q", prefix)
    return prefix + f.read(min(declared, size - 8, MAX_SAFETENSORS_HEADER))


def _sample_windows(size: int) -> Iterable[tuple[int, int]]:
    """(offset, length) of the first and last MiB and evenly spaced middle windows."""
    yield 0, min(size, SAMPLE_BYTES)
    yield max(0, size - SAMPLE_BYTES), min(size, SAMPLE_BYTES)
    for i in range(1, STRIDE_SAMPLES + 1):
        yield size * i // (STRIDE_SAMPLES + 1), STRIDE_SAMPLE_BYTES


def _parameters_identity(state: dict[str, torch.Tensor]) -> str:
    """Names, dtypes, shapes and the first elements of every tensor (used when no weight files are local)."""
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach()
        _add_field(digest, f"{name}:{dtype_name(tensor.dtype)}:{tuple(tensor.shape)}")
        head = tensor.reshape(-1)[:PARAM_SAMPLE_ELEMENTS].to("cpu").contiguous()
        # Viewing as bytes works for every dtype, bf16 included, and reads the stored bits exactly.
        digest.update(head.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


# ---- block key ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KeySpace:
    """Everything `block_key` folds in besides the token ids: two processes whose key spaces differ compute different
    keys for the same chunk, so one's keys mean nothing to the other (a router must not compare them)."""

    fingerprint: str
    template_version: str
    dtype: str
    stored: str = "native"

    def digest(self) -> str:
        """A short stable id of the key space, carried by every tier event."""
        digest = hashlib.sha256()
        for value in (f"kvstitch-key-space/{BLOCK_KEY_VERSION}", *dataclasses.astuple(self)):
            _add_field(digest, value)
        return digest.hexdigest()[:BLOCK_KEY_HEX_CHARS]

    def differences(self, other: KeySpace) -> list[str]:
        """The names of the fields that differ, for a log line that says why keys do not match."""
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) != getattr(other, f.name)]


def block_key(
    fingerprint: str, template_version: str, dtype: torch.dtype, token_ids: Sequence[int], stored: str = "native"
) -> str:
    """The cache key of one block: identical across processes and machines for identical inputs.

    `stored` is the disk form ("native", "int8", "fp8"). An 8-bit form adds a field, so its blocks never share
    a key (file, index entry) with native ones, while native keys stay what they were before 8-bit forms existed.
    """
    digest = hashlib.sha256()
    fields = [
        f"kvstitch-block-key/{BLOCK_KEY_VERSION}",
        fingerprint,
        template_version,
        f"{LAYOUT_NAME}/{LAYOUT_VERSION}",
        dtype_name(dtype),
    ]
    if stored != "native":
        fields.append(f"stored:{stored}")
    for field in fields:
        _add_field(digest, field)
    digest.update(pack_token_ids(token_ids))
    return digest.hexdigest()[:BLOCK_KEY_HEX_CHARS]


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    """Count (uint64) then each id as little-endian int64: one byte string per id sequence."""
    ids = [int(t) for t in token_ids]
    if any(t < 0 for t in ids):
        raise ValueError("token ids must be non-negative")
    return struct.pack(f"<Q{len(ids)}q", len(ids), *ids)


def _add_field(digest: Any, text: str) -> None:
    """Length-prefix each field so that ('ab', 'c') and ('a', 'bc') hash differently."""
    data = text.encode("utf-8")
    digest.update(struct.pack("<Q", len(data)))
    digest.update(data)
