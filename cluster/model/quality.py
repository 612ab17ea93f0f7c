"""What quantisation costs in quality: held-out loss and top-1 agreement with the unquantised model.

`score(model, windows, kv_dtype)` runs each window through the paged forward pass (the KV cache
in `kv_dtype`, so an int8 cache is written and read as in serving) and returns the mean next-token
loss and the model's top-1 prediction at every position. `agreement(a, b)` is the share of
positions where two models predict the same next token on the same text (teacher-forced: one early
disagreement does not count against every later position, as it would for free-running greedy
decoding).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from cluster.model.attention import SeqChunk, allocate_kv_cache, build_attention_metadata
from cluster.model.causal_lm import CausalLM
from cluster.model.tokenizer import Tokenizer


@dataclass(frozen=True)
class Score:
    loss: float  # mean next-token cross-entropy, nats
    predictions: torch.Tensor  # [windows, length] top-1 next token at each position


def heldout_windows(folder: Path, tok: Tokenizer, length: int = 256, count: int = 16) -> torch.Tensor:
    """[count, length + 1] token windows of the held-out text saved beside a demo model."""
    ids = tok.encode((folder / "heldout_eval.txt").read_text(encoding="utf-8"))
    count = min(count, (len(ids) - 1) // (length + 1))
    return torch.tensor([ids[i * (length + 1) : (i + 1) * (length + 1)] for i in range(count)])


def random_windows(vocab_size: int, length: int = 256, count: int = 8, seed: int = 0) -> torch.Tensor:
    """Uniform random token windows, for random-weight models (which have no text of their own)."""
    return torch.randint(0, vocab_size, (count, length + 1), generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def score(model: CausalLM, windows: torch.Tensor, kv_dtype: str = "auto", block_size: int = 16) -> Score:
    arch = model.arch
    losses, predictions = [], []
    length = windows.shape[1] - 1
    blocks = -(-length // block_size)
    for window in windows:
        kv = allocate_kv_cache(
            arch.num_layers, blocks, block_size, arch.num_kv_heads, arch.head_dim,
            model.embed_tokens.weight.dtype, model.embed_tokens.weight.device, kv_dtype,
        )  # fmt: skip
        meta = build_attention_metadata([SeqChunk(range(blocks), 0, length)], block_size, model.windows)
        hidden = model(window[:-1], meta.positions, kv, meta)
        logits = model.compute_logits(hidden)
        losses.append(F.cross_entropy(logits, window[1:]).item())
        predictions.append(logits.argmax(-1))
    return Score(sum(losses) / len(losses), torch.stack(predictions))


def agreement(a: Score, b: Score) -> float:
    return float((a.predictions == b.predictions).float().mean())
