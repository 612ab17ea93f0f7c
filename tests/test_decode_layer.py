"""`tandem_cpu::decode_layers`: an eager decode pass runs its layers as one call into the CPU kernels,
and computes exactly what the layers' modules compute one by one: the same hidden states and the same
keys and values in the cache, bit for bit, for every family (biases, sliding windows), weight type
and cache type it takes; where a product would take another path, the modules run."""

from __future__ import annotations

import pytest
import torch

from cluster.model import cpu_kernels
from cluster.model.attention import SeqChunk, allocate_kv_cache, build_attention_metadata
from cluster.model.causal_lm import CausalLM
from cluster.model.loader import load_model

pytestmark = pytest.mark.skipif(not cpu_kernels.used(), reason="the CPU kernels are not built on this machine")

BLOCK = 8
LENGTHS = (5, 17, 30)  # three sequences' prompts; each then decodes one row


def _pass(model, cache, chunks, ids) -> torch.Tensor:
    meta = build_attention_metadata(chunks, BLOCK, model.windows)
    return model(torch.tensor(ids), meta.positions, cache, meta)


def _decode_both_ways(
    model, kv_dtype: str, monkeypatch, lengths=LENGTHS
) -> tuple[torch.Tensor, torch.Tensor, list, list, list]:
    """One decode pass of a row per prompt in `lengths` through the native layers and through the
    modules, each from the same prefilled cache: (hidden states native, by modules, caches native, by
    modules, `decode_natively`'s results)."""
    arch = model.arch
    dtype = model.embed_tokens.weight.dtype
    blocks = 5 * len(lengths)
    cache = allocate_kv_cache(
        arch.num_layers, blocks, BLOCK, arch.num_kv_heads, arch.head_dim, dtype, kv_dtype=kv_dtype
    )
    tables = [list(range(5 * s, 5 * s + 5)) for s in range(len(lengths))]
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, arch.vocab_size, (sum(lengths),), generator=g).tolist()
    with torch.no_grad():
        _pass(model, cache, [SeqChunk(t, 0, n) for t, n in zip(tables, lengths, strict=True)], prompt)
        decode = [SeqChunk(t, n, 1) for t, n in zip(tables, lengths, strict=True)]
        ids = torch.randint(1, arch.vocab_size, (len(lengths),), generator=g).tolist()
        native_cache = [(k.clone(), v.clone()) for k, v in cache]
        results = []
        original = CausalLM.decode_natively
        monkeypatch.setattr(CausalLM, "decode_natively", lambda *a: results.append(original(*a)) or results[-1])
        native = _pass(model, native_cache, decode, ids)
        monkeypatch.setattr(CausalLM, "decode_natively", lambda *a: None)
        by_modules = _pass(model, cache, decode, ids)
    return native, by_modules, native_cache, cache, results


@pytest.mark.parametrize(
    "family, dtype, weights, kv",
    [
        ("llama", "float32", "auto", "auto"),
        ("llama", "float32", "int8", "int8"),
        ("llama", "float32", "int4", "float16"),
        ("qwen2", "float32", "auto", "bfloat16"),  # biases on q/k/v
        ("qwen2", "float32", "int4", "auto"),
        ("mistral", "float32", "int8", "auto"),  # a sliding window shorter than the longest context
        ("mistral", "bfloat16", "auto", "int8"),
        ("llama", "bfloat16", "int4", "auto"),  # torch's int4 product, as the module takes it under bfloat16
    ],
)
def test_a_native_decode_layer_computes_what_its_modules_compute(hf_models, monkeypatch, family, dtype, weights, kv):
    model = load_model(hf_models[family][0], dtype, weight_dtype=weights, group_size=32)
    native, by_modules, native_cache, cache, results = _decode_both_ways(model, kv, monkeypatch)
    assert len(results) == 1 and results[0] is not None
    assert torch.equal(native, by_modules)
    for (k1, v1), (k2, v2) in zip(native_cache, cache, strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_more_rows_than_a_product_s_kernel_takes_run_the_modules(hf_models, monkeypatch):
    """17 decode rows are more than the int8 kernel takes (`quant.INT8_SKINNY_ROWS`): no native pass,
    the same result."""
    model = load_model(hf_models["llama"][0], "float32", weight_dtype="int8")
    native, by_modules, _, _, results = _decode_both_ways(model, "auto", monkeypatch, lengths=(3,) * 17)
    assert results == [None]
    assert torch.equal(native, by_modules)


def test_the_layer_s_weights_are_built_again_after_a_load(hf_models):
    """The native call's arguments are kept per row count; a loaded state (new float32 scales) and a
    module put in another's place are not served from what was kept."""
    model = load_model(hf_models["llama"][0], "float32", weight_dtype="int8")
    layer, x = model.layers[0], torch.zeros(2, model.arch.hidden_size)
    first = layer.native_weights(x)
    assert first is not None and layer.native_weights(x) is first
    model.load_state_dict(model.state_dict())
    again = layer.native_weights(x)
    assert again is not first and again[2][1] is layer.self_attn.qkv_proj.scales_f32
    layer.mlp.down_proj = load_model(hf_models["llama"][0], "float32").layers[0].mlp.down_proj
    assert layer.native_weights(x)[-1][0] is layer.mlp.down_proj.weight


def test_the_whole_pass_s_arguments_follow_a_load_and_a_swap(hf_models, monkeypatch):
    """`decode_natively` keeps the flat list of every layer's weights between steps: after a module is
    put in another's place, or a state loaded, the native pass still computes what the modules do."""
    model = load_model(hf_models["llama"][0], "float32", weight_dtype="int8")
    native, by_modules, _, _, results = _decode_both_ways(model, "auto", monkeypatch, lengths=(5,))
    assert results[-1] is not None and torch.equal(native, by_modules)
    monkeypatch.undo()  # `decode_natively` as it is
    model.layers[1].mlp.down_proj = load_model(hf_models["llama"][0], "float32").layers[1].mlp.down_proj
    native, by_modules, _, _, results = _decode_both_ways(model, "auto", monkeypatch, lengths=(5,))
    assert results[-1] is not None and torch.equal(native, by_modules)
    state = model.state_dict()
    state["layers.1.mlp.down_proj.weight"] = state["layers.1.mlp.down_proj.weight"] * 2
    model.load_state_dict(state)
    monkeypatch.undo()
    again, by_modules, _, _, results = _decode_both_ways(model, "auto", monkeypatch, lengths=(5,))
    assert results[-1] is not None and torch.equal(again, by_modules) and not torch.equal(again, native)
