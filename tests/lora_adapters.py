"""LoRA adapters for tests: three PEFT adapters of different ranks, targets, layers and scalings on the
tiny Llama, and PEFT's own model holding all three (the reference)."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from cluster.model.lora import TARGETS
from tests.conftest import write_hf_model

peft = pytest.importorskip("peft", reason="peft is the reference LoRA implementation (the dev extra)")
# The fixture `lora_models` (tests/conftest.py) builds them once per session.

# name -> PEFT LoraConfig arguments: different ranks, targets, layers and scalings
ADAPTERS = {
    "attn-r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "all-r8": dict(r=8, lora_alpha=4, use_rslora=True, target_modules=list(TARGETS)),
    "mlp-r2": dict(r=2, lora_alpha=16, target_modules=["o_proj", "down_proj", "up_proj"], layers_to_transform=[1]),
}


def write_adapter(base, folder, seed: int, **kwargs):  # type: ignore[no-untyped-def]
    """A PEFT adapter with random (non-zero) A and B, saved under `folder`; returns the PEFT model."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(init_lora_weights=False, **kwargs)
    model = peft.get_peft_model(copy.deepcopy(base), config)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data.normal_(0, 0.2)
    model.save_pretrained(folder)
    return model


def lora_models(root: Path):  # type: ignore[no-untyped-def]
    """The tiny Llama, three adapters on it (under `root`), and PEFT's model holding all three."""
    base = write_hf_model("llama", root / "base")
    folders = {}
    for seed, (name, kwargs) in enumerate(ADAPTERS.items()):
        write_adapter(base, root / name, seed, **kwargs)
        folders[name] = root / name
    reference = peft.PeftModel.from_pretrained(copy.deepcopy(base), folders["attn-r4"], adapter_name="attn-r4")
    for name in list(ADAPTERS)[1:]:
        reference.load_adapter(folders[name], adapter_name=name)
    return root / "base", folders, reference.eval()


@contextlib.contextmanager
def through(reference, name: str | None) -> Iterator[None]:  # type: ignore[no-untyped-def]
    """PEFT's model running through adapter `name` (None: the base model), without gradients."""
    with torch.inference_mode():
        if name is None:
            with reference.disable_adapter():
                yield
        else:
            reference.set_adapter(name)
            yield


def peft_logits(reference, name: str | None, prompt: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    with through(reference, name):
        return reference(torch.tensor([prompt])).logits[0]


def peft_greedy(reference, name: str | None, prompt: list[int], max_tokens: int) -> list[int]:  # type: ignore[no-untyped-def]
    """PEFT's greedy continuation of `prompt` through adapter `name` (None: the base model)."""
    with through(reference, name):
        out = reference.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def peft_logprobs(reference, name: str | None, prompt: list[int], tokens: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """PEFT's log-probability of each of `tokens` where it stands after `prompt` (float64)."""
    logits = peft_logits(reference, name, prompt + tokens)[len(prompt) - 1 : -1]
    return torch.log_softmax(logits.double(), -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
