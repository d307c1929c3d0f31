"""Block files: bit-exact round trips, every kind of damage detected, atomic under concurrent writers."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import xxhash
from kv_support import BlockFactory, SpecFactory, bits, random_kv

from service.engine.engine import StitchEngine
from service.engine.kv_layout import KVBlock, block_shape, check_block
from service.engine.model import load_model
from service.engine.prompt import encode
from service.kvcache.fileformat import (
    ALIGNMENT,
    MAGIC,
    PREAMBLE,
    CorruptBlockError,
    MissingBlockError,
    block_relpath,
    read_block,
    read_header,
    write_block,
)
from service.kvcache.keys import block_key, model_fingerprint

FINGERPRINT = "f" * 64
REPO_ROOT = Path(__file__).resolve().parents[2]


def key_of(block: KVBlock) -> str:
    return block_key(FINGERPRINT, "tpl:1", block.kv.dtype, block.token_ids)


def stored(tmp_path: Path, block: KVBlock) -> tuple[Path, str]:
    key = key_of(block)
    path = tmp_path / block_relpath(key)
    write_block(path, key, FINGERPRINT, block)
    return path, key


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


# ---- round trips -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8])
def test_round_trip_is_bit_exact(
    tmp_path: Path, make_spec: SpecFactory, make_block: BlockFactory, dtype: torch.dtype
) -> None:
    spec = make_spec(dtype=dtype)
    block = make_block(spec, num_tokens=37, seed=3)
    path, key = stored(tmp_path, block)

    loaded = read_block(path, key, FINGERPRINT, spec)

    assert loaded.token_ids == block.token_ids
    assert loaded.kv.dtype == dtype
    assert tuple(loaded.kv.shape) == block_shape(spec, 37)
    assert torch.equal(bits(loaded.kv), bits(block.kv))


def test_file_layout_is_self_describing_and_payload_aligned(
    tmp_path: Path, make_spec: SpecFactory, make_block: BlockFactory
) -> None:
    spec = make_spec(dtype=torch.bfloat16)
    block = make_block(spec, num_tokens=50)
    key = key_of(block)
    path = tmp_path / block_relpath(key)

    written = write_block(path, key, FINGERPRINT, block)

    data = path.read_bytes()
    magic, version, header_len, _ = PREAMBLE.unpack_from(data)
    header = json.loads(data[PREAMBLE.size : PREAMBLE.size + header_len])
    assert (magic, version) == (MAGIC, 1)
    assert written == len(data) == header["payload_offset"] + header["payload_bytes"]
    assert header["payload_offset"] % ALIGNMENT == 0
    assert header["token_ids"] == list(block.token_ids)
    assert header["key"] == key and header["model_fingerprint"] == FINGERPRINT
    assert header["dtype"] == "bfloat16" and header["shape"] == list(block.kv.shape)
    assert header["checksum"]["algorithm"] == "xxh3_128"
    assert data[header["payload_offset"] :] == bits(block.kv).numpy().tobytes()
    assert list(path.parent.iterdir()) == [path]  # no temp file left behind


def test_large_token_list_pushes_payload_to_a_later_boundary(
    tmp_path: Path, make_spec: SpecFactory, make_block: BlockFactory
) -> None:
    spec = make_spec(num_layers=1, num_kv_heads=1, head_dim=1)
    block = make_block(spec, num_tokens=2000, seed=9)  # ~14 KB of token ids in the header
    path, key = stored(tmp_path, block)

    header = read_header(path, verify_payload=True)

    assert header.payload_offset >= 3 * ALIGNMENT and header.payload_offset % ALIGNMENT == 0
    assert torch.equal(bits(read_block(path, key, FINGERPRINT, spec).kv), bits(block.kv))


@pytest.mark.parametrize("typed", [False, True])
def test_read_into_preallocated_buffer_shares_its_memory(
    tmp_path: Path, make_spec: SpecFactory, make_block: BlockFactory, typed: bool
) -> None:
    spec = make_spec(dtype=torch.bfloat16)
    block = make_block(spec, num_tokens=16, seed=5)
    path, key = stored(tmp_path, block)
    typed_buffer = torch.zeros(block.kv.numel() + 100, dtype=torch.bfloat16)
    into = typed_buffer if typed else torch.zeros(1 << 20, dtype=torch.uint8)

    loaded = read_block(path, key, FINGERPRINT, spec, into=into)

    assert loaded.kv.data_ptr() == into.data_ptr()
    assert torch.equal(bits(loaded.kv), bits(block.kv))


def test_read_into_a_too_small_buffer_is_refused(
    tmp_path: Path, make_spec: SpecFactory, make_block: BlockFactory
) -> None:
    spec = make_spec()
    block = make_block(spec)
    path, key = stored(tmp_path, block)
    with pytest.raises(ValueError, match="needs"):
        read_block(path, key, FINGERPRINT, spec, into=torch.empty(10, dtype=torch.uint8))


def test_eight_bit_storage_reads_with_an_explicit_dtype(
    tmp_path: Path, make_spec: SpecFactory, make_block: BlockFactory
) -> None:
    spec = make_spec(dtype=torch.bfloat16)
    block = KVBlock(token_ids=(1, 2, 3), kv=random_kv(block_shape(spec, 3), torch.int8, seed=1))
    path, key = stored(tmp_path, block)

    loaded = read_block(path, key, FINGERPRINT, spec, dtype=torch.int8)

    assert torch.equal(loaded.kv, block.kv)
    with pytest.raises(CorruptBlockError, match="dtype mismatch"):
        read_block(path, key, FINGERPRINT, spec)


# ---- damage ------------------------------------------------------------------------------------------------


def test_missing_file_is_missing_not_corrupt(tmp_path: Path, make_spec: SpecFactory) -> None:
    with pytest.raises(MissingBlockError) as caught:
        read_block(tmp_path / "nope.kvblock", "0" * 32, FINGERPRINT, make_spec())
    assert isinstance(caught.value, FileNotFoundError)
    assert not isinstance(caught.value, CorruptBlockError)


@pytest.mark.parametrize(
    ("cut_to", "message"),
    [(-1, "truncated or overlong"), (10, "truncated"), (PREAMBLE.size + 5, "does not fit"), (0, "truncated")],
)
def test_truncated_file_is_corrupt(
    tmp_path: Path, make_spec: SpecFactory, make_block: BlockFactory, cut_to: int, message: str
) -> None:
    spec = make_spec()
    path, key = stored(tmp_path, make_block(spec))
    data = path.read_bytes()
    path.write_bytes(data[:cut_to])

    with pytest.raises(CorruptBlockError, match=message):
        read_block(path, key, FINGERPRINT, spec)
    with pytest.raises(CorruptBlockError):
        read_header(path)


def test_appended_bytes_are_corrupt(
    tmp_path: Path,
    make_spec: SpecFactory,
    make_block: BlockFactory,
) -> None:
    spec = make_spec()
    path, key = stored(tmp_path, make_block(spec))
    with path.open("ab") as f:
        f.write(b"\0")
    with pytest.raises(CorruptBlockError, match="overlong"):
        read_block(path, key, FINGERPRINT, spec)


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_flipped_payload_byte_fails_the_checksum(
    tmp_path: Path, make_spec: SpecFactory, make_block: BlockFactory, where: str
) -> None:
    spec = make_spec(dtype=torch.bfloat16)
    path, key = stored(tmp_path, make_block(spec))
    header = read_header(path)
    offset = {"first": 0, "middle": header.payload_bytes // 2, "last": header.payload_bytes - 1}[where]
    flip_byte(path, header.payload_offset + offset)

    read_header(path)  # the header alone is still fine
    with pytest.raises(CorruptBlockError, match="payload checksum mismatch"):
        read_block(path, key, FINGERPRINT, spec)
    with pytest.raises(CorruptBlockError, match="payload checksum mismatch"):
        read_header(path, verify_payload=True)


@pytest.mark.parametrize("offset_in_header", [0, 40, -2])
def test_flipped_header_byte_fails_the_header_checksum(
    tmp_path: Path, make_spec: SpecFactory, make_block: BlockFactory, offset_in_header: int
) -> None:
    spec = make_spec()
    path, key = stored(tmp_path, make_block(spec))
    _, _, header_len, _ = PREAMBLE.unpack_from(path.read_bytes())
    flip_byte(path, PREAMBLE.size + offset_in_header % header_len)

    with pytest.raises(CorruptBlockError, match="header checksum mismatch"):
        read_block(path, key, FINGERPRINT, spec)


@pytest.mark.parametrize(
    ("offset", "message"), [(0, "bad magic"), (8, "unsupported format version"), (16, "header checksum")]
)
def test_flipped_preamble_byte_is_corrupt(
    tmp_path: Path, make_spec: SpecFactory, make_block: BlockFactory, offset: int, message: str
) -> None:
    spec = make_spec()
    path, key = stored(tmp_path, make_block(spec))
    flip_byte(path, offset)
    with pytest.raises(CorruptBlockError, match=message):
        read_block(path, key, FINGERPRINT, spec)


def test_flipped_padding_byte_is_corrupt(
    tmp_path: Path,
    make_spec: SpecFactory,
    make_block: BlockFactory,
) -> None:
    spec = make_spec()
    path, key = stored(tmp_path, make_block(spec))
    flip_byte(path, read_header(path).payload_offset - 1)
    with pytest.raises(CorruptBlockError, match="padding"):
        read_block(path, key, FINGERPRINT, spec)


def test_wrong_model_fingerprint_is_corrupt(
    tmp_path: Path,
    make_spec: SpecFactory,
    make_block: BlockFactory,
) -> None:
    spec = make_spec()
    path, key = stored(tmp_path, make_block(spec))
    with pytest.raises(CorruptBlockError, match="model fingerprint mismatch"):
        read_block(path, key, "e" * 64, spec)


def test_other_token_ids_under_the_same_key_are_a_collision(
    tmp_path: Path,
    make_spec: SpecFactory,
    make_block: BlockFactory,
) -> None:
    spec = make_spec()
    block = make_block(spec)
    path, key = stored(tmp_path, block)
    assert read_block(path, key, FINGERPRINT, spec, expected_token_ids=list(block.token_ids)).num_tokens == 24
    with pytest.raises(CorruptBlockError, match="key collision"):
        read_block(path, key, FINGERPRINT, spec, expected_token_ids=[*block.token_ids[:-1], 0])


def test_wrong_key_is_corrupt(
    tmp_path: Path,
    make_spec: SpecFactory,
    make_block: BlockFactory,
) -> None:
    spec = make_spec()
    path, _ = stored(tmp_path, make_block(spec))
    with pytest.raises(CorruptBlockError, match="key mismatch"):
        read_block(path, "0" * 32, FINGERPRINT, spec)


@pytest.mark.parametrize(
    "changes",
    [{"num_kv_heads": 4}, {"num_layers": 3}, {"head_dim": 8}],
    ids=["kv_heads", "layers", "head_dim"],
)
def test_wrong_shape_for_the_model_is_corrupt(
    tmp_path: Path, make_spec: SpecFactory, make_block: BlockFactory, changes: dict[str, int]
) -> None:
    path, key = stored(tmp_path, make_block(make_spec()))
    with pytest.raises(CorruptBlockError, match="shape mismatch"):
        read_block(path, key, FINGERPRINT, make_spec(**changes))


def test_wrong_dtype_for_the_model_is_corrupt(
    tmp_path: Path,
    make_spec: SpecFactory,
    make_block: BlockFactory,
) -> None:
    path, key = stored(tmp_path, make_block(make_spec(dtype=torch.float16)))
    with pytest.raises(CorruptBlockError, match="dtype mismatch: file holds float16, expected bfloat16"):
        read_block(path, key, FINGERPRINT, make_spec(dtype=torch.bfloat16))


def test_more_tokens_than_the_model_context_is_corrupt(
    tmp_path: Path, make_spec: SpecFactory, make_block: BlockFactory
) -> None:
    path, key = stored(tmp_path, make_block(make_spec(), num_tokens=40))
    with pytest.raises(CorruptBlockError, match="exceeds the model's context 32"):
        read_block(path, key, FINGERPRINT, make_spec(max_positions=32))


def rewrite_header(path: Path, **changes: object) -> None:
    """Replace header fields and re-seal the header hash: a consistent-looking but lying header."""
    data = path.read_bytes()
    magic, version, header_len, _ = PREAMBLE.unpack_from(data)
    fields = json.loads(data[PREAMBLE.size : PREAMBLE.size + header_len])
    fields.update(changes)
    body = json.dumps(fields).encode()
    offset = fields["payload_offset"]
    assert PREAMBLE.size + len(body) <= offset
    sealed = PREAMBLE.pack(magic, version, len(body), xxhash.xxh3_64_intdigest(body)) + body
    path.write_bytes(sealed + bytes(offset - len(sealed)) + data[offset:])


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"token_ids": [1, 2]}, "token ids stored"),
        ({"shape": [2, 2, 2, 25, 16]}, "does not hold 24 tokens"),
        ({"payload_bytes": 8}, "does not match shape"),
        ({"dtype": "complex64"}, "unknown dtype"),
        ({"layout": {"name": "other", "version": 1}}, "layout 'other'"),
        ({"num_tokens": -1}, "unreadable header"),
        ({"created": "yesterday"}, "unreadable header"),
        ({"format": "pickle"}, "not a kvstitch-kv-block"),
    ],
)
def test_self_inconsistent_header_is_corrupt(
    tmp_path: Path, make_spec: SpecFactory, make_block: BlockFactory, changes: dict[str, object], message: str
) -> None:
    spec = make_spec()
    path, key = stored(tmp_path, make_block(spec, num_tokens=24))
    rewrite_header(path, **changes)
    with pytest.raises(CorruptBlockError, match=message):
        read_block(path, key, FINGERPRINT, spec)


def test_absurd_header_length_is_rejected_without_reading_it(
    tmp_path: Path, make_spec: SpecFactory, make_block: BlockFactory
) -> None:
    spec = make_spec()
    path, key = stored(tmp_path, make_block(spec))
    data = bytearray(path.read_bytes())
    struct.pack_into("<I", data, 12, 0xFFFF_FFF0)
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptBlockError, match="header length"):
        read_block(path, key, FINGERPRINT, spec)


# ---- concurrency -------------------------------------------------------------------------------------------

# Each writer process rewrites the same key with its own values, so a reader that ever saw a mix of two writes
# (or a partial one) would find values equal to neither.
WRITER = textwrap.dedent(
    """
    import sys
    import torch
    from pathlib import Path
    from kv_support import random_kv
    from service.engine.kv_layout import KVBlock
    from service.kvcache.fileformat import write_block

    path, key, fingerprint, seed, count = sys.argv[1:6]
    shape = tuple(int(x) for x in sys.argv[6].split(","))
    ids = tuple(range(shape[3]))
    block = KVBlock(ids, random_kv(shape, torch.bfloat16, int(seed)))
    for _ in range(int(count)):
        write_block(Path(path), key, fingerprint, block)
    """
)


@pytest.mark.slow
def test_concurrent_writers_never_expose_a_partial_file(tmp_path: Path, make_spec: SpecFactory) -> None:
    spec = make_spec(dtype=torch.bfloat16, num_layers=4, num_kv_heads=4, head_dim=64)
    shape = block_shape(spec, 256)  # 1 MiB payload: long enough writes to overlap reads
    seeds = (11, 22)
    expected = [bits(random_kv(shape, torch.bfloat16, s)) for s in seeds]
    key = block_key(FINGERPRINT, "tpl:1", spec.dtype, range(256))
    path = tmp_path / block_relpath(key)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), str(REPO_ROOT)])}
    argv = [str(path), key, FINGERPRINT]
    shape_arg = ",".join(map(str, shape))
    commands = [[sys.executable, "-c", WRITER, *argv, str(s), "60", shape_arg] for s in seeds]
    writers = [subprocess.Popen(command, env=env) for command in commands]

    reads, seen = 0, set()
    deadline = time.monotonic() + 120
    while any(w.poll() is None for w in writers) and time.monotonic() < deadline:
        try:
            loaded = read_block(path, key, FINGERPRINT, spec)
        except MissingBlockError:
            time.sleep(0.01)  # neither writer has renamed its first file into place yet
            continue
        got = bits(loaded.kv)
        matches = [i for i, e in enumerate(expected) if torch.equal(got, e)]
        assert len(matches) == 1, "reader saw a block equal to neither writer's"
        seen.add(matches[0])
        reads += 1

    assert [w.wait(timeout=60) for w in writers] == [0, 0]
    assert reads > 0
    final = bits(read_block(path, key, FINGERPRINT, spec).kv)
    assert any(torch.equal(final, e) for e in expected)
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temp file survives


# ---- with the real engine ----------------------------------------------------------------------------------


def test_engine_blocks_round_trip_under_their_real_key(tmp_path: Path, tiny_model_dir: Path) -> None:
    engine = StitchEngine(load_model(tiny_model_dir))
    fingerprint = model_fingerprint(engine.model)
    chunk = engine.template.chunk_block(encode(engine.tokenizer, "Paris is the capital of France."))
    (block,) = engine.precompute([chunk])
    key = block_key(fingerprint, engine.template.version, engine.spec.dtype, block.token_ids)
    path = tmp_path / block_relpath(key)

    write_block(path, key, fingerprint, block)
    loaded = read_block(path, key, fingerprint, engine.spec)

    check_block(engine.spec, loaded)
    assert loaded.token_ids == tuple(chunk)
    assert torch.equal(bits(loaded.kv), bits(block.kv))
