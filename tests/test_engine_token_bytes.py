"""A token's own bytes (what /v1 logprobs report): the tiny models' byte-level vocabulary and a SentencePiece-style one
with byte fallback, both real `tokenizers` tokenizers; joined over an encoding, the bytes are the text's UTF-8."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

from service.engine.token_bytes import token_bytes

TEXT = "the café ☃ hölds 日本 hands"


def sentencepiece_tokenizer() -> PreTrainedTokenizerFast:
    """Llama 2's form: `▁` for a space, `<0xNN>` for a byte no piece covers, Latin-1 letters as pieces."""
    backend = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    byte_pieces = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>", *byte_pieces])
    backend.train_from_iterator(["the café is open", "the otters hold hands", "é ö"] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture
def byte_level(tiny_model_dirs: dict[str, Path]) -> PreTrainedTokenizerFast:
    tokenizer: PreTrainedTokenizerFast = AutoTokenizer.from_pretrained(tiny_model_dirs["qwen2"])
    return tokenizer


def test_every_byte_level_token_is_its_vocabulary_bytes(byte_level: PreTrainedTokenizerFast) -> None:
    byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
    special = set(byte_level.all_special_ids)

    for token_id in range(len(byte_level)):
        piece = byte_level.convert_ids_to_tokens(token_id)
        expected = piece.encode() if token_id in special else bytes(byte_of[c] for c in piece)
        assert token_bytes(byte_level, token_id) == expected, (token_id, piece)


def test_a_token_that_holds_part_of_a_character_is_that_part(byte_level: PreTrainedTokenizerFast) -> None:
    ids = byte_level.encode("☃", add_special_tokens=False)
    parts = [token_bytes(byte_level, i) for i in ids]

    assert len(ids) > 1 and all(byte_level.decode([i]) == "\ufffd" for i in ids)  # each alone reads as U+FFFD
    assert b"".join(parts) == "☃".encode()


def test_a_sentencepiece_token_is_its_bytes() -> None:
    tokenizer = sentencepiece_tokenizer()
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    pieces = tokenizer.convert_ids_to_tokens(ids)

    assert "<0xE2>" in pieces and any("é" in p for p in pieces) and "▁" in "".join(pieces)  # every form is met
    assert b"".join(token_bytes(tokenizer, i) for i in ids) == f" {TEXT}".encode()
    assert token_bytes(tokenizer, tokenizer.convert_tokens_to_ids("é")) == "é".encode()
    assert token_bytes(tokenizer, tokenizer.eos_token_id) == b"</s>"


def test_joined_byte_level_tokens_are_the_texts_utf8(byte_level: PreTrainedTokenizerFast) -> None:
    ids = byte_level.encode(TEXT, add_special_tokens=False)

    assert b"".join(token_bytes(byte_level, i) for i in ids) == TEXT.encode()
