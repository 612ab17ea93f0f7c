"""Paged attention over a flat batch of tokens from many sequences.

A forward pass takes `T` tokens from `S` sequences: each sequence contributes a half-open range
`[num_cached, num_cached + num_new)` of its positions — a whole prompt, a prompt chunk, or one decode
token — and owns a block table into the paged KV cache. The KV cache holds, per layer, key and value
tensors shaped `[num_blocks, block_size, num_kv_heads, head_dim]` (the one layout shared by the model,
the block manager and the wire).

Each layer writes its new keys and values into their slots, then gathers each sequence's blocks
and runs one masked `scaled_dot_product_attention` over the padded `[S, heads, max_new, max_ctx]`
problem. The metadata (slots, gather indices, masks) is built once per forward pass, not per layer,
and no Python loop runs over sequences inside a layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

KVCache = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (key, value) [blocks, block_size, kv_heads, head_dim]


@dataclass(frozen=True)
class SeqChunk:
    """One sequence's share of a forward pass."""

    block_table: Sequence[int]  # blocks holding positions [0, num_cached + num_new)
    num_cached: int  # positions already in the KV cache
    num_new: int  # positions computed in this pass


@dataclass(frozen=True)
class AttentionMetadata:
    positions: torch.Tensor  # [T] position of each token in its sequence
    slot_mapping: torch.Tensor  # [T] flat cache slot (block * block_size + offset) for each new token
    block_tables: torch.Tensor  # [S, max_blocks] padded with block 0
    query_index: torch.Tensor  # [T] row of each token in the padded [S * max_new] query layout
    max_new: int
    masks: dict[int | None, torch.Tensor]  # sliding window -> [S, 1, max_new, max_ctx] bool, True = attend
    last_token_index: torch.Tensor  # [S] index in [0, T) of each sequence's last token


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> KVCache:
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(num_layers)
    ]


def build_attention_metadata(
    chunks: Sequence[SeqChunk],
    block_size: int,
    windows: set[int | None] | frozenset[int | None] = frozenset({None}),
    device: torch.device | str = "cpu",
    min_blocks: int = 1,
) -> AttentionMetadata:
    """Builds the per-pass tensors; `windows` are the sliding windows the model's layers use.
    Block tables are padded to at least `min_blocks` columns (compiled graphs keep one shape class)."""
    if not chunks:
        raise ValueError("a forward pass needs at least one sequence")
    max_new = max(c.num_new for c in chunks)
    max_ctx = max(c.num_cached + c.num_new for c in chunks)
    max_blocks = max(-(-max_ctx // block_size), min_blocks)
    positions, slots, query_index, last = [], [], [], []
    tables = torch.zeros(len(chunks), max_blocks, dtype=torch.long)
    q_pos = torch.zeros(len(chunks), max_new, dtype=torch.long)  # padded rows look at position 0 only
    for s, c in enumerate(chunks):
        if c.num_new <= 0:
            raise ValueError(f"sequence {s} contributes no tokens")
        end = c.num_cached + c.num_new
        needed = -(-end // block_size)
        if len(c.block_table) < needed:
            raise ValueError(f"sequence {s} needs {needed} blocks for {end} positions, has {len(c.block_table)}")
        tables[s, :needed] = torch.as_tensor(list(c.block_table[:needed]), dtype=torch.long)
        pos = range(c.num_cached, end)
        positions.extend(pos)
        slots.extend(c.block_table[p // block_size] * block_size + p % block_size for p in pos)
        query_index.extend(range(s * max_new, s * max_new + c.num_new))
        q_pos[s, : c.num_new] = torch.arange(c.num_cached, end)
        last.append(len(positions) - 1)
    k_pos = torch.arange(max_blocks * block_size)
    causal = k_pos[None, None, :] <= q_pos[:, :, None]  # [S, max_new, ctx]
    masks = {}
    for w in windows:
        m = causal if w is None else causal & (q_pos[:, :, None] - k_pos[None, None, :] < w)
        masks[w] = m.unsqueeze(1).to(device)
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
    return AttentionMetadata(
        positions=as_long(positions),
        slot_mapping=as_long(slots),
        block_tables=tables.to(device),
        query_index=as_long(query_index),
        max_new=max_new,
        masks=masks,
        last_token_index=as_long(last),
    )


def paged_attention(
    q: torch.Tensor,  # [T, heads, head_dim]
    k: torch.Tensor,  # [T, kv_heads, head_dim]
    v: torch.Tensor,  # [T, kv_heads, head_dim]
    kv: tuple[torch.Tensor, torch.Tensor],
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:  # [T, heads * head_dim]
    """Writes k, v into their cache slots, then attends each query to its sequence's cached keys."""
    k_cache, v_cache = kv
    args = (q, k, v, k_cache, v_cache, meta.slot_mapping, meta.block_tables, meta.query_index,
            meta.masks[window], meta.max_new, scale)  # fmt: skip
    if q.requires_grad:  # training (the demo models): the same math, differentiated by autograd
        return _paged_attention(*args)
    if meta.max_new == 1 and torch.compiler.is_compiling():
        # Compiled decode: write through an opaque op, then attention as plain reductions that the
        # compiler fuses with the block-table gather, so each cached key is read once, in place.
        torch.ops.tandem.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return _decode_attention(q, k_cache, v_cache, meta.block_tables, meta.masks[window], scale)
    return torch.ops.tandem.paged_attention(*args)


def _decode_attention(
    q: torch.Tensor,  # [S, heads, hd]: one query per sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks]
    mask: torch.Tensor,  # [S, 1, 1, ctx]
    scale: float,
) -> torch.Tensor:  # [S, heads * hd]
    num_seqs, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    groups = heads // kv_heads
    ctx = block_tables.shape[1] * block_size
    keys = k_cache[block_tables].view(num_seqs, ctx, kv_heads, 1, head_dim)  # fused gather under compile
    values = v_cache[block_tables].view(num_seqs, ctx, kv_heads, 1, head_dim)
    qg = q.view(num_seqs, 1, kv_heads, groups, head_dim).float()
    scores = (qg * keys.float()).sum(-1) * scale  # [S, ctx, kv, g]
    scores = scores.masked_fill(~mask.view(num_seqs, ctx, 1, 1), float("-inf"))
    probs = torch.softmax(scores, dim=1)
    out = (probs.unsqueeze(-1) * values.float()).sum(1)  # [S, kv, g, hd]
    return out.to(q.dtype).reshape(num_seqs, heads * head_dim)


def _paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    query_index: torch.Tensor,
    mask: torch.Tensor,
    max_new: int,
    scale: float,
) -> torch.Tensor:
    _, block_size, kv_heads, head_dim = k_cache.shape
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v)

    num_seqs, max_blocks = block_tables.shape
    ctx = max_blocks * block_size
    # Gather each sequence's blocks: [S, max_blocks, block_size, kv_heads, hd] -> [S, kv_heads, ctx, hd]
    keys = k_cache[block_tables].view(num_seqs, ctx, kv_heads, head_dim).transpose(1, 2)
    values = v_cache[block_tables].view(num_seqs, ctx, kv_heads, head_dim).transpose(1, 2)

    heads = q.shape[1]
    groups = heads // kv_heads
    if max_new == 1:  # decode: one query per sequence, already in order
        padded = q.view(num_seqs, 1, heads, head_dim)
    else:  # scatter the flat queries into [S, max_new, heads, hd]
        padded = q.new_zeros(num_seqs * max_new, heads, head_dim)
        padded.index_copy_(0, query_index, q)
        padded = padded.view(num_seqs, max_new, heads, head_dim)
    # Grouped-query attention without repeating keys: the query heads sharing a KV head (heads are
    # KV-head-major) become extra query rows of that head. [S, new, kv, g, hd] -> [S, kv, g * new, hd]
    grouped = padded.view(num_seqs, max_new, kv_heads, groups, head_dim).permute(0, 2, 3, 1, 4)
    grouped = grouped.reshape(num_seqs, kv_heads, groups * max_new, head_dim)
    mask = mask.unsqueeze(2).expand(-1, -1, groups, -1, -1).reshape(num_seqs, 1, groups * max_new, -1)
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=scale)
    # [S, kv, g * new, hd] -> [S, new, kv, g, hd] -> [S * new, heads * hd] -> [T, heads * hd]
    out = out.view(num_seqs, kv_heads, groups, max_new, head_dim).permute(0, 3, 1, 2, 4)
    out = out.reshape(num_seqs * max_new, heads * head_dim)
    return out if max_new == 1 else out.index_select(0, query_index)


# A custom op, so that torch.compile treats attention (which mutates the cache in place and whose
# shapes vary with context length) as one opaque call and compiles everything around it.
_paged_attention_op = torch.library.custom_op("tandem::paged_attention", mutates_args=("k_cache", "v_cache"))(
    _paged_attention
)


@_paged_attention_op.register_fake
def _(q, k, v, k_cache, v_cache, slot_mapping, block_tables, query_index, mask, max_new, scale):  # type: ignore[no-untyped-def]
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


@torch.library.custom_op("tandem::write_kv", mutates_args=("k_cache", "v_cache"))
def _write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    _, _, kv_heads, head_dim = k_cache.shape
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v)


@_write_kv.register_fake
def _(k, v, k_cache, v_cache, slot_mapping):  # type: ignore[no-untyped-def]
    return None
