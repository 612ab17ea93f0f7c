"""LoRA adapters against `peft` on the same base weights: three adapters of different ranks, targets
and scaling, and the base model, rows of all four in one paged pass give PEFT's logits; and every
adapter Tandem cannot serve is refused by name."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from cluster.model.attention import SeqChunk, allocate_kv_cache, build_attention_metadata
from cluster.model.loader import load_model
from cluster.model.lora import TARGETS, AdapterError, LoraSlots, read_adapter
from tests.conftest import TINY
from tests.lora_adapters import ADAPTERS, peft_logits, write_adapter

transformers = pytest.importorskip("transformers")


def mixed_pass(model, slots: LoraSlots, prompts: list[list[int]], slot_of: list[int], block_size: int = 16):
    """Every prompt in one paged pass, each token row through its prompt's slot; logits per prompt."""
    chunks, start = [], 0
    for p in prompts:
        n = -(-len(p) // block_size)
        chunks.append(SeqChunk(range(start, start + n), 0, len(p)))
        start += n
    arch = model.arch
    kv = allocate_kv_cache(arch.num_layers, start, block_size, arch.num_kv_heads, arch.head_dim, torch.float32)
    meta = build_attention_metadata(chunks, block_size, model.windows)
    ids = torch.tensor([t for p in prompts for t in p])
    rows = torch.tensor([s for p, s in zip(prompts, slot_of, strict=True) for _ in p])
    with torch.inference_mode():
        logits = model.compute_logits(model(ids, meta.positions, kv, meta, lora=slots.batch(rows)))
    return logits.split([len(p) for p in prompts])


def test_rows_of_three_adapters_and_the_base_in_one_pass_give_peft_logits(lora_models):
    base, folders, reference = lora_models
    model = load_model(base, "float32")
    slots = LoraSlots(model.arch, max_loras=4, max_rank=8, targets=TARGETS, dtype=torch.float32)
    names = list(ADAPTERS)
    for slot, name in zip((2, 0, 3), names, strict=True):  # slots out of order; slot 1 stays empty
        slots.write(slot, read_adapter(folders[name], model.arch, max_rank=8))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (13, 21, 7, 30, 9)]
    which = [None, "attn-r4", "all-r8", "mlp-r2", "attn-r4"]  # None: the base model
    slot_of = [{None: -1, "attn-r4": 2, "all-r8": 0, "mlp-r2": 3}[w] for w in which]
    got = mixed_pass(model, slots, prompts, slot_of)
    for prompt, name, mine in zip(prompts, which, got, strict=True):
        theirs = peft_logits(reference, name, prompt)
        err = ((mine - theirs).abs().max() / theirs.abs().max()).item()
        assert err <= 1e-4, f"{name}: relative error {err}"
    # Each adapter changes the logits, so the comparison above tells them apart.
    plain = peft_logits(reference, None, prompts[1])
    for name in names:
        assert (peft_logits(reference, name, prompts[1]) - plain).abs().max() > 1e-2, name


def test_an_emptied_slot_serves_the_base_model(lora_models):
    base, folders, reference = lora_models
    model = load_model(base, "float32")
    slots = LoraSlots(model.arch, max_loras=2, max_rank=8, targets=TARGETS, dtype=torch.float32)
    slots.write(1, read_adapter(folders["all-r8"], model.arch, max_rank=8))
    slots.write(1, None)
    prompt = list(range(5, 25))
    (mine,) = mixed_pass(model, slots, [prompt], [1])
    assert torch.allclose(mine, peft_logits(reference, None, prompt), atol=1e-4, rtol=1e-4)


def test_an_adapters_digest_is_its_content(lora_models, tmp_path):
    _, folders, _ = lora_models
    model = load_model(lora_models[0], "float32")
    a = read_adapter(folders["attn-r4"], model.arch, max_rank=8)
    shutil.copytree(folders["attn-r4"], tmp_path / "renamed")
    assert read_adapter(tmp_path / "renamed", model.arch, max_rank=8).digest == a.digest
    assert read_adapter(folders["all-r8"], model.arch, max_rank=8).digest != a.digest
    assert a.rank == 4 and a.targets == {"q_proj", "v_proj"}


def _edit_config(folder, **changes):  # type: ignore[no-untyped-def]
    path = folder / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize(
    "case, match",
    [
        ("missing weights", "adapter_model.safetensors is missing"),
        ("missing config", "adapter_config.json is missing"),
        ("rank over the limit", "rank 8 is over lora.max_rank 4"),
        ("target not enabled", r"target '(gate|up|down)_proj' is not enabled"),
        ("another base model", "do not fit the model's"),
        ("DoRA", "use_dora"),
        ("a target the model lacks", "not a LoRA update of a decoder layer's projection"),
        ("corrupt weights", "cannot read"),
    ],
)
def test_bad_adapters_are_refused_by_name(lora_models, tmp_path, case, match):
    base, folders, _ = lora_models
    model = load_model(base, "float32")
    bad = tmp_path / "bad"
    shutil.copytree(folders["all-r8"], bad)
    max_rank, targets = 8, TARGETS
    if case == "missing weights":
        (bad / "adapter_model.safetensors").unlink()
    elif case == "missing config":
        (bad / "adapter_config.json").unlink()
    elif case == "rank over the limit":
        max_rank = 4
    elif case == "target not enabled":
        targets = ("q_proj", "k_proj", "v_proj", "o_proj")
    elif case == "another base model":  # the same family with a narrower MLP
        shutil.rmtree(bad)
        narrow = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**TINY, "intermediate_size": 96}))
        write_adapter(narrow, bad, 0, r=2, target_modules=["gate_proj"])
    elif case == "DoRA":
        _edit_config(bad, use_dora=True)
    elif case == "a target the model lacks":
        shutil.rmtree(bad)
        other = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
        write_adapter(other, bad, 0, r=2, target_modules=["lm_head"])
    elif case == "corrupt weights":
        (bad / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(AdapterError, match=match) as e:
        read_adapter(bad, model.arch, max_rank=max_rank, targets=targets, name="tenant-7")
    assert "tenant-7" in str(e.value)


@pytest.mark.parametrize("weight_dtype", ["int8", "int4"])
def test_adapters_over_quantised_weights_are_the_same_adapters_over_those_weights_dequantised(
    lora_models, weight_dtype
):
    """A quantised base applies each row's update to its quantised projections' output: the logits
    equal the same adapters' over a float model holding the dequantised weights (which PEFT's are,
    the test above shows), rows of every adapter and the base in one pass."""
    import copy

    from cluster.model.quant import Int4Linear, Int8Linear, quantize

    base, folders, _ = lora_models
    model = load_model(base, "float32")
    quantised = quantize(copy.deepcopy(model), weight_dtype, group_size=32, lm_head=False)
    dequantised = copy.deepcopy(model)
    for path, module in quantised.named_modules():
        if isinstance(module, Int8Linear | Int4Linear):
            dequantised.get_submodule(path).weight.data.copy_(module.dense())
    slots = LoraSlots(model.arch, max_loras=3, max_rank=8, targets=TARGETS, dtype=torch.float32)
    for slot, name in enumerate(ADAPTERS):
        slots.write(slot, read_adapter(folders[name], model.arch, max_rank=8))
    prompts = [list(range(5 + i, 25 + 2 * i)) for i in range(4)]
    got = mixed_pass(quantised, slots, prompts, [-1, 0, 1, 2])
    want = mixed_pass(dequantised, slots, prompts, [-1, 0, 1, 2])
    for mine, theirs in zip(got, want, strict=True):
        assert ((mine - theirs).abs().max() / theirs.abs().max()).item() <= 1e-4
    plain = mixed_pass(quantised, slots, prompts[1:2], [-1])[0]
    assert (plain - got[1]).abs().max() > 1e-2, "the adapter changed the quantised model's logits"
