"""The model adapter loads the supported families through from_pretrained and refuses the rest by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, LlamaConfig

from service.devtools.tiny_model import build_tokenizer
from service.engine.kv_buffer import KVBuffer
from service.engine.model import UnsupportedModelError, load_model


def test_specs_of_supported_families(tiny_model_dirs: dict[str, Path]) -> None:
    llama = load_model(tiny_model_dirs["llama"])
    assert (llama.spec.model_type, llama.spec.rope_type) == ("llama", "llama3")
    assert (llama.spec.num_layers, llama.spec.num_kv_heads, llama.spec.head_dim) == (2, 2, 16)
    assert llama.spec.dtype == torch.float32
    qwen = load_model(tiny_model_dirs["qwen2"])
    assert qwen.hf.model.layers[0].self_attn.q_proj.bias is not None  # Qwen2's QKV bias is kept
    assert qwen.spec.sliding_window is None


def _save_config(config: object, folder: Path) -> Path:
    folder.mkdir()
    config.save_pretrained(folder)  # type: ignore[attr-defined]
    build_tokenizer().save_pretrained(folder)
    return folder


def test_unsupported_architecture_is_refused_by_name(tmp_path: Path) -> None:
    folder = _save_config(GPT2Config(n_layer=1, n_embd=32, n_head=2), tmp_path / "gpt2")
    with pytest.raises(UnsupportedModelError, match="'gpt2' is not supported"):
        load_model(folder)


def test_length_dependent_rope_is_refused(tmp_path: Path) -> None:
    config = LlamaConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        rope_scaling={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    )
    folder = _save_config(config, tmp_path / "dynamic")
    with pytest.raises(UnsupportedModelError, match="'dynamic'"):
        load_model(folder)


def test_sliding_window_bounds_the_context(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, MistralConfig

    tokenizer = build_tokenizer()
    config = MistralConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        sliding_window=48,
    )
    folder = tmp_path / "windowed"
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    model = load_model(folder)
    assert model.spec.max_context == 48
    KVBuffer(model.spec, 48)
    with pytest.raises(ValueError, match="exceeds the model's context of 48"):
        KVBuffer(model.spec, 49)
