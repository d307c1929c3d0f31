"""Token ids packed into one string: "u32le:" + base64 of little-endian uint32, for where ids travel as JSON.

A list of ~500 ints per chunk is the costliest part of decoding a JSON body or a Qdrant payload that carries chunks
(a Python int object and a validation per id); one string decodes in C. Qdrant payloads (`retrieval.collection`) and
the engine's internal API (`facade.engine`) both carry ids this way. A plain module of the standard library only, so
both sides of the engine's API can import it.
"""

from __future__ import annotations

import array
import base64
import binascii
import sys
from collections.abc import Sequence
from typing import Any

PACKED_PREFIX = "u32le:"


def pack_token_ids(ids: Sequence[int]) -> str:
    """`ids` (each 0 .. 2**32 - 1) as one packed string; OverflowError for an id out of that range."""
    packed = array.array("I", ids)
    if sys.byteorder != "little":
        packed.byteswap()
    return PACKED_PREFIX + base64.b64encode(packed.tobytes()).decode("ascii")


def unpack_token_ids(value: Any) -> tuple[int, ...]:
    """Token ids from a packed string, or from the plain list of ints older writers sent; ValueError for a string
    that is not packed ids (not the prefix, not base64, not whole uint32 values)."""
    if not isinstance(value, str):
        return tuple(int(t) for t in value)
    if not value.startswith(PACKED_PREFIX):
        raise ValueError("token ids are neither a list nor packed ids")
    try:  # binascii's strict mode: base64.b64decode's validation is a regex, ~4x slower on 2 KB
        raw = binascii.a2b_base64(value[len(PACKED_PREFIX) :], strict_mode=True)
    except binascii.Error as err:
        raise ValueError(f"packed token ids are not valid base64: {err}") from err
    if len(raw) % 4:
        raise ValueError("packed token ids are not whole uint32 values")
    packed = array.array("I", raw)
    if sys.byteorder != "little":
        packed.byteswap()
    return tuple(packed)
