"""Offline generation in one process: a batch of prompts, prefilled together, then decoded together.

Each sequence gets a fixed run of KV blocks sized for its prompt plus its token budget. This is
the model's reference driver (the demo command and the model tests use it); serving goes through
the decode worker's scheduler and block manager instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from cluster.model.attention import KVCache, SeqChunk, allocate_kv_cache, build_attention_metadata
from cluster.model.causal_lm import CausalLM


@dataclass
class Generation:
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    # Logits [vocab] that chose each generated token (only when asked for).
    logits: list[torch.Tensor] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" (an EOS id) or "length"


@torch.inference_mode()
def generate(
    model: CausalLM,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    eos_token_ids: Sequence[int] = (),
    temperature: float = 0.0,
    seed: int = 0,
    block_size: int = 16,
    keep_logits: bool = False,
) -> list[Generation]:
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be at least 1")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    arch = model.arch
    device = model.embed_tokens.weight.device
    lengths = [len(p) + max_new_tokens for p in prompts]
    if max(lengths) > arch.max_position_embeddings:
        raise ValueError(f"prompt + max_new_tokens exceeds the context window ({arch.max_position_embeddings})")
    tables, kv = _kv_cache(model, lengths, block_size)
    gen = torch.Generator(device=device).manual_seed(seed)
    out = [Generation(prompt=list(p)) for p in prompts]
    # First pass: every prompt whole. Later passes: one token per unfinished sequence.
    active = list(range(len(prompts)))
    chunks = [SeqChunk(tables[i], 0, len(prompts[i])) for i in active]
    input_ids = [t for p in prompts for t in p]
    while active:
        meta = build_attention_metadata(chunks, block_size, model.windows, device)
        ids = torch.tensor(input_ids, dtype=torch.long, device=device)
        hidden = model(ids, meta.positions, kv, meta)
        logits = model.compute_logits(hidden[meta.last_token_index])  # [S, vocab]
        if temperature > 0:
            probs = torch.softmax(logits / temperature, dim=-1)
            next_ids = torch.multinomial(probs, 1, generator=gen).squeeze(1).tolist()
        else:
            next_ids = logits.argmax(dim=-1).tolist()
        still, chunks, input_ids = [], [], []
        for row, (i, token) in enumerate(zip(active, next_ids, strict=True)):
            g = out[i]
            g.tokens.append(token)
            if keep_logits:
                g.logits.append(logits[row].cpu())
            if token in eos_token_ids:
                g.finish_reason = "stop"
            elif len(g.tokens) == max_new_tokens:
                g.finish_reason = "length"
            else:
                still.append(i)
                chunks.append(SeqChunk(tables[i], len(g.prompt) + len(g.tokens) - 1, 1))
                input_ids.append(token)
        active = still
    return out


def _kv_cache(model: CausalLM, lengths: Sequence[int], block_size: int) -> tuple[list[list[int]], KVCache]:
    """A block table per sequence (a fixed run of blocks for `lengths[i]` tokens) and the cache."""
    arch, weight = model.arch, model.embed_tokens.weight
    per_seq = [-(-n // block_size) for n in lengths]
    starts = [sum(per_seq[:i]) for i in range(len(lengths))]
    tables = [list(range(s, s + n)) for s, n in zip(starts, per_seq, strict=True)]
    kv = allocate_kv_cache(
        arch.num_layers, sum(per_seq), block_size, arch.num_kv_heads, arch.head_dim, weight.dtype, weight.device
    )
    return tables, kv
