"""Writes random-weight model folders of named shapes, for tests, benchmarks and the demo.

A folder holds what a Hugging Face checkpoint holds — `config.json`, `model.safetensors` (or shards
with an index), `tokenizer.json`, `tokenizer_config.json` with a chat template, and
`generation_config.json` — so both Tandem and transformers load it. The tokenizer is a real
byte-level BPE trained by the `tokenizers` library on the Python standard library's own source,
which every machine with Python has: nothing is downloaded.
"""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from cluster.model.arch import ARCHITECTURES, PRESETS, Preset
from cluster.model.weights import DTYPES, INDEX_FILE, SINGLE_FILE

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def stdlib_sources(max_bytes: int) -> Iterator[str]:
    """The interpreter's own standard-library `.py` files, in sorted path order, up to `max_bytes`."""
    root = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        yield text
        total += len(text)
        if total >= max_bytes:
            return


def train_tokenizer(vocab_size: int, corpus: Iterator[str] | None = None) -> Tokenizer:
    """A byte-level BPE (GPT-2 style) with Tandem's special tokens at ids 0, 1, 2."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus if corpus is not None else stdlib_sources(2_000_000), trainer)
    return tok


def hf_config(preset: Preset, architecture: str, dtype: str) -> dict[str, Any]:
    eos = [SPECIAL_TOKENS.index("<|endoftext|>"), SPECIAL_TOKENS.index("<|im_end|>")]
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": ARCHITECTURES[architecture],
        "hidden_size": preset.hidden_size,
        "intermediate_size": preset.intermediate_size,
        "num_hidden_layers": preset.num_layers,
        "num_attention_heads": preset.num_heads,
        "num_key_value_heads": preset.num_kv_heads,
        "head_dim": preset.hidden_size // preset.num_heads,
        "vocab_size": preset.vocab_size,
        "max_position_embeddings": preset.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": preset.rope_theta,
        "rope_scaling": preset.rope_scaling,
        "hidden_act": "silu",
        "tie_word_embeddings": preset.tie_word_embeddings,
        "bos_token_id": None,
        "eos_token_id": eos,
        "initializer_range": 0.02,
        "torch_dtype": dtype,
        **preset.extra,
    }
    if architecture == "Qwen2ForCausalLM":
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=preset.num_layers)
    if architecture == "MistralForCausalLM":
        config["sliding_window"] = None
    return config


def random_weights(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Hugging Face-named tensors: normal(0, initializer_range) matrices, ones for norms."""
    gen = torch.Generator().manual_seed(seed)
    std = config["initializer_range"]
    h, inter, hd = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    qkv_bias = config["model_type"] == "qwen2"

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    tensors = {"model.embed_tokens.weight": normal(config["vocab_size"], h), "model.norm.weight": torch.ones(h)}
    if not config["tie_word_embeddings"]:
        tensors["lm_head.weight"] = normal(config["vocab_size"], h)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            tensors[f"{p}.self_attn.{name}.weight"] = normal(rows, h)
            if qkv_bias:
                tensors[f"{p}.self_attn.{name}.bias"] = normal(rows)
        tensors[f"{p}.self_attn.o_proj.weight"] = normal(h, q)
        tensors[f"{p}.mlp.gate_proj.weight"] = normal(inter, h)
        tensors[f"{p}.mlp.up_proj.weight"] = normal(inter, h)
        tensors[f"{p}.mlp.down_proj.weight"] = normal(h, inter)
        tensors[f"{p}.input_layernorm.weight"] = torch.ones(h)
        tensors[f"{p}.post_attention_layernorm.weight"] = torch.ones(h)
    return tensors


def save_weights(tensors: dict[str, torch.Tensor], out: Path, max_shard_bytes: int | None = None) -> None:
    """Writes `model.safetensors`, or shards plus `model.safetensors.index.json` past `max_shard_bytes`."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if max_shard_bytes and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(out / SINGLE_FILE), metadata=meta)
        return
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / name), metadata=meta)
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2))


def write_tokenizer(tok: Tokenizer, out: Path, max_length: int) -> None:
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": max_length,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def init_model_folder(
    out: str | Path,
    preset: str = "tiny",
    architecture: str = "LlamaForCausalLM",
    dtype: str = "bfloat16",
    seed: int = 0,
    max_shard_bytes: int | None = None,
    tokenizer: Tokenizer | None = None,
) -> Path:
    """Writes a random-weight model folder; returns its path."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r} (known: {', '.join(PRESETS)})")
    if architecture not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {architecture!r} (known: {', '.join(ARCHITECTURES)})")
    p = PRESETS[preset]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = hf_config(p, architecture, dtype)
    tensors = {k: v.to(DTYPES[dtype]) for k, v in random_weights(config, seed).items()}
    save_weights(tensors, out, max_shard_bytes)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    generation = {"eos_token_id": config["eos_token_id"], "bos_token_id": None, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    write_tokenizer(tokenizer or train_tokenizer(min(p.tokenizer_vocab, p.vocab_size)), out, p.max_position_embeddings)
    return out
