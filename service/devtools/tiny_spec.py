"""The shape of a tiny model as the KV cache sees it, for tests that need blocks but no model (KV cache and fleet
tests); imports only torch and the KV layout, so test subprocesses that write blocks stay light."""

from __future__ import annotations

import torch

from service.engine.kv_layout import ModelSpec

TINY_SPEC = ModelSpec(
    model_type="llama",
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    hidden_size=64,
    vocab_size=384,
    rope_type="default",
    max_positions=4096,
    sliding_window=None,
    dtype=torch.float32,
    device=torch.device("cpu"),
)
