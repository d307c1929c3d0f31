"""Block keys and model fingerprints: stable across processes, different whenever the KV could differ."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from service.engine.model import LoadedModel, load_model
from service.kvcache.keys import block_key, is_block_key, model_fingerprint, pack_token_ids

FP = "a" * 64
IDS = (1, 17, 300, 5, 5, 0)
TEMPLATE = "chat:v1:0123456789abcdef"


def test_key_is_deterministic_hex() -> None:
    key = block_key(FP, TEMPLATE, torch.bfloat16, IDS)
    assert key == block_key(FP, TEMPLATE, torch.bfloat16, list(IDS))
    assert is_block_key(key) and len(key) == 32


@pytest.mark.parametrize(
    ("fingerprint", "template", "dtype", "ids"),
    [
        ("b" * 64, TEMPLATE, torch.bfloat16, IDS),
        (FP, "chat:v2:0123456789abcdef", torch.bfloat16, IDS),
        (FP, TEMPLATE, torch.float16, IDS),
        (FP, TEMPLATE, torch.float32, IDS),
        (FP, TEMPLATE, torch.bfloat16, (17, 1, 300, 5, 5, 0)),  # order matters
        (FP, TEMPLATE, torch.bfloat16, (*IDS, 0)),  # a trailing zero is a different block
        (FP, TEMPLATE, torch.bfloat16, IDS[:-1]),
        (FP, TEMPLATE, torch.bfloat16, (1, 17, 300, 5, 5, 1 << 33)),  # ids past int32 are not wrapped
    ],
    ids=["fingerprint", "template", "fp16", "fp32", "order", "longer", "shorter", "wide-id"],
)
def test_any_difference_changes_the_key(
    fingerprint: str, template: str, dtype: torch.dtype, ids: tuple[int, ...]
) -> None:
    assert block_key(fingerprint, template, dtype, ids) != block_key(FP, TEMPLATE, torch.bfloat16, IDS)


def test_field_boundaries_are_unambiguous() -> None:
    assert block_key("ab", "c", torch.float32, IDS) != block_key("a", "bc", torch.float32, IDS)


def test_token_packing_is_little_endian_int64_with_count() -> None:
    count = bytes([2, 0, 0, 0, 0, 0, 0, 0])
    one = bytes([1, 0, 0, 0, 0, 0, 0, 0])
    two_fifty_six = bytes([0, 1, 0, 0, 0, 0, 0, 0])
    assert pack_token_ids([1, 256]) == count + one + two_fifty_six
    with pytest.raises(ValueError, match="non-negative"):
        pack_token_ids([3, -1])


# ---- fingerprints ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir: Path) -> LoadedModel:
    return load_model(tiny_model_dir)


@pytest.mark.slow
def test_key_and_fingerprint_agree_across_processes(tiny_model_dir: Path, tiny_model: LoadedModel) -> None:
    script = textwrap.dedent(
        f"""
        import json, torch
        from service.engine.model import load_model
        from service.kvcache.keys import block_key, model_fingerprint
        print(json.dumps({{
            "key": block_key({FP!r}, {TEMPLATE!r}, torch.bfloat16, {IDS!r}),
            "fingerprint": model_fingerprint(load_model({str(tiny_model_dir)!r})),
        }}))
        """
    )
    # A different hash seed in the child proves Python's salted hash() plays no part.
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    child = json.loads(out.stdout.strip().splitlines()[-1])

    assert child["key"] == block_key(FP, TEMPLATE, torch.bfloat16, IDS)
    assert child["fingerprint"] == model_fingerprint(tiny_model)


def test_fingerprint_ignores_where_the_model_lives(
    tiny_model_dir: Path, tiny_model: LoadedModel, tmp_path: Path
) -> None:
    copy = shutil.copytree(tiny_model_dir, tmp_path / "copy")
    assert model_fingerprint(load_model(copy)) == model_fingerprint(tiny_model)


def test_fingerprint_changes_when_one_weight_changes(
    tiny_model_dir: Path, tiny_model: LoadedModel, tmp_path: Path
) -> None:
    changed = shutil.copytree(tiny_model_dir, tmp_path / "changed")
    weights = load_file(changed / "model.safetensors")
    name = "model.layers.1.self_attn.v_proj.weight"
    weights[name][3, 5] += 0.5
    save_file(weights, changed / "model.safetensors", metadata={"format": "pt"})

    reloaded = load_model(changed)
    assert not torch.equal(reloaded.hf.state_dict()[name], tiny_model.hf.state_dict()[name])
    assert model_fingerprint(reloaded) != model_fingerprint(tiny_model)


def test_fingerprint_changes_when_the_config_changes(
    tiny_model_dir: Path, tiny_model: LoadedModel, tmp_path: Path
) -> None:
    changed = shutil.copytree(tiny_model_dir, tmp_path / "changed")
    config_path = changed / "config.json"
    config = json.loads(config_path.read_text())
    config["rms_norm_eps"] = 1e-5
    config["transformers_version"] = "0.0.1"  # volatile: alone it would not matter
    config_path.write_text(json.dumps(config))

    assert model_fingerprint(load_model(changed)) != model_fingerprint(tiny_model)


def test_volatile_config_fields_do_not_change_the_fingerprint(
    tiny_model_dir: Path, tiny_model: LoadedModel, tmp_path: Path
) -> None:
    changed = shutil.copytree(tiny_model_dir, tmp_path / "changed")
    config_path = changed / "config.json"
    config = json.loads(config_path.read_text())
    config["transformers_version"] = "0.0.1"
    config_path.write_text(json.dumps(config))

    assert model_fingerprint(load_model(changed)) == model_fingerprint(tiny_model)


def test_fingerprint_changes_with_the_run_dtype(tiny_model_dir: Path, tiny_model: LoadedModel) -> None:
    in_bf16 = load_model(tiny_model_dir, dtype=torch.bfloat16)
    assert model_fingerprint(in_bf16) != model_fingerprint(tiny_model)


def test_hub_models_fingerprint_their_parameters(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir)
    hub = dataclasses.replace(model, source="some-org/some-model")
    before = model_fingerprint(hub)
    assert before == model_fingerprint(hub)
    assert before != model_fingerprint(model)  # folder and hub identities are computed differently

    with torch.no_grad():
        model.hf.state_dict()["model.layers.0.mlp.up_proj.weight"][0, 0] += 1.0

    assert model_fingerprint(hub) != before
