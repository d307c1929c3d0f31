"""A token's own bytes, as OpenAI's logprobs report them: a token that holds part of a UTF-8 character decodes to
U+FFFD on its own, but its bytes are the part it holds (the client joins them to rebuild the character).

Byte-level BPE vocabularies (GPT-2, Qwen2, Llama 3) write every byte as one printable character; SentencePiece
vocabularies (Llama 2, Mistral) write a byte they fall back to as `<0xNN>` and a space as `▁`. A token in neither
form (a special token) is its decoded text.
"""

from __future__ import annotations

import re
from functools import cache
from typing import Any

SENTENCEPIECE_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
SENTENCEPIECE_SPACE = "\u2581"


@cache
def byte_of_character() -> dict[str, int]:
    """The byte-level alphabet's inverse: GPT-2's printable stand-in character of each byte, to the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    stand_ins = list(printable)
    shift = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            stand_ins.append(256 + shift)
            shift += 1
    return {chr(char): byte for byte, char in zip(printable, stand_ins, strict=True)}


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """The raw bytes token `token_id` stands for in `tokenizer`'s vocabulary."""
    text = str(tokenizer.decode([token_id]))
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if not isinstance(piece, str) or piece in tokenizer.all_special_tokens:
        return text.encode()
    sentencepiece = SENTENCEPIECE_BYTE.fullmatch(piece)
    if sentencepiece is not None:
        return bytes([int(sentencepiece.group(1), 16)])
    alphabet = byte_of_character()
    if piece and all(char in alphabet for char in piece):
        # A SentencePiece piece of Latin-1 letters reads as byte-level too: the bytes must decode to its text.
        raw = bytes(alphabet[char] for char in piece)
        if raw.decode("utf-8", errors="replace") == text:
            return raw
    if SENTENCEPIECE_SPACE in piece:
        return piece.replace(SENTENCEPIECE_SPACE, " ").encode()
    return text.encode()
