"""Model adapter: load an HF RoPE decoder (Llama, Qwen2, Mistral) and describe its shape.

Everything else in the engine talks to `LoadedModel`, never to `from_pretrained` directly, so the set of
supported families is decided here and nowhere else.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from service.engine.kv_layout import ModelSpec

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
# RoPE variants whose rotation depends only on the position itself, so a key rotated at stitch time equals the
# key the model would have rotated in a full forward. `dynamic` and `longrope` change frequencies with the
# sequence length and would make one stored copy wrong at other lengths.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class UnsupportedModelError(ValueError):
    """The model folder holds an architecture or setting kvstitch cannot stitch exactly."""


WEIGHTLESS = torch.device("meta")  # where a model without weights keeps its (shape-only) parameters


@dataclass
class LoadedModel:
    """An HF causal LM in eval mode, its tokenizer and its spec. `fingerprint`: the identity of a model that has
    no weight files to be told apart by (a benchmark's random model names its own), else None: computed from its
    files or weights (`service.kvcache.keys.model_fingerprint`)."""

    hf: Any
    tokenizer: PreTrainedTokenizerBase
    spec: ModelSpec
    source: str
    fingerprint: str | None = None

    @property
    def has_weights(self) -> bool:
        """False for a shell (`load_model_shell`): it tokenizes and keys, but computes nothing."""
        return self.spec.device != WEIGHTLESS

    @property
    def decoder(self) -> Any:
        """The inner decoder stack (`model.model` for all supported families)."""
        return self.hf.model


def default_dtype(device: torch.device) -> torch.dtype:
    """fp32 on CPU (exact gate), bf16 on CUDA (the serving dtype)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def check_supported(config: Any) -> None:
    """Raise `UnsupportedModelError` naming what is unsupported; return quietly otherwise."""
    model_type = getattr(config, "model_type", "<missing>")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; kvstitch stitches {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    rope_type = rope_type_of(config)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope type {rope_type!r} of {model_type} is not supported (its frequencies depend on the sequence "
            f"length, so a stored key cannot be re-positioned); supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )


def rope_type_of(config: Any) -> str:
    """The RoPE variant named by the config (`default` when none is set)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return str(params.get("rope_type", params.get("type", "default")))


def sliding_window_of(config: Any) -> int | None:
    """The attention window if any layer uses one, else None."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    return int(window) if window else None


def spec_from_config(config: Any, dtype: torch.dtype, device: torch.device) -> ModelSpec:
    """Build the spec of a supported config."""
    heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return ModelSpec(
        model_type=str(config.model_type),
        num_layers=int(config.num_hidden_layers),
        num_heads=heads,
        num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
        head_dim=int(head_dim),
        hidden_size=int(config.hidden_size),
        vocab_size=int(config.vocab_size),
        rope_type=rope_type_of(config),
        max_positions=int(config.max_position_embeddings),
        sliding_window=sliding_window_of(config),
        dtype=dtype,
        device=device,
    )


def load_model(
    source: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    local_files_only: bool = False,
) -> LoadedModel:
    """Load an HF model folder or hub id through `from_pretrained`, refusing unsupported families first."""
    hf_logging.disable_progress_bar()  # server logs and CLI output stay readable
    device = torch.device(device)
    dtype = dtype or default_dtype(device)
    config = AutoConfig.from_pretrained(str(source), local_files_only=local_files_only)
    check_supported(config)
    tokenizer = AutoTokenizer.from_pretrained(str(source), local_files_only=local_files_only)
    hf = AutoModelForCausalLM.from_pretrained(
        str(source), dtype=dtype, attn_implementation="sdpa", local_files_only=local_files_only
    )
    hf.to(device=device).eval()
    hf.requires_grad_(False)
    return LoadedModel(hf=hf, tokenizer=tokenizer, spec=spec_from_config(config, dtype, device), source=str(source))


def load_model_shell(source: str | Path, dtype: torch.dtype, local_files_only: bool = False) -> LoadedModel:
    """A model folder's config, tokenizer and generation config with its parameters on the meta device: what a
    gateway needs to tokenize, key chunks and check its engines' key space, without the weights' memory (host or
    GPU) or a GPU. `dtype` must be the engines' (it is part of the KV keys). The fingerprint comes from the
    folder's weight files, as a loaded model's does (`shell_fingerprintable`)."""
    hf_logging.disable_progress_bar()
    config = AutoConfig.from_pretrained(str(source), local_files_only=local_files_only)
    check_supported(config)
    tokenizer = AutoTokenizer.from_pretrained(str(source), local_files_only=local_files_only)
    hf = shell_from_config(config, dtype)
    # Without generation_config.json, from_pretrained too keeps the one built from the config.
    with contextlib.suppress(OSError):
        hf.generation_config = GenerationConfig.from_pretrained(str(source), local_files_only=local_files_only)
    return LoadedModel(hf, tokenizer, spec_from_config(config, dtype, WEIGHTLESS), str(source))


def shell_from_config(config: Any, dtype: torch.dtype) -> Any:
    """The HF model of `config` with every parameter and buffer on the meta device (nothing allocated)."""
    with WEIGHTLESS:
        hf = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    hf.eval().requires_grad_(False)
    return hf
