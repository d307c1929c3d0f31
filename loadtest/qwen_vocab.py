"""Qwen's own BPE vocabulary for the load tests' random Qwen2-7B-shaped model, where it is installed.

The tiny stand-in BPE (384 ids, `service.devtools.tiny_model.build_tokenizer`) splits English ~2.5x finer than a
real 150K-id vocabulary: the prompt's tail (the documents' outro, the question and the assistant header) is 143
ids there against ~50 in Qwen's, so a benchmark through the gateway would prefill ~3x the question tokens a
Qwen2-7B deployment does. No model can be downloaded here, but Alibaba's `dashscope` SDK (PyPI) ships Qwen's
vocabulary as a tiktoken file (`dashscope/resources/qwen.tiktoken`, 151,643 byte-level BPE ids, the regular
vocabulary Qwen2 shares). `pip install --no-deps dashscope tiktoken` is enough: the file is located without
importing the SDK, and transformers' `TikTokenConverter` (which reads it through tiktoken) builds the fast
tokenizer. Qwen2's three chat specials follow at 151,643-151,645, as in Qwen2's own tokenizer.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path

from tokenizers import AddedToken
from transformers import PreTrainedTokenizerFast

from service.devtools.tiny_model import CHATML_TEMPLATE

# Qwen's pre-tokenizer split (its digits one by one, unlike cl100k's runs of up to three).
QWEN_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
DASHSCOPE_VOCAB = ("resources", "qwen.tiktoken")


def installed_qwen_vocab() -> Path | None:
    """The tiktoken file of an installed `dashscope` package, found without importing it; None when absent."""
    spec = importlib.util.find_spec("dashscope")
    for root in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(root).joinpath(*DASHSCOPE_VOCAB)
        if candidate.is_file():
            return candidate
    return None


def tiktoken_tokenizer(vocab_file: Path, specials: Sequence[str] = QWEN_SPECIALS) -> PreTrainedTokenizerFast:
    """A fast byte-level BPE tokenizer from a tiktoken file (one `base64(token) rank` per line), the specials
    appended after the regular ids, the ChatML template set, EOS and padding `<|endoftext|>`-style (specials[0])."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    if not specials:
        raise ValueError("a tokenizer needs at least its end-of-text special")
    # The converter's keyword for specials changed name across transformers releases; add them here instead.
    backend = TikTokenConverter(str(vocab_file), pattern=QWEN_PATTERN).converted()
    backend.add_special_tokens([AddedToken(s, normalized=False, special=True) for s in specials])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=specials[0], pad_token=specials[0])
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def qwen_tokenizer() -> PreTrainedTokenizerFast:
    """Qwen's vocabulary as a fast tokenizer; a clear error when the vocabulary is not installed."""
    vocab = installed_qwen_vocab()
    if vocab is None:
        raise FileNotFoundError(
            "Qwen's vocabulary was not found: `pip install --no-deps dashscope tiktoken` installs it "
            "(or choose --tokenizer stand-in)"
        )
    return tiktoken_tokenizer(vocab)
