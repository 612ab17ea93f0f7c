"""The model's architecture, read from a Hugging Face `config.json` into a frozen dataclass.

Supported: `LlamaForCausalLM` (Llama 2/3, SmolLM), `MistralForCausalLM` and `Qwen2ForCausalLM`.
Both the `rope_theta` + `rope_scaling` keys of older files and the `rope_parameters` key of newer
ones are understood. Anything the model code does not implement is refused here, by name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
_MODEL_TYPES = {v: k for k, v in ARCHITECTURES.items()}
ROPE_TYPES = ("default", "linear", "llama3")


class ModelFormatError(ValueError):
    """A model folder that Tandem cannot load; the message names the file, key or tensor."""


def model_dir(path: str | Path) -> Path:
    """`path` as a model folder; a `.gguf` file is refused: it becomes a folder at the edge, once."""
    path = Path(path)
    if path.suffix.lower() == ".gguf" and not path.is_dir():
        raise ModelFormatError(
            f"{path} is a GGUF file: import it first with `tandem model import-gguf` or pass it "
            "through `cluster.model.gguf.model_folder`"
        )
    return path


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelArch:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    # Per layer: attend to at most this many most recent tokens (None = all).
    sliding_windows: tuple[int | None, ...]
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelArch:
        """From `folder`'s config.json (a `.gguf` file is refused: `model_dir`)."""
        path = model_dir(folder) / "config.json"
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ModelFormatError(f"{path} is missing") from None
        except json.JSONDecodeError as e:
            raise ModelFormatError(f"{path} is not valid JSON: {e}") from None
        try:
            return cls.from_hf_config(data)
        except ModelFormatError as e:
            raise ModelFormatError(f"{path}: {e}") from None

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArch:
        if not isinstance(cfg, dict):
            raise ModelFormatError("config is not a JSON object")
        architecture = _architecture(cfg)
        num_heads = _int(cfg, "num_attention_heads")
        hidden = _int(cfg, "hidden_size")
        num_layers = _int(cfg, "num_hidden_layers")
        num_kv_heads = _int(cfg, "num_key_value_heads", num_heads)
        head_dim = cfg.get("head_dim") or hidden // num_heads
        if num_heads % num_kv_heads:
            raise ModelFormatError(
                f"num_attention_heads ({num_heads}) is not a multiple of num_key_value_heads ({num_kv_heads})"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise ModelFormatError(f"hidden_act {cfg['hidden_act']!r} is not supported (only 'silu')")
        qwen = architecture == "Qwen2ForCausalLM"
        eos = cfg.get("eos_token_id")
        return cls(
            architecture=architecture,
            vocab_size=_int(cfg, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_int(cfg, "intermediate_size"),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=int(head_dim),
            max_position_embeddings=_int(cfg, "max_position_embeddings"),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=_rope(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=True if qwen else bool(cfg.get("attention_bias", False)),
            o_bias=False if qwen else bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            sliding_windows=_sliding_windows(cfg, architecture, num_layers),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
        )


def _architecture(cfg: dict[str, Any]) -> str:
    names = cfg.get("architectures") or []
    if not names and cfg.get("model_type") in _MODEL_TYPES:
        names = [_MODEL_TYPES[cfg["model_type"]]]
    if not names:
        raise ModelFormatError("neither 'architectures' nor a known 'model_type' is set")
    if names[0] not in ARCHITECTURES:
        raise ModelFormatError(f"architecture {names[0]!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
    return names[0]


def _int(cfg: dict[str, Any], key: str, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if value is None:
        raise ModelFormatError(f"missing key {key!r}")
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ModelFormatError(f"{key!r} must be a positive integer, got {value!r}")
    return value


def _rope(cfg: dict[str, Any]) -> RopeConfig:
    # Newer files: {"rope_parameters": {"rope_type", "rope_theta", ...}}; older: rope_theta + rope_scaling.
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ModelFormatError(f"rope type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    kwargs = {k: params[k] for k in ("factor", "low_freq_factor", "high_freq_factor") if k in params}
    if "original_max_position_embeddings" in params:
        kwargs["original_max_position_embeddings"] = int(params["original_max_position_embeddings"])
    return RopeConfig(theta=float(theta), type=rope_type, **kwargs)


def _sliding_windows(cfg: dict[str, Any], architecture: str, num_layers: int) -> tuple[int | None, ...]:
    window = cfg.get("sliding_window")
    if architecture == "MistralForCausalLM":
        return (window,) * num_layers
    if architecture == "Qwen2ForCausalLM" and cfg.get("use_sliding_window") and window:
        layer_types = cfg.get("layer_types")
        if layer_types is None:
            first = int(cfg.get("max_window_layers", num_layers))
            layer_types = ["full_attention" if i < first else "sliding_attention" for i in range(num_layers)]
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    return (None,) * num_layers


@dataclass(frozen=True)
class Preset:
    """A named shape `cluster.model.builder` writes random-weight folders of."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = True
    tokenizer_vocab: int = 4096
    extra: dict[str, Any] = field(default_factory=dict)


PRESETS: dict[str, Preset] = {
    "tiny": Preset(64, 176, 2, 4, 2, vocab_size=512, max_position_embeddings=2048, tokenizer_vocab=512),
    "smollm-135m": Preset(576, 1536, 30, 9, 3, vocab_size=49152, max_position_embeddings=2048),
    "llama-1b": Preset(
        2048,
        8192,
        16,
        32,
        8,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
}
