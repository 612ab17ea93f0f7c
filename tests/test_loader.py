"""Strict loading: every broken model folder fails with an error that names the problem."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from cluster.model.arch import ModelArch, ModelFormatError
from cluster.model.loader import load_model


@pytest.fixture
def folder(hf_models, tmp_path) -> Path:
    """A private copy of the single-file Mistral fixture to break."""
    dest = tmp_path / "model"
    shutil.copytree(hf_models["mistral"][0], dest)
    return dest


def rewrite_weights(folder: Path, edit) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_intact_copy_loads(folder):
    assert load_model(folder).arch.architecture == "MistralForCausalLM"


def test_missing_tensor_is_named(folder):
    rewrite_weights(folder, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ModelFormatError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load_model(folder)


def test_extra_tensor_is_named(folder):
    rewrite_weights(folder, lambda t: t.update({"model.layers.0.self_attn.q_norm.weight": torch.ones(16)}))
    with pytest.raises(ModelFormatError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.q_norm\.weight'"):
        load_model(folder)


def test_wrong_shape_is_named(folder):
    def shrink(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:-1]

    rewrite_weights(folder, shrink)
    with pytest.raises(ModelFormatError, match=r"'model\.layers\.0\.self_attn\.k_proj\.weight' has shape \(31, 64\)"):
        load_model(folder)


def test_non_float_tensor_is_named(folder):
    rewrite_weights(folder, lambda t: t.update({"model.norm.weight": torch.ones(64, dtype=torch.int32)}))
    with pytest.raises(ModelFormatError, match=r"'model\.norm\.weight' has non-float dtype"):
        load_model(folder)


def test_corrupt_config_is_named(folder):
    (folder / "config.json").write_text('{"hidden_size": 64,')
    with pytest.raises(ModelFormatError, match=r"config\.json is not valid JSON"):
        load_model(folder)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"num_attention_heads": 0}, "'num_attention_heads' must be a positive integer"),
        ({"architectures": ["GPT2LMHeadModel"]}, "architecture 'GPT2LMHeadModel' is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"num_key_value_heads": 3}, r"not a multiple of num_key_value_heads \(3\)"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn' is not supported"),
    ],
)
def test_bad_config_values_are_named(folder, edit, message):
    config = json.loads((folder / "config.json").read_text())
    config.update(edit)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFormatError, match=message):
        load_model(folder)


def test_missing_key_is_named(folder):
    config = json.loads((folder / "config.json").read_text())
    del config["intermediate_size"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFormatError, match="missing key 'intermediate_size'"):
        load_model(folder)


def test_missing_files_are_named(folder):
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelFormatError, match=r"has neither model\.safetensors nor model\.safetensors\.index\.json"):
        load_model(folder)
    (folder / "config.json").unlink()
    with pytest.raises(ModelFormatError, match=r"config\.json is missing"):
        load_model(folder)


def test_corrupt_weights_file_is_named(folder):
    (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    with pytest.raises(ModelFormatError, match=r"cannot read .*model\.safetensors"):
        load_model(folder)


def test_missing_shard_is_named(hf_models, tmp_path):
    dest = tmp_path / "sharded"
    shutil.copytree(hf_models["qwen2"][0], dest)
    (dest / "model-00002-of-00012.safetensors").unlink()
    with pytest.raises(ModelFormatError, match=r"shard .*model-00002-of-00012\.safetensors .* is missing"):
        load_model(dest)


def test_tied_head_must_equal_embedding(hf_models, tmp_path):
    dest = tmp_path / "tied"
    shutil.copytree(hf_models["llama"][0], dest)
    assert ModelArch.from_folder(dest).tie_word_embeddings
    rewrite_weights(dest, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    load_model(dest)  # a repeated, equal head is accepted
    rewrite_weights(dest, lambda t: t.update({"lm_head.weight": t["lm_head.weight"] + 1}))
    with pytest.raises(ModelFormatError, match=r"lm_head\.weight differs from the embedding"):
        load_model(dest)


def test_older_rope_keys_are_read():
    arch = ModelArch.from_hf_config(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 10,
            "hidden_size": 8,
            "intermediate_size": 16,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "max_position_embeddings": 64,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        }
    )
    assert arch.rope.theta == 500000.0 and arch.rope.type == "llama3" and arch.rope.factor == 32.0
    assert arch.num_kv_heads == 2 and arch.head_dim == 4
