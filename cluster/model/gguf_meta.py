"""A GGUF file's metadata, read with the `gguf` package, as a Hugging Face `config.json` and
`generation_config.json`.

llama.cpp names its keys `<architecture>.<key>` (`llama.block_count`, `llama.rope.freq_base`);
`hf_config` maps them to the keys `cluster.model.arch.ModelArch.from_hf_config` reads, and refuses,
by name, an architecture or a setting that Tandem's model does not implement.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from cluster.model.arch import ModelFormatError

# GGUF `general.architecture` -> Hugging Face architecture. llama.cpp writes Llama 2/3, SmolLM and
# Mistral 7B as "llama".
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# Tensors llama.cpp writes that the model does not take: Llama 3.1's RoPE frequency factors.
_REFUSED_TENSORS = {"rope_freqs.weight": "Llama-3 RoPE scaling stored as frequency factors (rope_freqs.weight)"}


def open_gguf(path: Path) -> Any:
    """The file's `gguf.GGUFReader`, or a ModelFormatError naming the file."""
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except (ValueError, KeyError, IndexError, OSError) as e:  # bad magic, version, type id, truncation
        raise ModelFormatError(f"cannot read {path} as GGUF: {e}") from None


def read_metadata(reader: Any) -> dict[str, Any]:
    """Every metadata key as a Python value (strings, numbers, lists)."""
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def tensor_shapes(reader: Any) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> shape in torch order (rows first; GGUF lists the fastest dimension first)."""
    return {t.name: tuple(int(n) for n in reversed(t.shape.tolist())) for t in reader.tensors}


def hf_config(meta: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """The Hugging Face `config.json` the file's metadata describes."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelFormatError(f"GGUF architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
    for name, what in _REFUSED_TENSORS.items():
        if name in shapes:
            raise ModelFormatError(f"{what} is not supported")
    if "token_embd.weight" not in shapes:
        raise ModelFormatError("missing tensor 'token_embd.weight'")
    heads = _int(meta, f"{arch}.attention.head_count")
    hidden = _int(meta, f"{arch}.embedding_length")
    head_dim = _int(meta, f"{arch}.attention.key_length", hidden // heads)
    for key in (f"{arch}.attention.value_length", f"{arch}.rope.dimension_count"):
        if _int(meta, key, head_dim) != head_dim:
            raise ModelFormatError(f"{key} = {meta[key]} differs from the head size {head_dim} (not supported)")
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": shapes["token_embd.weight"][0],
        "hidden_size": hidden,
        "intermediate_size": _int(meta, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _int(meta, f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _int(meta, f"{arch}.attention.head_count_kv", heads),
        "head_dim": head_dim,
        "max_position_embeddings": _int(meta, f"{arch}.context_length"),
        "rms_norm_eps": _float32(meta, f"{arch}.attention.layer_norm_rms_epsilon"),
        "rope_theta": _float32(meta, f"{arch}.rope.freq_base", 10000.0),
        "rope_scaling": _rope_scaling(meta, arch),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in shapes,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in shapes
        config["mlp_bias"] = False
    return config


def generation_config(meta: dict[str, Any]) -> dict[str, Any]:
    """BOS and the stop tokens: EOS, plus end-of-turn / end-of-message where the file names them."""
    stops = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    eos = list(dict.fromkeys(int(i) for i in stops if i is not None))
    return {
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }


def _rope_scaling(meta: dict[str, Any], arch: str) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor", meta.get(f"{arch}.rope.scale_linear"))
    if kind is None and factor is not None:
        kind = "linear"  # older files: rope.scale_linear alone
    if kind in (None, "none"):
        return None
    if kind != "linear":
        raise ModelFormatError(f"{arch}.rope.scaling.type {kind!r} is not supported (supported: none, linear)")
    if factor is None:
        raise ModelFormatError(f"missing key {arch}.rope.scaling.factor")
    return {"rope_type": "linear", "factor": _float32(meta, f"{arch}.rope.scaling.factor", factor)}


def _int(meta: dict[str, Any], key: str, default: int | None = None) -> int:
    value = meta.get(key, default)
    if value is None:
        raise ModelFormatError(f"missing GGUF key {key!r}")
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ModelFormatError(f"GGUF key {key!r} must be a positive integer, got {value!r} (not supported)")
    return value


def _float32(meta: dict[str, Any], key: str, default: float | None = None) -> float:
    """A float32 key as the shortest decimal that rounds to it (1e-05, not 9.999999747378752e-06):
    the value the model was trained with, and the same float32 in every computation."""
    value = meta.get(key, default)
    if value is None:
        raise ModelFormatError(f"missing GGUF key {key!r}")
    return float(np.format_float_positional(np.float32(value), unique=True, trim="-"))
