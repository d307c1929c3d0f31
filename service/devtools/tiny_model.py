"""Tiny random-weight models of the supported families, saved as ordinary HF folders.

No weights can be downloaded where kvstitch is developed and tested, so tests, the load test and the
README's offline demo build these and load them back through the production `from_pretrained` path.
The tokenizer is a byte-level BPE trained on a built-in corpus, so any Unicode text round-trips and multi-byte
characters are split across tokens (which is what the incremental detokenizer must survive).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

ARCHITECTURES = ("llama", "qwen2", "mistral")
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|bos|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
_CORPUS = """
Retrieval-augmented generation answers a question from documents found for it. The documents are split into
chunks, each chunk is embedded, and the chunks nearest to the question are placed before it in the prompt.
Prefilling thousands of context tokens dominates the time to the first token. Precomputing every chunk's keys
and values once, and stitching them at question time, removes that work from the request path.
The quick brown fox jumps over the lazy dog. Paris is the capital of France; Berlin is the capital of Germany.
Question: When did the concert premiere? Answer: It premiered on January 2, 2022, at 9:00pm on CNN.
Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 and symbols ( ) [ ] { } < > | / \\ - _ = + * & ^ % $ # @ ! ? , . ; :
Les élèves étudient à l'école. Der Bär isst Käse. 東京は日本の首都です。 Ελληνικά κείμενα. 🙂 🚀
"""


def build_tokenizer(vocab_size: int = 384) -> PreTrainedTokenizerFast:
    """A deterministic byte-level BPE tokenizer with chat special tokens."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator([line for line in _CORPUS.splitlines() if line] * 4, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|bos|>", eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )


# Llama-3.1's scaled RoPE, at a tiny model's scale (original context 64, so positions past it are rescaled).
LLAMA3_SCALING: dict[str, Any] = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def _config(arch: str, tokenizer: PreTrainedTokenizerFast, init_std: float) -> PretrainedConfig:
    common: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "initializer_range": init_std,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "tie_word_embeddings": False,
    }
    if arch == "llama":
        return LlamaConfig(**common, rope_scaling=dict(LLAMA3_SCALING))
    if arch == "qwen2":
        return Qwen2Config(**common, use_sliding_window=False)
    if arch == "mistral":
        return MistralConfig(**common, sliding_window=None)
    raise ValueError(f"unknown tiny architecture {arch!r}; choose from {', '.join(ARCHITECTURES)}")


def build_tiny_model(arch: str, out_dir: str | Path, seed: int = 0, init_std: float = 0.1) -> Path:
    """Write a random-weight model + tokenizer of `arch` to out_dir and return the folder."""
    out = Path(out_dir)
    tokenizer = build_tokenizer()
    if arch == "qwen2":
        tokenizer.chat_template = CHATML_TEMPLATE
    elif arch == "llama":
        tokenizer.chat_template = LLAMA3_TEMPLATE
    config = _config(arch, tokenizer, init_std)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
