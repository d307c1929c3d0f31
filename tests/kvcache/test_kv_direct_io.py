"""O_DIRECT payload reads: the bytes of a buffered read, straight into page-aligned memory, a clean fallback
(remembered per directory) where the filesystem refuses, and every check still applied."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from kv_support import BlockFactory, SpecFactory, bits

from service.engine.kv_layout import KVBlock, ModelSpec
from service.kvcache.fileformat import (
    ALIGNMENT,
    O_DIRECT,
    CorruptBlockError,
    DirectReads,
    read_block,
    read_header,
    write_block,
)
from service.kvcache.keys import block_key

FINGERPRINT = "f" * 64
pytestmark = pytest.mark.skipif(O_DIRECT == 0, reason="this platform has no O_DIRECT")
REAL_OPEN = os.open
REAL_PREADV = os.preadv


def store_in(directory: Path, block: KVBlock) -> tuple[Path, str]:
    """The block written straight into `directory` (no fan-out, so several files share one directory)."""
    key = block_key(FINGERPRINT, "tpl:1", block.kv.dtype, block.token_ids)
    path = directory / f"{key}.kvblock"
    write_block(path, key, FINGERPRINT, block)
    return path, key


def page_aligned(nbytes: int, offset: int = 0) -> torch.Tensor:
    """`nbytes` of uint8 starting `offset` bytes past a page boundary, filled with 0xA5."""
    raw = torch.full((nbytes + offset + ALIGNMENT,), 0xA5, dtype=torch.uint8)
    start = -raw.data_ptr() % ALIGNMENT + offset
    return raw[start : start + nbytes]


def whole_pages(path: Path) -> int:
    return -(-read_header(path).payload_bytes // ALIGNMENT) * ALIGNMENT


def read(path: Path, key: str, spec: ModelSpec, into: torch.Tensor | None, direct: DirectReads) -> KVBlock:
    return read_block(path, key, FINGERPRINT, spec, into=into, direct=direct)


@pytest.fixture(autouse=True)
def direct_capable(tmp_path: Path) -> None:
    """Skip where the test directory's filesystem itself refuses O_DIRECT (the fallback tests fake that)."""
    probe = tmp_path / "probe"
    probe.write_bytes(bytes(ALIGNMENT))
    try:
        os.close(os.open(probe, os.O_RDONLY | O_DIRECT))
    except OSError as err:
        pytest.skip(f"the test filesystem refuses O_DIRECT: {err}")
    finally:
        probe.unlink()


def refusing(calls: list[Path], error: int = errno.EINVAL) -> Callable[..., int]:
    """An `os.open` that fails O_DIRECT opens with `error` (recording their paths) and opens the rest."""

    def fake_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & O_DIRECT:
            calls.append(Path(path).parent)
            raise OSError(error, os.strerror(error), str(path))
        return REAL_OPEN(path, flags, *args, **kwargs)

    return fake_open


# ---- the direct path ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "num_tokens"),
    [(torch.float32, 8), (torch.bfloat16, 37)],
    ids=["payload-of-whole-pages", "payload-ends-mid-page"],
)
def test_direct_read_gives_the_bytes_of_a_buffered_read_in_the_given_buffer(
    tmp_path: Path, make_spec: SpecFactory, make_block: BlockFactory, dtype: torch.dtype, num_tokens: int
) -> None:
    spec = make_spec(dtype=dtype)
    block = make_block(spec, num_tokens=num_tokens, seed=7)
    path, key = store_in(tmp_path, block)
    payload_bytes = read_header(path).payload_bytes
    assert (payload_bytes % ALIGNMENT == 0) == (num_tokens == 8)
    direct = DirectReads()
    into = page_aligned(whole_pages(path))

    buffered = read_block(path, key, FINGERPRINT, spec)
    loaded = read(path, key, spec, into, direct)

    assert direct.reads == 1 and direct.refused() == set()
    assert torch.equal(bits(loaded.kv), bits(buffered.kv))
    assert torch.equal(bits(loaded.kv), bits(block.kv))
    assert loaded.token_ids == block.token_ids and loaded.kv.dtype == dtype
    assert loaded.kv.data_ptr() == into.data_ptr()
    assert loaded.kv.numel() * loaded.kv.element_size() == payload_bytes  # the view stops at the payload


@pytest.mark.parametrize("buffer", ["off-page", "payload-only", "none"])
def test_reads_are_buffered_when_the_buffer_cannot_take_whole_pages(
    tmp_path: Path, make_spec: SpecFactory, make_block: BlockFactory, buffer: str
) -> None:
    spec = make_spec(dtype=torch.bfloat16)
    block = make_block(spec, num_tokens=37, seed=2)
    path, key = store_in(tmp_path, block)
    payload_bytes = read_header(path).payload_bytes
    into = {
        "off-page": page_aligned(whole_pages(path), offset=64),  # element-aligned, not page-aligned
        "payload-only": page_aligned(payload_bytes),  # no room for the last page
        "none": None,
    }[buffer]
    direct = DirectReads()

    loaded = read(path, key, spec, into, direct)

    assert direct.reads == 0 and direct.refused() == set()
    assert torch.equal(bits(loaded.kv), bits(block.kv))


# ---- falling back ------------------------------------------------------------------------------------------


def test_a_refused_open_falls_back_and_is_remembered_per_directory(
    tmp_path: Path, make_spec: SpecFactory, make_block: BlockFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = make_spec()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    blocks = [make_block(spec, num_tokens=20, seed=s) for s in range(3)]
    files = [store_in(tmp_path / d, b) for d, b in zip("aab", blocks, strict=True)]
    attempts: list[Path] = []
    monkeypatch.setattr(os, "open", refusing(attempts))
    direct = DirectReads()

    loaded = [read(path, key, spec, page_aligned(whole_pages(path)), direct) for path, key in [*files, files[0]]]

    assert attempts == [tmp_path / "a", tmp_path / "b"]  # each directory was tried once
    assert direct.refused() == {tmp_path / "a", tmp_path / "b"} and direct.reads == 0
    for got, want in zip(loaded, [*blocks, blocks[0]], strict=True):
        assert torch.equal(bits(got.kv), bits(want.kv))


def test_a_refused_read_falls_back_and_other_directories_still_read_direct(
    tmp_path: Path, make_spec: SpecFactory, make_block: BlockFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = make_spec()
    (tmp_path / "refusing").mkdir()
    (tmp_path / "fine").mkdir()
    block = make_block(spec, num_tokens=20, seed=4)
    refused_path, key = store_in(tmp_path / "refusing", block)
    fine_path, _ = store_in(tmp_path / "fine", block)
    direct = DirectReads()

    def failing_preadv(fd: int, buffers: Any, offset: int) -> int:
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(os, "preadv", failing_preadv)
    first = read(refused_path, key, spec, page_aligned(whole_pages(refused_path)), direct)
    monkeypatch.setattr(os, "preadv", REAL_PREADV)
    again = read(refused_path, key, spec, page_aligned(whole_pages(refused_path)), direct)
    other = read(fine_path, key, spec, page_aligned(whole_pages(fine_path)), direct)

    assert direct.refused() == {tmp_path / "refusing"}
    assert direct.reads == 1  # only the file in the other directory
    for got in (first, again, other):
        assert torch.equal(bits(got.kv), bits(block.kv))


def test_other_read_errors_are_raised_not_remembered(
    tmp_path: Path, make_spec: SpecFactory, make_block: BlockFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = make_spec()
    path, key = store_in(tmp_path, make_block(spec))
    attempts: list[Path] = []
    monkeypatch.setattr(os, "open", refusing(attempts, errno.EIO))
    direct = DirectReads()

    with pytest.raises(OSError) as caught:
        read(path, key, spec, page_aligned(whole_pages(path)), direct)

    assert caught.value.errno == errno.EIO
    assert attempts == [tmp_path] and direct.refused() == set()


def test_a_short_direct_read_is_redone_buffered(
    tmp_path: Path, make_spec: SpecFactory, make_block: BlockFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = make_spec()
    block = make_block(spec, num_tokens=30, seed=8)
    path, key = store_in(tmp_path, block)
    monkeypatch.setattr(os, "preadv", lambda fd, buffers, offset: 0)  # as if the file ended early
    direct = DirectReads()

    loaded = read(path, key, spec, page_aligned(whole_pages(path)), direct)

    assert direct.reads == 0 and direct.refused() == set()
    assert torch.equal(bits(loaded.kv), bits(block.kv))


def test_a_file_renamed_over_between_the_opens_is_read_from_the_checked_one(
    tmp_path: Path, make_spec: SpecFactory, make_block: BlockFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = make_spec()
    block = make_block(spec, num_tokens=16, seed=1)
    path, key = store_in(tmp_path, block)
    newer = tmp_path / "newer"
    newer.mkdir()
    other_path, _ = store_in(newer, KVBlock(block.token_ids, block.kv + 1))

    def swapped_open(target: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        return REAL_OPEN(other_path if flags & O_DIRECT else target, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", swapped_open)
    direct = DirectReads()

    loaded = read(path, key, spec, page_aligned(whole_pages(path)), direct)

    assert direct.reads == 0 and direct.refused() == set()
    assert torch.equal(bits(loaded.kv), bits(block.kv))


# ---- checks still apply ------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_damaged_payload_read_direct_fails_its_checksum(
    tmp_path: Path, make_spec: SpecFactory, make_block: BlockFactory, where: str
) -> None:
    spec = make_spec(dtype=torch.bfloat16)
    path, key = store_in(tmp_path, make_block(spec, num_tokens=37))
    header = read_header(path)
    offset = {"first": 0, "middle": header.payload_bytes // 2, "last": header.payload_bytes - 1}[where]
    data = bytearray(path.read_bytes())
    data[header.payload_offset + offset] ^= 0x40
    path.write_bytes(bytes(data))
    direct = DirectReads()

    with pytest.raises(CorruptBlockError, match="payload checksum mismatch"):
        read(path, key, spec, page_aligned(whole_pages(path)), direct)
    assert direct.reads == 1  # it was read with O_DIRECT, and still caught


def test_header_checks_come_before_any_direct_read(
    tmp_path: Path, make_spec: SpecFactory, make_block: BlockFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = make_spec()
    path, key = store_in(tmp_path, make_block(spec))
    attempts: list[Path] = []
    monkeypatch.setattr(os, "open", refusing(attempts))

    with pytest.raises(CorruptBlockError, match="fingerprint"):
        read_block(path, key, "e" * 64, spec, into=page_aligned(whole_pages(path)), direct=DirectReads())
    assert attempts == []
