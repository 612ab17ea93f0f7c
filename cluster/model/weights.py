"""The tables a model folder's weights are read and written by, shared by the loader and the GGUF import.

`DTYPES` names the float types a model loads and runs in; `SINGLE_FILE` and `INDEX_FILE` are a
folder's weight files (one file, or shards listed by an index); `QUANT_KEY` is the `config.json`
entry saying how a quantised folder's weights were quantised; `weight_table(arch)` maps each Hugging
Face tensor name to a parameter of `cluster.model.causal_lm.CausalLM` and, for fused projections,
the row range it fills. Nothing here reads a file.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cluster.model.arch import ModelArch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
QUANT_KEY = "tandem_quantization"  # config.json: how a folder's weights were quantised


@dataclass(frozen=True)
class Target:
    param: str  # name in CausalLM.named_parameters()
    rows: tuple[int, int] | None = None  # half-open row range of a fused parameter


def weight_table(arch: ModelArch) -> dict[str, Target]:
    """Hugging Face tensor name -> where it goes in `CausalLM`."""
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    inter = arch.intermediate_size
    table = {
        "model.embed_tokens.weight": Target("embed_tokens.weight"),
        "model.norm.weight": Target("norm.weight"),
    }
    if not arch.tie_word_embeddings:
        table["lm_head.weight"] = Target("lm_head.weight")
    for i in range(arch.num_layers):
        hf, ours = f"model.layers.{i}", f"layers.{i}"
        table[f"{hf}.input_layernorm.weight"] = Target(f"{ours}.input_layernorm.weight")
        table[f"{hf}.post_attention_layernorm.weight"] = Target(f"{ours}.post_attention_layernorm.weight")
        kinds = ["weight", "bias"] if arch.qkv_bias else ["weight"]
        for kind in kinds:
            fused = f"{ours}.self_attn.qkv_proj.{kind}"
            table[f"{hf}.self_attn.q_proj.{kind}"] = Target(fused, (0, q))
            table[f"{hf}.self_attn.k_proj.{kind}"] = Target(fused, (q, q + kv))
            table[f"{hf}.self_attn.v_proj.{kind}"] = Target(fused, (q + kv, q + 2 * kv))
        for kind in ["weight", "bias"] if arch.o_bias else ["weight"]:
            table[f"{hf}.self_attn.o_proj.{kind}"] = Target(f"{ours}.self_attn.o_proj.{kind}")
        for kind in ["weight", "bias"] if arch.mlp_bias else ["weight"]:
            fused = f"{ours}.mlp.gate_up_proj.{kind}"
            table[f"{hf}.mlp.gate_proj.{kind}"] = Target(fused, (0, inter))
            table[f"{hf}.mlp.up_proj.{kind}"] = Target(fused, (inter, 2 * inter))
            table[f"{hf}.mlp.down_proj.{kind}"] = Target(f"{ours}.mlp.down_proj.{kind}")
    return table
