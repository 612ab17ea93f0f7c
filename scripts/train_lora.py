"""Trains the LoRA adapter shipped in `models/adapters/smollm2-shout`: SmolLM2-135M-Instruct answering in
capital letters, a behaviour anyone can see.

    .venv/bin/python scripts/train_lora.py [--model .cache/models/SmolLM2-135M-Instruct] [--out DIR]

No data set is downloaded: the targets are the base model's own greedy answers to the questions
below, upper-cased, so the adapter learns the style and keeps the content. A rank-8 adapter on the
attention projections, trained with `peft` for a few minutes on a CPU; it is saved in PEFT's format
(`adapter_config.json` + `adapter_model.safetensors`, about 2 MB). The last lines print answers to
questions it never saw, before and after.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = [
    "What is the capital of France?", "Name three colors.", "What is two plus two?",
    "Why is the sky blue?", "What do bees make?", "How many days are in a week?",
    "What is the largest planet?", "Who wrote Romeo and Juliet?", "What is water made of?",
    "Give me a tip for sleeping well.", "What is a noun?", "How do plants get energy?",
    "What is the boiling point of water?", "Name a fruit that is yellow.", "What does a CPU do?",
    "What is the opposite of hot?", "How many legs does a spider have?", "What is the speed of light?",
    "Suggest a name for a cat.", "What language is spoken in Spain?", "What is photosynthesis?",
    "Why do we need sleep?", "What is a triangle?", "Tell me a fun fact about the ocean.",
    "How do you make tea?", "What is the moon?", "What is an apple?", "Describe a rainy day.",
    "What is the tallest animal?", "Give me a word that rhymes with cat.", "What is music?",
    "How many continents are there?", "What is a computer?", "Name a famous painter.",
    "What is ice?", "Why do leaves change color?", "What is a library?", "How do birds fly?",
    "What is the sun?", "What is a good breakfast?", "Write one sentence about dogs.",
    "What is a river?", "How do you say hello in French?", "What is gravity?",
]  # fmt: skip
HELD_OUT = ["What is the capital of Italy?", "Name an animal that lives in the sea.", "What is a star?"]
ANSWER_TOKENS = 32


def chat_ids(tokenizer, question: str) -> list[int]:  # type: ignore[no-untyped-def]
    messages = [{"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def answer(model, tokenizer, question: str) -> str:  # type: ignore[no-untyped-def]
    ids = torch.tensor([chat_ids(tokenizer, question)])
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=ANSWER_TOKENS, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()


def examples(model, tokenizer) -> list[tuple[list[int], list[int]]]:  # type: ignore[no-untyped-def]
    """(prompt ids, target ids): each question's base answer, upper-cased, then the end of the turn."""
    out = []
    for question in QUESTIONS:
        target = tokenizer(answer(model, tokenizer, question).upper(), add_special_tokens=False)["input_ids"]
        out.append((chat_ids(tokenizer, question), [*target, tokenizer.eos_token_id]))
    return out


def train(model, data: list[tuple[list[int], list[int]]], steps: int, batch: int) -> None:  # type: ignore[no-untyped-def]
    """AdamW on the adapter's weights; the loss on the target tokens only."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
    rng = random.Random(0)
    model.train()
    for step in range(steps):
        chosen = rng.sample(data, batch)
        width = max(len(p) + len(t) for p, t in chosen)
        ids = torch.zeros(batch, width, dtype=torch.long)
        labels = torch.full((batch, width), -100)
        mask = torch.zeros(batch, width, dtype=torch.long)
        for row, (prompt, target) in enumerate(chosen):
            seq = prompt + target
            ids[row, : len(seq)] = torch.tensor(seq)
            labels[row, len(prompt) : len(seq)] = torch.tensor(target)
            mask[row, : len(seq)] = 1
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 20 == 0 or step == steps - 1:
            print(f"step {step:4d}  loss {loss.item():.3f}", flush=True)
    model.eval()


def main() -> None:
    import peft
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct")
    parser.add_argument("--out", type=Path, default=ROOT / "models" / "adapters" / "smollm2-shout")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    base = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    started = time.perf_counter()
    before = {q: answer(base, tokenizer, q) for q in HELD_OUT}
    data = examples(base, tokenizer)
    print(f"{len(data)} examples in {time.perf_counter() - started:.0f} s", flush=True)
    config = peft.LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]
    )
    model = peft.get_peft_model(base, config)
    train(model, data, args.steps, args.batch)
    model.save_pretrained(args.out)
    print(f"saved {args.out} after {time.perf_counter() - started:.0f} s")
    for q in HELD_OUT:
        print(f"\n{q}\n  base:    {before[q]}\n  adapter: {answer(model, tokenizer, q)}")


if __name__ == "__main__":
    main()
