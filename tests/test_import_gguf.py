"""`kvstitch import-gguf`: a tiny llama written as a GGUF file here (the `gguf` package's writer, llama.cpp's
tensor names and q/k permutation, a byte-level BPE vocabulary) comes back as an HF folder with the same weights,
the same tokenizer and its chat template, which loads and passes the gate; bad input is one clear line."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

from service.cli import main
from service.commands.import_gguf import GGUFImportError, import_gguf
from service.devtools.tiny_model import CHATML_TEMPLATE, build_tokenizer
from service.engine.engine import StitchEngine
from service.engine.gate import run_gate
from service.engine.model import load_model
from service.engine.prompt import build_template

TEXT = "Paris is the capital of France; the quick brown fox (1873) jumps. Les élèves étudient 🙂"
CONTROL, NORMAL = 3, 1  # llama.cpp's token types
# llama.cpp's tensor names for a llama block, keyed by the HF parameter name inside `model.layers.N.`
BLOCK_TENSORS = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}


def _permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf q/k permutation (rotary halves interleaved), which transformers undoes."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def _tiny_llama(tokenizer: PreTrainedTokenizerFast) -> Any:
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        initializer_range=0.1,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(3)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _tensors(model: Any) -> dict[str, torch.Tensor]:
    config, state = model.config, model.state_dict()
    tensors = {
        "token_embd.weight": state["model.embed_tokens.weight"],
        "output_norm.weight": state["model.norm.weight"],
        "output.weight": state["lm_head.weight"],
    }
    for layer in range(config.num_hidden_layers):
        for hf_name, gguf_name in BLOCK_TENSORS.items():
            weight = state[f"model.layers.{layer}.{hf_name}"]
            if gguf_name == "attn_q.weight":
                weight = _permute(weight, config.num_attention_heads)
            elif gguf_name == "attn_k.weight":
                weight = _permute(weight, config.num_key_value_heads)
            tensors[f"blk.{layer}.{gguf_name}"] = weight
    return tensors


def write_tiny_gguf(path: Path, architecture: str = "llama") -> tuple[Any, PreTrainedTokenizerFast]:
    """A random-weight llama and its tokenizer written as a GGUF file (fp32 tensors); both returned."""
    gguf = pytest.importorskip("gguf", reason="the optional gguf package (kvstitch[gguf]) is not installed")
    tokenizer = build_tokenizer()
    model = _tiny_llama(tokenizer)
    config = model.config
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name("tiny-llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(config.vocab_size)
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    special = set(tokenizer.all_special_tokens) | set(tokenizer.added_tokens_encoder)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types([CONTROL if token in special else NORMAL for token, _ in vocab])
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(int(tokenizer.bos_token_id))
    writer.add_eos_token_id(int(tokenizer.eos_token_id))
    writer.add_chat_template(CHATML_TEMPLATE)
    for name, tensor in _tensors(model).items():
        writer.add_tensor(name, tensor.contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tokenizer.chat_template = CHATML_TEMPLATE
    return model, tokenizer


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, PreTrainedTokenizerFast]:
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.F32.gguf"
    model, tokenizer = write_tiny_gguf(path)
    return path, model, tokenizer


def test_the_import_keeps_weights_tokenizer_and_template_and_passes_the_gate(
    tiny_gguf: tuple[Path, Any, PreTrainedTokenizerFast], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, original, tokenizer = tiny_gguf
    out = tmp_path / "hf"
    assert main(["import-gguf", str(path), "--out", str(out)]) == 0
    assert f"imported llama (0.1M parameters, float32) to {out}" in capsys.readouterr().out
    assert (out / "model.safetensors").is_file()
    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    assert "quantization_config" not in config  # a plain folder: loading it needs no GGUF file

    loaded = load_model(out)
    imported = dict(loaded.hf.state_dict())
    for name, weight in original.state_dict().items():
        assert torch.equal(imported[name], weight), name  # fp32 tensors and q/k un-permuted exactly
    assert loaded.tokenizer.encode(TEXT, add_special_tokens=False) == tokenizer.encode(TEXT, add_special_tokens=False)
    assert loaded.tokenizer.eos_token_id == tokenizer.eos_token_id
    assert build_template(loaded.tokenizer) == build_template(tokenizer)  # the chat template came along
    assert run_gate(StitchEngine(loaded)).passed
    assert main(["verify", "--model", str(out), "--device", "cpu"]) == 0


def test_the_dtype_option_saves_that_dtype(tiny_gguf: tuple[Path, Any, Any], tmp_path: Path) -> None:
    path, original, _ = tiny_gguf
    result = import_gguf(path, tmp_path / "bf16", torch.bfloat16)
    assert result.dtype is torch.bfloat16 and result.model_type == "llama"
    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), "pt") as saved:
        weight = saved.get_tensor("model.layers.1.self_attn.k_proj.weight")
    expected = original.state_dict()["model.layers.1.self_attn.k_proj.weight"].to(torch.bfloat16)
    assert weight.dtype == torch.bfloat16 and torch.equal(weight, expected)


@pytest.mark.parametrize(
    ("architecture", "message"),
    [
        (
            "phi3",
            r"model_type 'phi3' is not supported; kvstitch stitches llama, qwen2, mistral",
        ),  # transformers reads it
        ("nonesuch", r"transformers cannot read it \(.*nonesuch.*\); kvstitch stitches llama, qwen2, mistral"),
    ],
)
def test_an_architecture_the_engine_cannot_stitch_is_refused_by_name(
    tmp_path: Path, architecture: str, message: str
) -> None:
    gguf = pytest.importorskip("gguf", reason="the optional gguf package (kvstitch[gguf]) is not installed")
    path = tmp_path / f"{architecture}.gguf"
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(2)
    writer.add_embedding_length(64)
    writer.add_head_count(4)
    writer.add_vocab_size(8)
    writer.add_tensor("token_embd.weight", torch.zeros(8, 64).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFImportError, match=message):
        import_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: None, "no such file"),
        (
            lambda p: p.write_bytes(b"PK\x03\x04 a zip, not a GGUF"),
            "not a GGUF file (it does not start with the GGUF magic bytes)",
        ),
        (lambda p: p.mkdir(), "not a regular file"),
    ],
)
def test_a_missing_or_foreign_file_is_one_clear_line(
    tmp_path: Path, make: Any, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "model.gguf"
    make(path)
    assert main(["import-gguf", str(path), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == f"error: {path}: {message}\n"
    assert not (tmp_path / "out").exists()


def test_without_the_gguf_package_the_error_says_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF\x03\x00\x00\x00")
    monkeypatch.setitem(sys.modules, "gguf", None)  # an import of it now fails as if it were not installed
    assert main(["import-gguf", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: reading a GGUF file needs the optional gguf")
    assert "pip install 'kvstitch[gguf]'" in err


def test_an_output_folder_with_files_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF\x03\x00\x00\x00")
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}", encoding="utf-8")
    with pytest.raises(GGUFImportError, match="exists and is not an empty folder"):
        import_gguf(path, out)
