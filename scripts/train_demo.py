"""Trains Tandem's bundled demo models on the Python standard library's own source.

    python scripts/train_demo.py train --size demo  --out models/tandem-demo-code
    python scripts/train_demo.py train --size draft --out models/tandem-demo-code-draft \
        --tokenizer-from models/tandem-demo-code
    python scripts/train_demo.py eval models/tandem-demo-code

The corpus is every `.py` file of the running interpreter's standard library (outside `test/`,
`tests/`, `idlelib/` and `site-packages/`), in sorted path order. One file in twenty, chosen by a hash
of its relative path, is held out. The tokenizer is a 4096-token byte-level BPE trained on the
training files only. Training runs Tandem's own `CausalLM` forward pass (over its paged KV cache)
in float32 on the CPU with fixed seeds and a fixed step count, then writes bfloat16 weights and a
`training.json` with the losses. `eval` recomputes the held-out loss from the text the training run
saved beside the weights (`heldout_eval.txt`), so it needs nothing but the model folder.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from cluster.model.arch import ModelArch
from cluster.model.attention import SeqChunk, allocate_kv_cache, build_attention_metadata
from cluster.model.builder import Preset, hf_config, save_weights, train_tokenizer, write_tokenizer
from cluster.model.causal_lm import CausalLM
from cluster.model.loader import export_weights, load_model
from cluster.model.tokenizer import Tokenizer

EOT = 0  # <|endoftext|> separates files in the token stream
SEQ_LEN = 256
EVAL_WINDOWS = 96  # held-out loss over the first 96 x 256 tokens of the held-out stream
TOKENIZER_VOCAB = 4096


@dataclass(frozen=True)
class Recipe:
    preset: Preset
    steps: int
    batch: int
    lr: float
    warmup: int = 100
    weight_decay: float = 0.1
    seed: int = 0


RECIPES = {
    "demo": Recipe(
        Preset(256, 768, 6, 4, 2, vocab_size=TOKENIZER_VOCAB, max_position_embeddings=1024, tokenizer_vocab=4096),
        steps=1500,
        batch=16,
        lr=2e-3,
    ),
    "draft": Recipe(
        Preset(128, 384, 2, 2, 1, vocab_size=TOKENIZER_VOCAB, max_position_embeddings=1024, tokenizer_vocab=4096),
        steps=800,
        batch=16,
        lr=3e-3,
    ),
}


def corpus_files() -> tuple[Path, list[Path], list[Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "site-packages"}
    files = [p for p in sorted(root.rglob("*.py")) if not skip & set(p.relative_to(root).parts)]
    held = [p for p in files if int(hashlib.sha1(str(p.relative_to(root)).encode()).hexdigest(), 16) % 20 == 0]
    held_set = set(held)
    return root, [p for p in files if p not in held_set], held


def read(paths: list[Path]) -> list[str]:
    texts = []
    for p in paths:
        try:
            texts.append(p.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return texts


def token_stream(tok: Tokenizer, texts: list[str]) -> torch.Tensor:
    ids: list[int] = []
    for text in texts:
        ids.extend(tok.encode(text))
        ids.append(EOT)
    return torch.tensor(ids, dtype=torch.long)


def batch_loss(model: CausalLM, windows: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss over [B, L + 1] windows, through the paged forward pass."""
    b, length = windows.shape[0], windows.shape[1] - 1
    bs = 16
    blocks = length // bs
    arch = model.arch
    kv = allocate_kv_cache(arch.num_layers, b * blocks, bs, arch.num_kv_heads, arch.head_dim, torch.float32)
    chunks = [SeqChunk(range(i * blocks, (i + 1) * blocks), 0, length) for i in range(b)]
    meta = build_attention_metadata(chunks, bs, model.windows)
    hidden = model(windows[:, :-1].reshape(-1), meta.positions, kv, meta)
    return F.cross_entropy(model.compute_logits(hidden), windows[:, 1:].reshape(-1))


def heldout_windows(folder: Path, tok: Tokenizer) -> torch.Tensor:
    """The held-out evaluation windows, from the text saved beside the weights."""
    text = (folder / "heldout_eval.txt").read_text(encoding="utf-8")
    return eval_windows(torch.tensor(tok.encode(text), dtype=torch.long))


def eval_windows(stream: torch.Tensor) -> torch.Tensor:
    n = min(EVAL_WINDOWS, (len(stream) - 1) // SEQ_LEN)
    return torch.stack([stream[i * SEQ_LEN : i * SEQ_LEN + SEQ_LEN + 1] for i in range(n)])


@torch.inference_mode()
def evaluate(model: CausalLM, windows: torch.Tensor) -> float:
    return sum(batch_loss(model, w).item() * len(w) for w in windows.split(16)) / len(windows)


def init_weights(model: CausalLM, std: float, num_layers: int) -> None:
    for name, p in model.named_parameters():
        if "norm" in name:
            torch.nn.init.ones_(p)
        elif p.ndim == 1:
            torch.nn.init.zeros_(p)
        else:
            # Residual-branch outputs scaled down by depth (GPT-2 style) so early steps stay stable.
            scale = 1 / math.sqrt(2 * num_layers) if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
            torch.nn.init.normal_(p, std=std * scale)


def optimise(model: CausalLM, stream: torch.Tensor, recipe: Recipe, steps: int) -> list[float]:
    """AdamW with warm-up and cosine decay on random windows of `stream`; returns each step's loss."""
    decay = [p for p in model.parameters() if p.ndim == 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": recipe.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=recipe.lr,
        betas=(0.9, 0.95),
    )
    gen = torch.Generator().manual_seed(recipe.seed)
    losses: list[float] = []
    t0 = time.time()
    for step in range(steps):
        lr = recipe.lr * min(1.0, (step + 1) / recipe.warmup) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(stream) - SEQ_LEN - 1, (recipe.batch,), generator=gen)
        windows = torch.stack([stream[s : s + SEQ_LEN + 1] for s in starts.tolist()])
        loss = batch_loss(model, windows)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 25 == 0 or step == steps - 1:
            done = time.time() - t0
            eta = done / (step + 1) * (steps - step - 1)
            recent = sum(losses[-25:]) / len(losses[-25:])
            print(
                f"step {step + 1}/{steps}  loss {recent:.3f}  lr {lr:.2e}  {done:.0f}s elapsed, ETA {eta / 60:.1f} min",
                flush=True,
            )
    return losses


def train(args: argparse.Namespace) -> None:
    recipe = RECIPES[args.size]
    steps = args.steps or recipe.steps
    torch.manual_seed(recipe.seed)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    root, train_files, held_files = corpus_files()
    train_texts, held_texts = read(train_files), read(held_files)
    if args.tokenizer_from:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (out / name).write_bytes((Path(args.tokenizer_from) / name).read_bytes())
    else:
        write_tokenizer(train_tokenizer(TOKENIZER_VOCAB, iter(train_texts)), out, recipe.preset.max_position_embeddings)
    config = hf_config(recipe.preset, "LlamaForCausalLM", "bfloat16")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": config["eos_token_id"]}, indent=2))
    tok = Tokenizer(out)
    train_stream, held_stream = token_stream(tok, train_texts), token_stream(tok, held_texts)
    held_text = tok.decode(held_stream[: EVAL_WINDOWS * SEQ_LEN + 1].tolist(), skip_special_tokens=False)
    (out / "heldout_eval.txt").write_text(held_text, encoding="utf-8")
    held_eval = heldout_windows(out, tok)
    print(
        f"corpus: {len(train_files)} training files ({len(train_stream):,} tokens), "
        f"{len(held_files)} held out ({len(held_stream):,} tokens); tokenizer {tok.vocab_size}",
        flush=True,
    )

    model = CausalLM(ModelArch.from_hf_config(config))
    init_weights(model, 0.02, recipe.preset.num_layers)
    n_params = sum(p.numel() for p in model.parameters())
    t0 = time.time()
    losses = optimise(model, train_stream, recipe, steps)
    train_time = time.time() - t0

    save_weights({k: v.to(torch.bfloat16) for k, v in export_weights(model).items()}, out)
    shipped = load_model(out, "float32")  # the bf16 weights as shipped, evaluated in float32
    train_eval = eval_windows(train_stream[: len(held_stream)])
    record = {
        "python": platform.python_version(),
        "stdlib": str(root),
        "train_files": len(train_files),
        "heldout_files": [str(p.relative_to(root)) for p in held_files],
        "train_tokens": len(train_stream),
        "tokens_seen": steps * recipe.batch * SEQ_LEN,
        "params": n_params,
        "recipe": {**asdict(recipe), "steps": steps, "preset": asdict(recipe.preset)},
        "threads": args.threads,
        "train_seconds": round(train_time),
        "total_seconds": round(time.time() - started),
        "final_train_loss_ema": round(sum(losses[-50:]) / len(losses[-50:]), 4),
        "train_loss": round(evaluate(shipped, train_eval), 4),
        "heldout_loss": round(evaluate(shipped, held_eval), 4),
        "heldout_tokens": int(held_eval[:, 1:].numel()),
        "uniform_loss": round(math.log(tok.vocab_size), 4),
    }
    (out / "training.json").write_text(json.dumps(record, indent=2))
    print(json.dumps({k: v for k, v in record.items() if k != "heldout_files"}, indent=2))


def eval_cmd(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    folder = Path(args.model)
    tok = Tokenizer(folder)
    loss = evaluate(load_model(folder, "float32"), heldout_windows(folder, tok))
    print(json.dumps({"heldout_loss": round(loss, 4), "uniform_loss": round(math.log(tok.vocab_size), 4)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(required=True)
    t = sub.add_parser("train")
    t.add_argument("--size", choices=sorted(RECIPES), required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--tokenizer-from", help="reuse this folder's tokenizer instead of training one")
    t.add_argument("--steps", type=int, help="override the recipe's step count (for quick trials)")
    t.add_argument("--threads", type=int, default=2)
    t.set_defaults(run=train)
    e = sub.add_parser("eval")
    e.add_argument("model")
    e.add_argument("--threads", type=int, default=2)
    e.set_defaults(run=eval_cmd)
    args = parser.parse_args()
    args.run(args)


if __name__ == "__main__":
    sys.exit(main())
