"""The adapter the repository ships (`models/adapters/smollm2-shout`, trained by `scripts/train_lora.py`)
on SmolLM2-135M-Instruct's real weights: Tandem's engine gives PEFT's greedy tokens through it and the
base model's without it, in one batch, and what it says is in capitals where the base model's is not."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cluster.config import CacheConfig, LoraConfig, SchedulerConfig
from cluster.engine.request import SamplingParams
from cluster.model.loader import load_model
from cluster.model.lora import read_adapter
from cluster.model.tokenizer import Tokenizer
from decode_worker.engine import Engine
from tests.conftest import drive
from tests.lora_adapters import peft, through

SHIPPED = Path(__file__).resolve().parents[1] / "models" / "adapters" / "smollm2-shout"
QUESTION = "What is the capital of Italy?"
NEW = 24

pytestmark = pytest.mark.slow


def test_the_shipped_adapter_answers_in_capitals_as_peft_does(smollm2):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(smollm2, dtype="float32").eval()  # the weights it was trained on
    tokenizer = Tokenizer(smollm2)
    prompt = tokenizer.encode_chat([{"role": "user", "content": QUESTION}])
    model = load_model(smollm2, "float32")
    lora = LoraConfig(max_loras=1, max_rank=8, targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    cache, batching = CacheConfig(block_size=16, num_blocks=64), SchedulerConfig()
    engine = Engine(model, tokenizer, cache, batching, tokenizer.eos_token_ids, lora=lora)
    engine.load_adapter(read_adapter(SHIPPED, model.arch, max_rank=8, targets=lora.targets, name="shout"))
    requests = {
        name or "base": (prompt, SamplingParams(max_tokens=NEW, temperature=0.0, adapter=name))
        for name in ("", "shout")
    }
    streamed, _ = drive(engine, requests)  # each up to its end of turn (the adapter's answer is short)
    reference = peft.PeftModel.from_pretrained(hf, SHIPPED, adapter_name="shout").eval()
    for name in ("shout", None):
        with through(reference, name):
            out = reference.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False)[0, len(prompt) :]
        assert streamed[name or "base"] == out.tolist(), name
    shouted, plain = tokenizer.decode(streamed["shout"]), tokenizer.decode(streamed["base"])
    letters = [c for c in shouted if c.isalpha()]
    assert sum(c.isupper() for c in letters) >= 0.8 * len(letters), shouted
    assert sum(c.islower() for c in plain if c.isalpha()) > sum(c.isupper() for c in plain), plain
