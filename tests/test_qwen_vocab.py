"""loadtest/qwen_vocab.py: a fast tokenizer from a tiktoken vocabulary file (as Qwen's ships in dashscope)."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from loadtest.qwen_vocab import QWEN_SPECIALS, installed_qwen_vocab, qwen_tokenizer, tiktoken_tokenizer
from service.engine.prompt import build_template, encode

MERGED = (b"he", b"ll", b"hell", b"hello", b" w", b" wor", b"or")


def write_vocab(path: Path) -> Path:
    """Every single byte (ranks 0-255), then a few merges in rank order."""
    tokens = [bytes([b]) for b in range(256)] + list(MERGED)
    path.write_text("".join(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens)))
    return path


def test_merges_follow_the_ranks_and_any_text_round_trips(tmp_path: Path) -> None:
    tokenizer = tiktoken_tokenizer(write_vocab(tmp_path / "tiny.tiktoken"))

    assert tokenizer.encode("hello", add_special_tokens=False) == [256 + MERGED.index(b"hello")]
    assert tokenizer.encode(" wor", add_special_tokens=False) == [256 + MERGED.index(b" wor")]
    text = "hello world, 12 élèves 東京 🙂"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_the_specials_follow_the_regular_ids_and_the_chat_template_splits_into_id_pieces(tmp_path: Path) -> None:
    tokenizer = tiktoken_tokenizer(write_vocab(tmp_path / "tiny.tiktoken"))
    first_special = 256 + len(MERGED)

    assert [tokenizer.convert_tokens_to_ids(s) for s in QWEN_SPECIALS] == [first_special + i for i in range(3)]
    assert tokenizer.eos_token_id == first_special and len(tokenizer) == first_special + 3
    template = build_template(tokenizer)
    assert first_special + 1 in template.prefix  # <|im_start|> opens the system turn
    suffix = template.question_suffix(encode(tokenizer, "hello"))
    assert 256 + MERGED.index(b"hello") in suffix and suffix[-1] != first_special


def test_a_missing_vocabulary_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("loadtest.qwen_vocab.installed_qwen_vocab", lambda: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps dashscope tiktoken"):
        qwen_tokenizer()
    with pytest.raises(ValueError, match="end-of-text"):
        tiktoken_tokenizer(Path("unused"), specials=())


def test_the_installed_vocabulary_is_found_only_as_a_file_of_the_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "dashscope"
    (package / "resources").mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('the SDK is never imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert installed_qwen_vocab() is None
    write_vocab(package / "resources" / "qwen.tiktoken")
    assert installed_qwen_vocab() == package / "resources" / "qwen.tiktoken"
