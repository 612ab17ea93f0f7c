"""`tandem model init` folders load in Tandem and in transformers, and agree."""

from __future__ import annotations

import json

import pytest
import torch

from cli.main import main
from cluster.generate import generate
from cluster.model.arch import ARCHITECTURES, ModelArch
from cluster.model.builder import PRESETS, init_model_folder, train_tokenizer
from cluster.model.loader import load_model
from cluster.model.tokenizer import ChatTemplateError, Tokenizer

CODE = 'def greet(name: str) -> str:\n    """Say hello."""\n    return f"hello, {name}!"  # ünïcödé ✓\n'


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(512)


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("built")
    folders = {}
    for arch in ARCHITECTURES:
        shard = 60_000 if arch == "LlamaForCausalLM" else None
        folders[arch] = init_model_folder(
            root / arch, "tiny", arch, "float32", seed=3, max_shard_bytes=shard, tokenizer=tokenizer
        )
    return folders


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_built_folder_matches_transformers(tiny_folders, arch):
    from transformers import AutoModelForCausalLM

    folder = tiny_folders[arch]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert type(hf).__name__ == arch
    ours = load_model(folder, "float32")
    prompt = Tokenizer(folder).encode(CODE)
    with torch.inference_mode():
        ref = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=16,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            eos_token_id=None,
        )
    got = generate(ours, [prompt], 16, keep_logits=True)[0]
    assert got.tokens == ref.sequences[0, len(prompt) :].tolist()
    for mine, theirs in zip(got.logits, ref.logits, strict=True):
        assert ((mine - theirs[0]).abs().max() / theirs[0].abs().max()).item() <= 1e-4


def test_sharded_folder_has_index(tiny_folders):
    folder = tiny_folders["LlamaForCausalLM"]
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1


def test_tokenizer_round_trips_and_matches_transformers(tiny_folders):
    from transformers import AutoTokenizer

    folder = tiny_folders["LlamaForCausalLM"]
    ours, theirs = Tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    ids = ours.encode(CODE)
    assert ours.decode(ids) == CODE
    assert ids == theirs(CODE)["input_ids"]
    assert len(ids) < len(CODE.encode()) / 1.5, "BPE merges should compress source code"
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Add two ints."}]
    rendered = ours.apply_chat_template(messages)
    assert rendered == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")
    assert ours.encode("<|im_end|>") == [2]


def test_eos_ids_come_from_generation_config(tiny_folders):
    folder = tiny_folders["Qwen2ForCausalLM"]
    tok = Tokenizer(folder)
    assert tok.eos_token_ids == (0, 2)
    assert ModelArch.from_folder(folder).eos_token_ids == (0, 2)


def test_missing_chat_template_is_a_clear_error(tiny_folders, tmp_path):
    import shutil

    folder = tmp_path / "nochat"
    shutil.copytree(tiny_folders["MistralForCausalLM"], folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Tokenizer(folder).apply_chat_template([{"role": "user", "content": "hi"}])


def test_presets_have_consistent_shapes():
    for name, p in PRESETS.items():
        assert p.hidden_size % p.num_heads == 0 and p.num_heads % p.num_kv_heads == 0, name
        assert p.tokenizer_vocab <= p.vocab_size, name


def test_cli_init_then_generate(tmp_path, capsys):
    out = tmp_path / "cli-model"
    assert main(["model", "init", "--preset", "tiny", "--arch", "Qwen2ForCausalLM", "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["torch_dtype"] == "bfloat16"
    capsys.readouterr()
    assert main(["generate", "--model", str(out), "--prompt", "import os", "--max-tokens", "5", "--chat"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("import os")
    assert "generated" in captured.err
    assert main(["generate", "--model", str(tmp_path / "nowhere"), "--prompt", "x"]) == 2
    assert "config.json is missing" in capsys.readouterr().err
