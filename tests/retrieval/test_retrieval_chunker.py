"""The token-aware chunker: spans, token limits, overlap, coverage, preferred cuts and Markdown structure."""

from __future__ import annotations

import itertools
import types
from typing import cast

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import PreTrainedTokenizerBase

from service.retrieval.chunker import Chunk, Chunker, ChunkerConfig

WORDS = ["the", "quick", "Brown", "fox", "retrieval", "élève", "東京は", "🙂", "3.14", "e.g.", "Mr.", "x" * 60]
SEPARATORS = [" ", " ", " ", "  ", "\t", "\n", "\n\n", " \n \n ", ". ", "! ", "? ", ".\n", "。", "\r\n"]
MARKDOWN_PIECES = ["\n# Title\n", "\n## Part two\n\n", "\n```\n", "\n```python\n", "\n- item", "\n\n    indented"]
SLOW = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> tuple[int, ...]:
    return tuple(tokenizer.encode(text, add_special_tokens=False))


def assert_valid_chunks(
    tokenizer: PreTrainedTokenizerBase, text: str, chunks: list[Chunk], config: ChunkerConfig
) -> None:
    """The chunker's contract, checked against the original text and the tokenizer itself."""
    for i, chunk in enumerate(chunks):
        assert chunk.index == i
        assert chunk.text == text[chunk.char_start : chunk.char_end]
        assert chunk.text and chunk.text == chunk.text.strip()
        assert chunk.token_ids == encode(tokenizer, chunk.text)
        assert chunk.token_count <= config.chunk_size
    for before, after in itertools.pairwise(chunks):
        assert before.char_start < after.char_start and before.char_end < after.char_end
        if after.char_start < before.char_end:
            assert len(encode(tokenizer, text[after.char_start : before.char_end])) <= config.overlap
    covered = [0] * len(text)
    for chunk in chunks:
        for pos in range(chunk.char_start, chunk.char_end):
            covered[pos] += 1
    for pos, char in enumerate(text):
        if not char.isspace():
            assert 1 <= covered[pos] <= 2, f"character {pos} ({char!r}) is in {covered[pos]} chunks"


@st.composite
def documents(draw: st.DrawFn, markdown: bool = False) -> str:
    pieces = st.sampled_from(WORDS) | st.sampled_from(SEPARATORS)
    if markdown:
        pieces = pieces | st.sampled_from(MARKDOWN_PIECES)
    size = draw(st.integers(0, 200))  # drawn first: plain `st.lists` would mostly yield a chunk's worth or less
    return "".join(draw(st.lists(pieces, min_size=size, max_size=size)))


@st.composite
def configs(draw: st.DrawFn) -> ChunkerConfig:
    size = draw(st.integers(16, 80))
    return ChunkerConfig(chunk_size=size, overlap=draw(st.integers(0, size // 2)))


@pytest.fixture(scope="session", params=["bpe", "wordpiece"])
def tokenizer(request: pytest.FixtureRequest) -> PreTrainedTokenizerBase:
    name = {"bpe": "llm_tokenizer", "wordpiece": "wordpiece_tokenizer"}[request.param]
    return cast(PreTrainedTokenizerBase, request.getfixturevalue(name))


# ---- properties ----------------------------------------------------------------------------------------------


@SLOW
@given(text=documents(), config=configs())
def test_plain_text_chunks_keep_the_contract(
    tokenizer: PreTrainedTokenizerBase, text: str, config: ChunkerConfig
) -> None:
    chunks = Chunker(tokenizer, config).chunk("doc", text)
    assert_valid_chunks(tokenizer, text, chunks, config)
    assert (not chunks) == (not text.strip())


@SLOW
@given(text=documents(markdown=True), config=configs())
def test_markdown_chunks_keep_the_contract(
    tokenizer: PreTrainedTokenizerBase, text: str, config: ChunkerConfig
) -> None:
    assert_valid_chunks(tokenizer, text, Chunker(tokenizer, config).chunk("doc", text, markdown=True), config)


@settings(max_examples=40, deadline=None)
@given(text=st.text(max_size=300))
def test_any_unicode_text_keeps_the_contract(llm_tokenizer: PreTrainedTokenizerBase, text: str) -> None:
    config = ChunkerConfig(chunk_size=16, overlap=8)
    assert_valid_chunks(llm_tokenizer, text, Chunker(llm_tokenizer, config).chunk("doc", text), config)


@settings(max_examples=20, deadline=None)
@given(text=documents(markdown=True), config=configs())
def test_chunking_is_deterministic(llm_tokenizer: PreTrainedTokenizerBase, text: str, config: ChunkerConfig) -> None:
    first = Chunker(llm_tokenizer, config).chunk("doc", text, markdown=True)
    assert Chunker(llm_tokenizer, config).chunk("doc", text, markdown=True) == first


@st.composite
def short_paragraphs(draw: st.DrawFn) -> list[str]:
    sentence = st.lists(st.sampled_from(WORDS[:6]), min_size=1, max_size=6).map(lambda ws: " ".join(ws) + ".")
    paragraph = st.lists(sentence, min_size=1, max_size=3).map(" ".join)
    return draw(st.lists(paragraph, min_size=1, max_size=12))


@SLOW
@given(paragraphs=short_paragraphs(), overlap=st.integers(0, 32))
def test_paragraphs_shorter_than_a_chunk_are_never_split(
    llm_tokenizer: PreTrainedTokenizerBase, paragraphs: list[str], overlap: int
) -> None:
    config = ChunkerConfig(chunk_size=64, overlap=overlap)
    paragraphs = [p for p in paragraphs if len(encode(llm_tokenizer, p)) < config.chunk_size]
    text = "\n\n".join(paragraphs)
    chunks = Chunker(llm_tokenizer, config).chunk("doc", text)

    consumed = 0
    for n, chunk in enumerate(chunks):
        taken = next(
            k for k in range(1, len(paragraphs) + 1) if "\n\n".join(paragraphs[consumed : consumed + k]) == chunk.text
        )
        consumed += taken
        if n + 1 < len(chunks):  # greedy: the next paragraph would not have fitted
            longer = chunk.text + "\n\n" + paragraphs[consumed]
            assert len(encode(llm_tokenizer, longer)) > config.chunk_size
    assert consumed == len(paragraphs)


# ---- preferred cuts ------------------------------------------------------------------------------------------


def test_long_paragraph_is_cut_at_sentence_ends(llm_tokenizer: PreTrainedTokenizerBase) -> None:
    sentences = [f"Sentence number {n} talks about the quick brown fox." for n in range(12)]
    text = " ".join(sentences)
    chunks = Chunker(llm_tokenizer, ChunkerConfig(chunk_size=120, overlap=0)).chunk("doc", text)
    assert len(chunks) > 2
    for chunk in chunks:
        assert chunk.text.startswith("Sentence number") and chunk.text.endswith("fox.")
    assert " ".join(c.text for c in chunks) == text


def test_overlap_repeats_whole_trailing_sentences(llm_tokenizer: PreTrainedTokenizerBase) -> None:
    sentences = [f"Fact {n} is here." for n in range(30)]
    config = ChunkerConfig(chunk_size=64, overlap=24)
    chunks = Chunker(llm_tokenizer, config).chunk("doc", " ".join(sentences))
    assert len(chunks) > 2
    for before, after in itertools.pairwise(chunks):
        assert after.char_start < before.char_end  # every cut is inside the paragraph, so each one overlaps
        shared = before.text[after.char_start - before.char_start :]
        assert shared.startswith("Fact") and shared.endswith(".")
        assert after.text.startswith(shared)
        assert len(encode(llm_tokenizer, shared)) <= config.overlap


def test_cuts_at_paragraphs_are_not_overlapped(llm_tokenizer: PreTrainedTokenizerBase) -> None:
    text = "\n\n".join(f"Paragraph {n}. The quick brown fox." for n in range(10))
    chunks = Chunker(llm_tokenizer, ChunkerConfig(chunk_size=40, overlap=20)).chunk("doc", text)
    assert len(chunks) > 2
    assert all(b.char_end < a.char_start for b, a in itertools.pairwise(chunks))


def test_run_without_whitespace_is_cut_at_token_boundaries(llm_tokenizer: PreTrainedTokenizerBase) -> None:
    text = "start " + "abcdefghij" * 50 + " end"
    config = ChunkerConfig(chunk_size=32, overlap=8)
    chunks = Chunker(llm_tokenizer, config).chunk("doc", text)
    assert len(chunks) > 5
    assert_valid_chunks(llm_tokenizer, text, chunks, config)
    assert chunks[0].text == "start"  # a cut between words beats one inside the run
    assert all(set(c.text) <= set("abcdefghij") for c in chunks[1:-1])
    assert chunks[-1].text.endswith("j end")


# ---- Markdown --------------------------------------------------------------------------------------------------

STORAGE = "# Storage\n\nBlocks are written once. They are read many times."
KEYS = "## Keys\n\nA key hashes the model and the token ids. Nothing else goes in."
FILES = "## Files\n\nA file holds one block. The header comes first."


def test_markdown_cuts_before_headings(llm_tokenizer: PreTrainedTokenizerBase) -> None:
    text = "\n\n".join([STORAGE, KEYS, FILES])
    # Room for the first section and part of the second, but not for both whole.
    config = ChunkerConfig(chunk_size=len(encode(llm_tokenizer, STORAGE + "\n\n" + KEYS)) - 1, overlap=0)
    chunks = Chunker(llm_tokenizer, config).chunk("doc", text, markdown=True)
    assert chunks[0].text == STORAGE
    assert chunks[1].text.startswith("## Keys\n\nA key")
    plain = Chunker(llm_tokenizer, config).chunk("doc", text)
    # In plain text too a short line standing alone is a heading: it stays with the text under it.
    assert plain[0].text == STORAGE
    assert plain[1].text.startswith("## Keys\n\nA key")


def test_markdown_keeps_a_heading_with_its_text(llm_tokenizer: PreTrainedTokenizerBase) -> None:
    text = "## Keys\n\n" + " ".join(f"Rule {n} applies to keys." for n in range(8))
    chunks = Chunker(llm_tokenizer, ChunkerConfig(chunk_size=48, overlap=0)).chunk("doc", text, markdown=True)
    assert chunks[0].text.startswith("## Keys\n\nRule 0")


CODE = "```python\ndef read(path):\n\n    return open(path).read()\n\n\nprint(read('x'))\n```"


def test_markdown_keeps_a_fitting_code_block_whole(llm_tokenizer: PreTrainedTokenizerBase) -> None:
    text = "Intro sentence about reading files.\n\n" + CODE + "\n\nAfter the code."
    config = ChunkerConfig(chunk_size=len(encode(llm_tokenizer, CODE)) + 4, overlap=0)
    chunks = Chunker(llm_tokenizer, config).chunk("doc", text, markdown=True)
    assert CODE in [c.text for c in chunks]
    plain = Chunker(llm_tokenizer, config).chunk("doc", text)
    assert CODE not in [c.text for c in plain]  # without Markdown the blank lines inside are paragraph cuts


def test_markdown_splits_a_code_block_larger_than_a_chunk(llm_tokenizer: PreTrainedTokenizerBase) -> None:
    code = "```\n" + "\n".join(f"line_{n} = {n}" for n in range(60)) + "\n```"
    config = ChunkerConfig(chunk_size=48, overlap=8)
    chunks = Chunker(llm_tokenizer, config).chunk("doc", code, markdown=True)
    assert len(chunks) > 3
    assert_valid_chunks(llm_tokenizer, code, chunks, config)


# ---- inputs and configuration --------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["", "   ", "\n\n\t \r\n"])
def test_empty_or_blank_text_has_no_chunks(llm_tokenizer: PreTrainedTokenizerBase, text: str) -> None:
    assert Chunker(llm_tokenizer).chunk("doc", text) == []


def test_short_text_is_one_chunk_with_its_own_ids(llm_tokenizer: PreTrainedTokenizerBase) -> None:
    text = "\n  Paris is the capital of France.  \n"
    (chunk,) = Chunker(llm_tokenizer).chunk("paris", text)
    assert (chunk.doc_id, chunk.index, chunk.text) == ("paris", 0, "Paris is the capital of France.")
    assert (chunk.char_start, chunk.char_end) == (3, 34)
    assert chunk.token_ids == encode(llm_tokenizer, "Paris is the capital of France.")


def test_documents_over_the_size_limit_are_refused(llm_tokenizer: PreTrainedTokenizerBase) -> None:
    chunker = Chunker(llm_tokenizer, ChunkerConfig(max_document_chars=100))
    assert len(chunker.chunk("ok", "a " * 50)) == 1
    with pytest.raises(ValueError, match=r"document 'big' has 101 characters; the limit is 100"):
        chunker.chunk("big", "a" * 101)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"chunk_size": 8}, "chunk_size must be at least 16"),
        ({"chunk_size": 64, "overlap": 33}, "overlap must be between 0 and chunk_size // 2 = 32"),
        ({"overlap": -1}, "overlap must be between"),
        ({"max_document_chars": 0}, "max_document_chars must be positive"),
    ],
)
def test_invalid_configs_are_refused(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ChunkerConfig(**kwargs)


def test_defaults_are_384_tokens_with_48_overlap() -> None:
    assert (ChunkerConfig().chunk_size, ChunkerConfig().overlap) == (384, 48)


def test_a_tokenizer_without_offsets_is_refused() -> None:
    slow = cast(PreTrainedTokenizerBase, types.SimpleNamespace(is_fast=False))
    with pytest.raises(ValueError, match="fast"):
        Chunker(slow)
