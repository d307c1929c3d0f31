"""One file per cached block: a small self-describing header, then the raw KV tensor bytes.

Layout (all integers little-endian):

    offset 0   magic  b"KVSTITCH"                       8 bytes
    offset 8   format version                           uint32
    offset 12  header length H                          uint32
    offset 16  xxh3_64 of the header bytes              uint64
    offset 24  header: UTF-8 JSON object                H bytes
               zero padding up to the next multiple of 4096
    offset P   payload: the C-contiguous tensor bytes   payload_bytes

An 8-bit stored form (`quant` in the header: "int8" or "fp8", see `quant.py`) keeps this layout; its payload is
the 8-bit tensor, zero padding to the next page, then the float32 scales, all under the one payload checksum.
The header's `dtype` is then the 8-bit dtype and `quant` names the form, the compute dtype it dequantises to and
where the scales are and how many; a reader asks for one form and treats any other as a mismatch (corrupt), so a
bf16 reader never reads 8-bit bytes as bf16 (block keys differ by form as well).

The payload starts 4096-aligned so it can be read with O_DIRECT straight into a page-aligned (pinned) buffer:
the header is read buffered and checked first, then, given a `DirectReads` and a destination that starts on a
page and has room for the payload rounded up to whole pages, the payload is read with O_DIRECT (no page-cache
copy, no cache pollution). Filesystems that refuse O_DIRECT (EINVAL: older tmpfs, some overlays) fall back to
buffered reads, remembered per directory. Every byte is covered by a check, whichever way it was read: the
preamble by value, the header by its own hash, the padding by being zero and the payload by an xxh3_128
checksum (non-cryptographic, several GB/s, so reads stay disk-bound). Nothing is ever unpickled; a file is
trusted only after all checks pass.
"""

from __future__ import annotations

import errno
import io
import json
import logging
import math
import os
import re
import secrets
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import xxhash

from service.engine.kv_layout import LAYOUT_NAME, LAYOUT_VERSION, KVBlock, ModelSpec, block_shape
from service.kvcache import quant
from service.kvcache.keys import dtype_name, is_block_key
from service.kvcache.quant import DiskFormat, QuantizedKV

MAGIC = b"KVSTITCH"
FORMAT_VERSION = 1
PREAMBLE = struct.Struct("<8sIIQ")  # magic, version, header length, header hash
ALIGNMENT = 4096
MAX_HEADER_BYTES = 16 << 20
BLOCK_SUFFIX = ".kvblock"
TEMP_SUFFIX = ".tmp"
CHECKSUM_ALGORITHM = "xxh3_128"
FORMAT_NAME = "kvstitch-kv-block"
STORABLE_DTYPES: dict[str, torch.dtype] = {
    dtype_name(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.uint8, quant.FP8_DTYPE)
}
NATIVE_DTYPES = frozenset(STORABLE_DTYPES.values()) - {quant.FP8_DTYPE}  # fp8 only as an 8-bit stored form
# `.<key>.kvblock.<pid>.<random>.tmp`, written next to the final file and renamed over it.
TEMP_NAME_PATTERN = re.compile(r"\.[0-9a-f]+\.kvblock\.\d+\.[0-9a-f]+\.tmp")
# O_DIRECT needs the file offset, the buffer address and the length in whole logical blocks of the device;
# 4096 covers 512-byte and 4K-native drives. Linux only: elsewhere the flag is 0 and every read is buffered.
O_DIRECT = getattr(os, "O_DIRECT", 0)
DIRECT_REFUSALS = (errno.EINVAL, errno.EOPNOTSUPP)

# Bytes of a header's JSON besides its token ids (key, fingerprint, layout, shape, checksum, 8-bit fields: under
# 1 KiB today), for the size bound of a block file fetched from the shared tier.
HEADER_FIXED_BYTES = 4096

log = logging.getLogger(__name__)

# Where a block's bytes came from, for error messages: a file, or an object of the shared tier ("s3://...").
Where = Path | str


class _Readable(Protocol):
    """A block file open for reading, or an in-memory copy of one (io.BytesIO)."""

    def read(self, size: int = -1, /) -> bytes: ...

    def readinto(self, buffer: memoryview, /) -> int | None: ...

    def seek(self, offset: int, whence: int = 0, /) -> int: ...


class CorruptBlockError(ValueError):
    """A block file exists but fails a check; the message says which one."""


class MissingBlockError(FileNotFoundError):
    """No block file at the path."""


class DirectReads:
    """Where payloads may be read with O_DIRECT: every directory until its filesystem refuses (then it is
    remembered, so each directory fails at most once). Shared by a disk tier's reader threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._refused: set[Path] = set()
        self.reads = 0  # payloads read with O_DIRECT

    def allowed(self, directory: Path) -> bool:
        with self._lock:
            return O_DIRECT != 0 and directory not in self._refused

    def refused(self) -> set[Path]:
        with self._lock:
            return set(self._refused)

    def refuse(self, directory: Path, err: OSError) -> None:
        with self._lock:
            first = directory not in self._refused
            self._refused.add(directory)
        if first:
            log.info("O_DIRECT refused in %s (%s); reading its blocks buffered", directory, err)

    def count(self) -> None:
        with self._lock:
            self.reads += 1


@dataclass(frozen=True)
class BlockHeader:
    """The parsed, self-consistent header of a block file."""

    key: str
    model_fingerprint: str
    layout_name: str
    layout_version: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    num_tokens: int
    token_ids: tuple[int, ...]
    payload_offset: int
    payload_bytes: int
    checksum_algorithm: str
    checksum: str
    created: float
    quant: QuantField | None = None  # set for an 8-bit stored form


@dataclass(frozen=True)
class QuantField:
    """The header's `quant` object: which 8-bit form, what it dequantises to, where its scales are."""

    format: DiskFormat
    compute_dtype: torch.dtype
    scales_dtype: str
    scales_offset: int  # from the start of the payload
    scales_count: int


@dataclass(frozen=True)
class QuantBlock:
    """A block read in an 8-bit stored form: `payload` is its flat uint8 bytes (a view of `into` when given),
    `kv` views of its data and scales inside them."""

    token_ids: tuple[int, ...]
    payload: torch.Tensor
    kv: QuantizedKV

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def block_relpath(key: str) -> str:
    """Where a block lives, relative to the cache dir: fanned out by the key's first byte."""
    if not is_block_key(key):
        raise ValueError(f"not a block key: {key!r}")
    return f"{key[:2]}/{key}{BLOCK_SUFFIX}"


def is_temp_file(path: Path) -> bool:
    """True for a writer's temp file (live or left behind by a crash)."""
    return TEMP_NAME_PATTERN.fullmatch(path.name) is not None


# ---- writing -----------------------------------------------------------------------------------------------


def write_block(path: Path, key: str, fingerprint: str, block: KVBlock, fmt: DiskFormat = "native") -> int:
    """Write a block atomically (temp file, fsync, rename, fsync dir) and return the file's size in bytes.

    `fmt` "int8" or "fp8" stores the block quantised (its KV must be finite floats); "native" stores its bytes.

    Concurrent writers of one key each rename a complete file over the name; readers see the old or the new
    file, never a mix, because a rename swaps the directory entry while open files keep their inode.
    """
    if not is_block_key(key):
        raise ValueError(f"not a block key: {key!r}")
    payload = _payload_bytes_of(block)
    quant_fields = None
    if fmt != "native":
        q = quant.quantize(block.kv.detach().to("cpu"), fmt)
        payload = quant.pack(q).numpy().data  # the memoryview keeps the packed tensor alive
        shape = tuple(q.data.shape)
        quant_fields = {
            "format": fmt,
            "compute_dtype": dtype_name(block.kv.dtype),
            "scales_dtype": dtype_name(quant.SCALE_DTYPE),
            "scales_offset": quant.scales_offset(shape),
            "scales_count": quant.scale_count(fmt, shape),
        }
    header = _encode_header(key, fingerprint, block, payload, quant_fields)
    _write_atomically(Path(path), key, (header, payload))
    return len(header) + len(payload)


def write_block_bytes(path: Path, key: str, data: bytes) -> int:
    """Write a whole block file's bytes, already encoded and checked (a copy of the shared tier's object),
    atomically like `write_block`; returns the size."""
    if not is_block_key(key):
        raise ValueError(f"not a block key: {key!r}")
    _write_atomically(Path(path), key, (data,))
    return len(data)


def _write_atomically(path: Path, key: str, parts: Sequence[bytes | memoryview]) -> None:
    """Temp file, fsync, rename, fsync dir (and the new fan-out directory)."""
    created_dir = _ensure_dir(path.parent)
    temp = path.parent / f".{key}{BLOCK_SUFFIX}.{os.getpid()}.{secrets.token_hex(8)}{TEMP_SUFFIX}"
    try:
        with temp.open("xb") as f:
            for part in parts:
                f.write(part)
            f.flush()
            os.fsync(f.fileno())
        temp.replace(path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    if created_dir:
        _fsync_dir(path.parent.parent)  # make the new fan-out directory itself durable


def _payload_bytes_of(block: KVBlock) -> memoryview:
    """The tensor's bytes on the CPU, C-contiguous, without copying a CPU tensor that already is."""
    kv = block.kv.detach().to("cpu").contiguous()
    if kv.dim() != 5:
        raise ValueError(f"KV of shape {tuple(kv.shape)} is not in the 5-axis block layout")
    if kv.dtype not in NATIVE_DTYPES:
        raise ValueError(f"cannot store KV of dtype {kv.dtype}; storable: {', '.join(STORABLE_DTYPES)}")
    if kv.shape[3] != block.num_tokens or block.num_tokens == 0:
        raise ValueError(f"KV shape {tuple(kv.shape)} does not hold the block's {block.num_tokens} tokens")
    return kv.reshape(-1).view(torch.uint8).numpy().data


def _encode_header(
    key: str, fingerprint: str, block: KVBlock, payload: memoryview, quant_fields: dict[str, Any] | None
) -> bytes:
    """Preamble, JSON header and zero padding up to the aligned payload offset."""
    stored = block.kv.dtype if quant_fields is None else quant.storage_dtype(quant_fields["format"])
    fields: dict[str, Any] = {
        "format": FORMAT_NAME,
        "key": key,
        "model_fingerprint": fingerprint,
        "layout": {"name": LAYOUT_NAME, "version": LAYOUT_VERSION},
        "dtype": dtype_name(stored),
        "shape": list(block.kv.shape),
        "num_tokens": block.num_tokens,
        "token_ids": [int(t) for t in block.token_ids],
        "payload_bytes": payload.nbytes,
        "checksum": {"algorithm": CHECKSUM_ALGORITHM, "value": xxhash.xxh3_128_hexdigest(payload)},
        "created": time.time(),
    }
    if quant_fields is not None:
        fields["quant"] = quant_fields
    # The offset is written into the header it precedes; growing digits can push it one boundary further,
    # so iterate to the fixed point (at most two rounds in practice).
    offset = 0
    while True:
        fields["payload_offset"] = offset
        body = _json(fields)
        needed = _aligned(PREAMBLE.size + len(body))
        if needed == offset:
            break
        offset = needed
    preamble = PREAMBLE.pack(MAGIC, FORMAT_VERSION, len(body), xxhash.xxh3_64_intdigest(body))
    return preamble + body + bytes(offset - PREAMBLE.size - len(body))


def _json(fields: dict[str, Any]) -> bytes:
    return json.dumps(fields, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def _aligned(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


def _ensure_dir(directory: Path) -> bool:
    """Create the directory if needed; True when this call created it."""
    if directory.is_dir():
        return False
    directory.mkdir(parents=True, exist_ok=True)
    return True


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- reading -----------------------------------------------------------------------------------------------


def read_header(path: Path, verify_payload: bool = False) -> BlockHeader:
    """The checked header of a block file (for index repair); the payload checksum only when asked."""
    with _open_block(path) as f:
        header = _read_checked_header(f, path, os.fstat(f.fileno()).st_size)
        if verify_payload:
            payload = torch.empty(header.payload_bytes, dtype=torch.uint8)
            _read_payload(f, path, header, payload)
            _verify_payload(path, header, payload)
        return header


def read_block(
    path: Path,
    expected_key: str,
    expected_fingerprint: str,
    spec: ModelSpec,
    into: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
    expected_token_ids: Sequence[int] | None = None,
    direct: DirectReads | None = None,
) -> KVBlock:
    """Read and check a block stored for this key, model and spec.

    `dtype` is the stored dtype to expect (default `spec.dtype`; 8-bit storage passes its own). `into` is an
    optional preallocated CPU tensor (pinned or not) the payload is read straight into; the returned block's
    KV is then a view of its first payload bytes. With `direct`, the payload is read with O_DIRECT when
    `into` starts on a page, has room for the payload rounded up to whole pages (which the read may fill)
    and the directory allows it; otherwise buffered. `expected_token_ids`, when given, must equal the stored
    ids, which turns a key collision into an error instead of wrong KV. Raises `CorruptBlockError` on any
    failed check and `MissingBlockError` (a `FileNotFoundError`) when there is no file.
    """
    path = Path(path)
    expected = _Expected(expected_key, expected_fingerprint, spec, dtype or spec.dtype, "native", expected_token_ids)
    header, target = _read_checked_payload(path, expected, into, direct)
    return _native_block(header, target)


def read_quant_block(
    path: Path,
    expected_key: str,
    expected_fingerprint: str,
    spec: ModelSpec,
    fmt: DiskFormat,
    into: torch.Tensor | None = None,
    expected_token_ids: Sequence[int] | None = None,
    direct: DirectReads | None = None,
) -> QuantBlock:
    """Read and check a block stored in the 8-bit form `fmt`, to be dequantised into `spec.dtype`.

    Like `read_block` (same checks, `into` and `direct`), plus: the file must be in this form for this compute
    dtype, the padding between data and scales must be zero and every scale finite and positive. The payload
    stays 8-bit: `quant.dequantize(block.kv)` (on the device, after copying `block.payload`) makes the KV.
    """
    path = Path(path)
    storage = quant.storage_dtype(fmt)
    expected = _Expected(expected_key, expected_fingerprint, spec, storage, fmt, expected_token_ids)
    header, target = _read_checked_payload(path, expected, into, direct)
    return _quant_block(path, header, target, fmt, spec)


def read_block_bytes(
    data: bytes,
    source: str,
    expected_key: str,
    expected_fingerprint: str,
    spec: ModelSpec,
    fmt: DiskFormat = "native",
    into: torch.Tensor | None = None,
    expected_token_ids: Sequence[int] | None = None,
) -> KVBlock | QuantBlock:
    """A block file's whole bytes (an object of the shared tier) checked exactly as `read_block` and
    `read_quant_block` check a file: preamble, header hash, fields, padding, size, key, model, shape, form,
    token ids and payload checksum. `source` names where the bytes came from in error messages. Returns a
    `KVBlock` for "native", a `QuantBlock` for an 8-bit `fmt`; raises `CorruptBlockError` on any failed check."""
    storage = spec.dtype if fmt == "native" else quant.storage_dtype(fmt)
    expected = _Expected(expected_key, expected_fingerprint, spec, storage, fmt, expected_token_ids)
    f = io.BytesIO(data)  # shares `data`'s buffer: no copy
    header = _read_checked_header(f, source, len(data))
    _check_requested(header, source, expected)
    target = _payload_target(into, header)
    _read_payload(f, source, header, target)
    _verify_payload(source, header, target)
    if fmt == "native":
        return _native_block(header, target)
    return _quant_block(source, header, target, fmt, spec)


def verify_block_bytes(data: bytes, source: str, expected_key: str) -> BlockHeader:
    """The checked header of a block file's whole bytes, payload checksum included, for the block `expected_key`
    (whatever its model and form): what an upload checks before it shares a file."""
    f = io.BytesIO(data)
    header = _read_checked_header(f, source, len(data))
    if header.key != expected_key:
        raise CorruptBlockError(f"{source}: key mismatch: file holds {header.key}, expected {expected_key}")
    target = torch.empty(header.payload_bytes, dtype=torch.uint8)
    _read_payload(f, source, header, target)
    _verify_payload(source, header, target)
    return header


def max_file_bytes(payload_bytes: int, num_tokens: int) -> int:
    """The most bytes a block file of this payload and token count can take: the payload after a header
    rounded up to whole pages (its JSON holds up to 21 characters per token id, plus fixed fields)."""
    return _aligned(PREAMBLE.size + HEADER_FIXED_BYTES + 21 * num_tokens) + payload_bytes


def _native_block(header: BlockHeader, target: torch.Tensor) -> KVBlock:
    return KVBlock(token_ids=header.token_ids, kv=target.view(header.dtype).view(header.shape))


def _quant_block(
    where: Where, header: BlockHeader, target: torch.Tensor, fmt: DiskFormat, spec: ModelSpec
) -> QuantBlock:
    q = quant.unpack(target, fmt, header.shape, spec.dtype)
    gap = target[math.prod(header.shape) : quant.scales_offset(header.shape)]
    if bool(gap.any()):
        raise CorruptBlockError(f"{where}: non-zero bytes between the 8-bit data and its scales")
    if not bool((torch.isfinite(q.scales) & (q.scales > 0)).all()):
        raise CorruptBlockError(f"{where}: a scale is not a finite positive number")
    return QuantBlock(token_ids=header.token_ids, payload=target, kv=q)


@dataclass(frozen=True)
class _Expected:
    key: str
    fingerprint: str
    spec: ModelSpec
    dtype: torch.dtype  # of the stored payload
    fmt: DiskFormat
    token_ids: Sequence[int] | None


def _read_checked_payload(
    path: Path, expected: _Expected, into: torch.Tensor | None, direct: DirectReads | None
) -> tuple[BlockHeader, torch.Tensor]:
    """The checked header and the checksummed payload bytes (flat uint8, a view of `into` when given)."""
    with _open_block(path) as f:
        header = _read_checked_header(f, path, os.fstat(f.fileno()).st_size)
        _check_requested(header, path, expected)
        target = _payload_target(into, header)
        if not _read_payload_direct(f, path, header, into, direct):
            _read_payload(f, path, header, target)
    _verify_payload(path, header, target)
    return header, target


def _check_requested(header: BlockHeader, where: Where, expected: _Expected) -> None:
    _check_expected(header, where, expected)
    if expected.token_ids is not None and header.token_ids != tuple(int(t) for t in expected.token_ids):
        raise CorruptBlockError(f"{where}: token ids differ from the requested block (key collision)")


def _open_block(path: Path) -> io.FileIO:
    try:
        return Path(path).open("rb", buffering=0)
    except FileNotFoundError as err:
        raise MissingBlockError(f"no KV block file at {path}") from err


def _read_checked_header(f: _Readable, path: Where, file_size: int) -> BlockHeader:
    """Preamble, header hash, JSON fields, padding and file size: everything but the payload checksum."""
    raw = f.read(PREAMBLE.size)
    if len(raw) < PREAMBLE.size:
        raise CorruptBlockError(f"{path}: truncated: {len(raw)} bytes is shorter than the preamble")
    magic, version, header_len, header_hash = PREAMBLE.unpack(raw)
    if magic != MAGIC:
        raise CorruptBlockError(f"{path}: bad magic {magic!r}, not a kvstitch block file")
    if version != FORMAT_VERSION:
        raise CorruptBlockError(f"{path}: unsupported format version {version} (reads {FORMAT_VERSION})")
    if header_len > MAX_HEADER_BYTES or PREAMBLE.size + header_len > file_size:
        raise CorruptBlockError(f"{path}: header length {header_len} does not fit the {file_size}-byte file")
    body = f.read(header_len)
    if len(body) != header_len or xxhash.xxh3_64_intdigest(body) != header_hash:
        raise CorruptBlockError(f"{path}: header checksum mismatch (header bytes damaged)")
    header = _parse_header(body, path)
    _check_layout(header, path, PREAMBLE.size + header_len, file_size)
    padding = f.read(header.payload_offset - PREAMBLE.size - header_len)
    if padding.count(0) != len(padding):
        raise CorruptBlockError(f"{path}: non-zero bytes in the padding before the payload")
    return header


def _parse_header(body: bytes, path: Where) -> BlockHeader:
    """Decode the JSON header, checking every field's type; no value is trusted by shape alone."""
    try:
        fields = json.loads(body.decode("utf-8"))
        if not isinstance(fields, dict) or fields.get("format") != FORMAT_NAME:
            raise CorruptBlockError(f"{path}: header is not a {FORMAT_NAME} object")
        layout, checksum = _dict(fields, "layout"), _dict(fields, "checksum")
        return BlockHeader(
            key=_str(fields, "key"),
            model_fingerprint=_str(fields, "model_fingerprint"),
            layout_name=_str(layout, "name"),
            layout_version=_int(layout, "version"),
            dtype=_dtype(_str(fields, "dtype"), path),
            shape=tuple(_int_list(fields, "shape")),
            num_tokens=_int(fields, "num_tokens"),
            token_ids=tuple(_int_list(fields, "token_ids")),
            payload_offset=_int(fields, "payload_offset"),
            payload_bytes=_int(fields, "payload_bytes"),
            checksum_algorithm=_str(checksum, "algorithm"),
            checksum=_str(checksum, "value"),
            created=_float(fields, "created"),
            quant=_quant_field(fields, path),
        )
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as err:
        raise CorruptBlockError(f"{path}: unreadable header: {err}") from err


def _check_layout(header: BlockHeader, path: Where, header_end: int, file_size: int) -> None:
    """The header agrees with itself and with the file's size."""
    problems = []
    if header.layout_name != LAYOUT_NAME or header.layout_version != LAYOUT_VERSION:
        problems.append(
            f"layout {header.layout_name!r} v{header.layout_version} is not {LAYOUT_NAME!r} v{LAYOUT_VERSION}"
        )
    if len(header.shape) != 5 or header.shape[1] != 2 or header.shape[3] != header.num_tokens:
        problems.append(f"shape {header.shape} does not hold {header.num_tokens} tokens in the KV layout")
    if header.num_tokens < 1 or len(header.token_ids) != header.num_tokens:
        problems.append(f"{len(header.token_ids)} token ids stored for a token count of {header.num_tokens}")
    problems += _payload_problems(header)
    if header.payload_offset != _aligned(header_end):
        problems.append(f"payload offset {header.payload_offset} is not the aligned end of the header")
    if header.checksum_algorithm != CHECKSUM_ALGORITHM:
        problems.append(f"unknown checksum algorithm {header.checksum_algorithm!r}")
    if not problems and file_size != header.payload_offset + header.payload_bytes:
        problems.append(
            f"truncated or overlong: file is {file_size} bytes, header says "
            f"{header.payload_offset + header.payload_bytes}"
        )
    if problems:
        raise CorruptBlockError(f"{path}: " + "; ".join(problems))


def _payload_problems(header: BlockHeader) -> list[str]:
    """The payload's size (and for an 8-bit form, its scales) agrees with the dtype and shape."""
    q = header.quant
    if q is None:
        if header.dtype not in NATIVE_DTYPES:
            return [f"dtype {dtype_name(header.dtype)} is stored only in an 8-bit form"]
        element = torch.empty((), dtype=header.dtype).element_size()
        if header.payload_bytes != math.prod(header.shape) * element:
            return [f"payload of {header.payload_bytes} bytes does not match shape {header.shape}"]
        return []
    if len(header.shape) != 5:
        return []  # reported by the shape check
    problems = []
    if header.dtype != quant.storage_dtype(q.format):
        problems.append(f"{q.format} form stored as {dtype_name(header.dtype)}")
    if q.scales_dtype != dtype_name(quant.SCALE_DTYPE):
        problems.append(f"scales of dtype {q.scales_dtype!r}, not {dtype_name(quant.SCALE_DTYPE)}")
    if q.scales_offset != quant.scales_offset(header.shape):
        problems.append(f"scales at {q.scales_offset}, not {quant.scales_offset(header.shape)}")
    if q.scales_count != quant.scale_count(q.format, header.shape):
        problems.append(
            f"{q.scales_count} scales for shape {header.shape} in {q.format} form, "
            f"not {quant.scale_count(q.format, header.shape)}"
        )
    if header.payload_bytes != quant.payload_nbytes(q.format, header.shape):
        problems.append(f"payload of {header.payload_bytes} bytes does not match shape {header.shape} + scales")
    return problems


def _check_expected(header: BlockHeader, path: Where, expected: _Expected) -> None:
    """The file holds the block that was asked for, made by this model, in the shape and form this spec needs."""
    key, fingerprint, spec, dtype = expected.key, expected.fingerprint, expected.spec, expected.dtype
    form = "native" if header.quant is None else header.quant.format
    if form != expected.fmt:
        raise CorruptBlockError(f"{path}: stored form mismatch: file holds {form}, expected {expected.fmt}")
    if header.quant is not None and header.quant.compute_dtype != spec.dtype:
        raise CorruptBlockError(
            f"{path}: compute dtype mismatch: file dequantises to {dtype_name(header.quant.compute_dtype)}, "
            f"expected {dtype_name(spec.dtype)}"
        )
    if header.key != key:
        raise CorruptBlockError(f"{path}: key mismatch: file holds {header.key}, expected {key}")
    if header.model_fingerprint != fingerprint:
        raise CorruptBlockError(
            f"{path}: model fingerprint mismatch: file was written by "
            f"{header.model_fingerprint[:16]}…, expected {fingerprint[:16]}…"
        )
    if header.dtype != dtype:
        raise CorruptBlockError(
            f"{path}: dtype mismatch: file holds {dtype_name(header.dtype)}, expected {dtype_name(dtype)}"
        )
    if header.num_tokens > spec.max_context:
        raise CorruptBlockError(
            f"{path}: token count {header.num_tokens} exceeds the model's context {spec.max_context}"
        )
    needed = block_shape(spec, header.num_tokens)
    if header.shape != needed:
        raise CorruptBlockError(f"{path}: shape mismatch: file holds {header.shape}, model needs {needed}")


def _payload_target(into: torch.Tensor | None, header: BlockHeader) -> torch.Tensor:
    """A flat uint8 CPU tensor of exactly the payload's size: a view of `into`, or a new allocation."""
    if into is None:
        return torch.empty(header.payload_bytes, dtype=torch.uint8)
    if into.device.type != "cpu" or not into.is_contiguous():
        raise ValueError("`into` must be a contiguous CPU tensor (pinned or not)")
    flat = into.reshape(-1).view(torch.uint8)
    if flat.numel() < header.payload_bytes:
        raise ValueError(f"`into` holds {flat.numel()} bytes; the block needs {header.payload_bytes}")
    target = flat[: header.payload_bytes]
    # An 8-bit form's float32 scales are viewed in place, so they set the alignment it needs.
    element = quant.SCALE_DTYPE.itemsize if header.quant else torch.empty((), dtype=header.dtype).element_size()
    if target.data_ptr() % element:
        raise ValueError(f"`into` is not aligned for {dtype_name(header.dtype)} elements")
    return target


def _read_payload(f: _Readable, path: Where, header: BlockHeader, target: torch.Tensor) -> None:
    """Read the payload into `target`'s memory (buffered, no intermediate copy)."""
    view = target.numpy().data
    f.seek(header.payload_offset)
    filled = 0
    while filled < header.payload_bytes:
        n = f.readinto(view[filled:])
        if not n:
            raise CorruptBlockError(f"{path}: truncated payload: {filled} of {header.payload_bytes} bytes")
        filled += n


def _read_payload_direct(
    f: io.FileIO, path: Path, header: BlockHeader, into: torch.Tensor | None, direct: DirectReads | None
) -> bool:
    """Read the payload with O_DIRECT into `into`; False when not tried or not complete (read it buffered).

    A refusal by the filesystem is remembered for the directory. The O_DIRECT descriptor must be the file
    whose header was checked: a writer may have renamed a new file over the name between the two opens.
    """
    span = _direct_span(into, header)
    if span is None or direct is None or not direct.allowed(path.parent):
        return False
    try:
        fd = os.open(path, os.O_RDONLY | O_DIRECT)
    except FileNotFoundError:
        return False  # replaced or removed since the header was read: `f` still holds the checked file
    except OSError as err:
        return _refused(direct, path, err)
    try:
        if not os.path.samestat(os.fstat(fd), os.fstat(f.fileno())):
            return False
        filled = _pread_direct(fd, span, header.payload_offset, header.payload_bytes)
    except OSError as err:
        return _refused(direct, path, err)
    finally:
        os.close(fd)
    if filled < header.payload_bytes:
        return False  # short or unaligned read: the buffered read decides whether the file is truncated
    direct.count()
    return True


def _direct_span(into: torch.Tensor | None, header: BlockHeader) -> torch.Tensor | None:
    """`into`'s first bytes up to the payload size rounded up to whole pages, if it starts on a page and
    has room for them (an O_DIRECT read transfers whole pages); otherwise None."""
    if into is None:
        return None
    flat = into.reshape(-1).view(torch.uint8)
    length = _aligned(header.payload_bytes)
    if flat.data_ptr() % ALIGNMENT or flat.numel() < length:
        return None
    return flat[:length]


def _pread_direct(fd: int, span: torch.Tensor, offset: int, nbytes: int) -> int:
    """Bytes of the payload read into `span` in whole pages; stops at end of file or an unaligned read."""
    view = span.numpy().data
    filled = 0
    while filled < nbytes:
        n = os.preadv(fd, [view[filled:]], offset + filled)
        filled += n
        if n == 0 or filled % ALIGNMENT:
            break  # end of file (the last page is short), or a partial read the next call could not align
    return filled


def _refused(direct: DirectReads, path: Path, err: OSError) -> bool:
    """A refusal of O_DIRECT (remembered, then read buffered) or another error (raised)."""
    if err.errno not in DIRECT_REFUSALS:
        raise err
    direct.refuse(path.parent, err)
    return False


def _verify_payload(path: Where, header: BlockHeader, target: torch.Tensor) -> None:
    """The payload's checksum is the header's."""
    actual = xxhash.xxh3_128_hexdigest(target.numpy().data)
    if actual != header.checksum:
        raise CorruptBlockError(
            f"{path}: payload checksum mismatch ({CHECKSUM_ALGORITHM}): header says "
            f"{header.checksum}, payload hashes to {actual}"
        )


# ---- typed field access ------------------------------------------------------------------------------------


def _dict(fields: dict[str, Any], name: str) -> dict[str, Any]:
    value = fields[name]
    if not isinstance(value, dict):
        raise TypeError(f"field {name!r} is not an object")
    return value


def _str(fields: dict[str, Any], name: str) -> str:
    value = fields[name]
    if not isinstance(value, str):
        raise TypeError(f"field {name!r} is not a string")
    return value


def _int(fields: dict[str, Any], name: str) -> int:
    value = fields[name]
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TypeError(f"field {name!r} is not a non-negative integer")
    return value


def _int_list(fields: dict[str, Any], name: str) -> list[int]:
    values = fields[name]
    if not isinstance(values, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values
    ):
        raise TypeError(f"field {name!r} is not a list of non-negative integers")
    return [int(v) for v in values]


def _float(fields: dict[str, Any], name: str) -> float:
    value = fields[name]
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise TypeError(f"field {name!r} is not a finite number")
    return float(value)


def _quant_field(fields: dict[str, Any], path: Where) -> QuantField | None:
    if "quant" not in fields:
        return None
    q = _dict(fields, "quant")
    fmt = _str(q, "format")
    if fmt not in quant.QUANT_FORMATS:
        raise CorruptBlockError(f"{path}: unknown 8-bit form {fmt!r}")
    return QuantField(
        format="int8" if fmt == "int8" else "fp8",
        compute_dtype=_dtype(_str(q, "compute_dtype"), path),
        scales_dtype=_str(q, "scales_dtype"),
        scales_offset=_int(q, "scales_offset"),
        scales_count=_int(q, "scales_count"),
    )


def _dtype(name: str, path: Where) -> torch.dtype:
    if name not in STORABLE_DTYPES:
        raise CorruptBlockError(f"{path}: unknown dtype {name!r}")
    return STORABLE_DTYPES[name]
