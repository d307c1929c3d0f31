"""A tiny random-weight cross-encoder (BERT, one relevance label, a small WordPiece vocabulary) saved as a model
folder that sentence-transformers' `CrossEncoder` loads: tests and the recall script check the reranking pipeline
with it. Its scores are random: it says nothing about ranking quality."""

from __future__ import annotations

import string
from pathlib import Path

import torch
from transformers import BertConfig, BertForSequenceClassification, BertTokenizer

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def _vocabulary() -> list[str]:
    letters = list(string.ascii_lowercase + string.digits + string.punctuation)
    pieces = [f"##{c}" for c in string.ascii_lowercase + string.digits]
    return SPECIAL + letters + pieces


def build_tiny_cross_encoder(out_dir: str | Path, seed: int = 0) -> Path:
    """Save the model and its tokenizer in `out_dir` (created) and return it."""
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = BertTokenizer(vocab={piece: i for i, piece in enumerate(_vocabulary())}, do_lower_case=True)
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=512,
        num_labels=1,
        initializer_range=0.3,  # wide random weights: scores that differ clearly between texts
    )
    torch.manual_seed(seed)
    BertForSequenceClassification(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
