"""A model's tensors on huge pages (`cluster.model.hugepages`): moved in place with their values and
ties, into one mapping advised for huge pages; `model.huge_pages` loads the same tensors either way."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cluster.config import ModelConfig
from cluster.model import hugepages
from cluster.model.loader import load_model

DEMO = Path(__file__).resolve().parents[1] / "models" / "tandem-demo-code"


def _mapping_of(address: int) -> dict[str, str]:
    """/proc/self/smaps' fields for the mapping that holds `address`."""
    fields: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(" ", 1)[0]
        if "-" in head and ":" not in head:
            low, high = (int(part, 16) for part in head.split("-"))
            inside = low <= address < high
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


def test_rehome_keeps_values_and_ties_and_moves_only_large_tensors():
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"embed": torch.nn.Embedding(512, 96), "head": torch.nn.Linear(96, 512, bias=False)})
    model["head"].weight = model["embed"].weight  # tied, as a small model's head and embedding are
    model["norm"] = torch.nn.LayerNorm(96)  # 384-byte weights: left where they are
    before = {name: t.clone() for name, t in model.state_dict().items()}
    norm_at = model["norm"].weight.data_ptr()

    moved = hugepages.rehome(model)

    assert moved == 512 * 96 * 4  # the tied weight once
    assert model["head"].weight is model["embed"].weight
    assert model["norm"].weight.data_ptr() == norm_at
    for name, t in model.state_dict().items():
        assert torch.equal(t, before[name]), name
    assert model["embed"].weight.data_ptr() % 64 == 0
    out = model["head"](model["embed"](torch.tensor([3, 7])))  # the moved tensors compute as before
    assert torch.equal(out, before["embed.weight"][[3, 7]] @ before["embed.weight"].t())


@pytest.mark.skipif(not hugepages.available(), reason="this kernel's transparent huge pages are off (never)")
def test_the_new_home_is_one_private_mapping_advised_for_huge_pages():
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.Linear(1024, 256))
    hugepages.rehome(model)
    first, last = model[0].weight.data_ptr(), model[1].weight.data_ptr()
    assert first % hugepages.HUGE_PAGE == 0  # the first tensor starts on a 2 MB boundary
    mapping = _mapping_of(first)
    flags = mapping["VmFlags"].split()
    assert "hg" in flags and "sh" not in flags, mapping["VmFlags"]  # advised; private (shared memory takes none)
    assert _mapping_of(last) == mapping  # every tensor in the one mapping


def test_settings_are_checked_and_off_keeps_torchs_memory():
    assert not hugepages.wanted("off", "cpu")
    assert not hugepages.wanted("auto", "cuda")
    assert hugepages.wanted("auto", "cpu") == hugepages.available()
    with pytest.raises(ValueError, match="huge_pages must be one of"):
        hugepages.wanted("always", "cpu")
    with pytest.raises(ValueError, match="huge_pages"):
        ModelConfig(path=DEMO, huge_pages="on")


def test_a_model_loads_the_same_tensors_on_huge_pages_or_not():
    plain = load_model(DEMO, "float32", huge_pages="off")
    moved = load_model(DEMO, "float32", huge_pages="auto")
    for (name, a), (_, b) in zip(plain.state_dict().items(), moved.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    if hugepages.available():
        assert "hg" in _mapping_of(moved.embed_tokens.weight.data_ptr())["VmFlags"].split()
