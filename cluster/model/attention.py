"""Paged attention over a flat batch of tokens from many sequences.

A forward pass takes `T` tokens from `S` sequences: each sequence contributes a half-open range
`[num_cached, num_cached + num_new)` of its positions — a whole prompt, a prompt chunk, or one decode
token — and owns a block table into the paged KV cache. The KV cache holds, per layer, key and value
tensors shaped `[num_blocks, block_size, num_kv_heads, head_dim]` (the one layout shared by the model,
the block manager and the wire).

Each layer writes its new keys and values into their slots, then, per attention group (decode rows
apart from prompt chunks), attends. On CPU, decode rows go through `tandem_cpu::decode_attention`
(`cluster/model/cpu_kernels.py`), which reads each cached row in place through the block table, and
prompt chunks through `tandem_cpu::prefill_attention`, which runs each sequence at its own length.
Elsewhere (another device, no kernels, training) the group gathers each sequence's blocks and runs
one `scaled_dot_product_attention` over the padded `[S, heads, max_new, max_ctx]` problem: with
SDPA's own causal rule when every chunk is a whole prompt (starts at position 0) and no sliding
window applies, else with a mask. The metadata (slots, gather indices, masks) is built once per forward
pass, not per layer, and no Python loop runs over sequences inside a layer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cluster.model import cpu_kernels, hugepages

KVCache = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (key, value) [blocks, block_size, kv_heads, head_dim]

# An int8 KV cache stores each (token, head) row as head_dim int8 values followed by the row's
# float32 scale (max-abs / 127), four bytes, in one uint8 tensor [blocks, block_size, kv_heads,
# head_dim + 4]: the paged layout, the block copies and every KV transport move rows as they are.
KV_DTYPES = ("auto", "int8", "float16", "bfloat16")
KV_SCALE_BYTES = 4
# A 16-bit cache under a float32 model (what `dtype: auto` serves on a CPU without native bfloat16)
# halves the bytes a decode step reads from it, as llama.cpp's default float16 cache does: keys and
# values are rounded as they are written and widened as they are read.
HALF_KV = {"float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class SeqChunk:
    """One sequence's share of a forward pass."""

    block_table: Sequence[int]  # blocks holding positions [0, num_cached + num_new)
    num_cached: int  # positions already in the KV cache
    num_new: int  # positions computed in this pass


@dataclass(frozen=True)
class AttentionGroup:
    """Sequences attended together, padded to the group's longest chunk. Decode rows (one new token)
    and prompt chunks form separate groups, so one long chunk never pads every decode row to its length."""

    token_index: torch.Tensor | None  # [T_g] this group's tokens among the pass's T; None = all, in order
    block_tables: torch.Tensor  # [S_g, max_blocks] padded with block 0
    query_index: torch.Tensor  # [T_g] row of each token in the padded [S_g * max_new] query layout
    max_new: int
    masks: dict[int | None, torch.Tensor]  # sliding window -> [S_g, 1, max_new, max_ctx] bool, True = attend
    causal: bool = False  # every chunk starts at position 0 (whole prompts): plain causal attention
    num_new: tuple[int, ...] = ()  # per sequence: tokens computed in this pass
    num_cached: tuple[int, ...] = ()  # per sequence: positions already in the cache


@dataclass(frozen=True)
class AttentionMetadata:
    positions: torch.Tensor  # [T] position of each token in its sequence
    slot_mapping: torch.Tensor  # [T] flat cache slot (block * block_size + offset) for each new token
    groups: tuple[AttentionGroup, ...]
    last_token_index: torch.Tensor  # [S] index in [0, T) of each sequence's last token


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    kv_dtype: str = "auto",
    shared: bool = False,
) -> KVCache:
    """Zeroed key and value tensors per layer, in `dtype`, in a 16-bit `kv_dtype` (a float32 model's, or
    its own), or ("int8") quantised rows with their scales. `shared` (CPU only): in shared memory, for
    another process to write into (see `shared_zeros`)."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, not {kv_dtype!r}")
    if kv_dtype in HALF_KV:
        if dtype not in (torch.float32, HALF_KV[kv_dtype]):
            raise ValueError(f"kv_dtype {kv_dtype} holds a float32 or {kv_dtype} model's KV, not a {dtype} one's")
        dtype = HALF_KV[kv_dtype]
    if kv_dtype == "int8":
        dtype, head_dim = torch.uint8, head_dim + KV_SCALE_BYTES
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if torch.device(device).type == "cpu":
        zeros = shared_zeros if shared else private_zeros
        return [(zeros(shape, dtype), zeros(shape, dtype)) for _ in range(num_layers)]
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(num_layers)
    ]


def shared_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor in shared memory, its pages the system's zeros until written: a pool of
    gigabytes costs nothing to make (zeroing it, then copying it into shared memory with
    `share_memory_`, took seconds a gigabyte)."""
    numel = math.prod(shape)
    storage = torch.UntypedStorage._new_shared(numel * torch.empty((), dtype=dtype).element_size())
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape)


def private_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor in an anonymous mapping of its own (on huge pages where the kernel has
    them), its pages the system's zeros until written: `torch.zeros` writes every page first, 2.4 s
    for a 2 GiB pool on the start of a prefill worker."""
    return hugepages.empty(math.prod(shape) * dtype.itemsize).view(dtype).view(shape)


def as_decode_rows(chunks: Sequence[SeqChunk]) -> list[SeqChunk]:
    """Each chunk's new tokens as one-token chunks of the same sequence, in order: the same
    positions and slots, and each token attends to the positions up to its own. A pass writes every
    new key and value before any token attends, so a sequence's few new tokens (a draft to verify,
    a draft model catching up) can run as decode rows, through the decode kernels and graphs."""
    return [SeqChunk(c.block_table, c.num_cached + j, 1) for c in chunks for j in range(c.num_new)]


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
    positions, slots, last, starts = [], [], [], []
    for s, c in enumerate(chunks):
        if c.num_new <= 0:
            raise ValueError(f"sequence {s} contributes no tokens")
        end = c.num_cached + c.num_new
        needed = -(-end // block_size)
        if len(c.block_table) < needed:
            raise ValueError(f"sequence {s} needs {needed} blocks for {end} positions, has {len(c.block_table)}")
        starts.append(len(positions))
        positions.extend(range(c.num_cached, end))
        slots.extend(c.block_table[p // block_size] * block_size + p % block_size for p in range(c.num_cached, end))
        last.append(len(positions) - 1)
    decode = [s for s, c in enumerate(chunks) if c.num_new == 1]
    prefill = [s for s, c in enumerate(chunks) if c.num_new > 1]
    split = [decode, prefill] if decode and prefill else [list(range(len(chunks)))]
    groups = []
    for members in split:
        token_index = None
        if len(split) > 1:
            ids = [starts[s] + i for s in members for i in range(chunks[s].num_new)]
            token_index = torch.tensor(ids, dtype=torch.long, device=device)
        groups.append(_group([chunks[s] for s in members], token_index, block_size, windows, device, min_blocks))
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
    return AttentionMetadata(as_long(positions), as_long(slots), tuple(groups), as_long(last))


def _group(
    chunks: Sequence[SeqChunk],
    token_index: torch.Tensor | None,
    block_size: int,
    windows: set[int | None] | frozenset[int | None],
    device: torch.device | str,
    min_blocks: int,
) -> AttentionGroup:
    max_new = max(c.num_new for c in chunks)
    max_ctx = max(c.num_cached + c.num_new for c in chunks)
    max_blocks = max(-(-max_ctx // block_size), min_blocks)
    table_rows, position_rows, query_index = [], [], []  # padded with block 0 and position 0
    for s, c in enumerate(chunks):
        needed = -(-(c.num_cached + c.num_new) // block_size)
        table_rows.append([*c.block_table[:needed], *[0] * (max_blocks - needed)])
        position_rows.append([*range(c.num_cached, c.num_cached + c.num_new), *[0] * (max_new - c.num_new)])
        query_index.extend(range(s * max_new, s * max_new + c.num_new))
    tables = torch.tensor(table_rows, dtype=torch.long)
    q_pos = torch.tensor(position_rows, dtype=torch.long)  # padded rows look at position 0 only
    k_pos = torch.arange(max_blocks * block_size)
    causal = k_pos[None, None, :] <= q_pos[:, :, None]  # [S, max_new, ctx]
    masks = {}
    for w in windows:
        m = causal if w is None else causal & (q_pos[:, :, None] - k_pos[None, None, :] < w)
        masks[w] = m.unsqueeze(1).to(device)
    index = torch.tensor(query_index, dtype=torch.long, device=device)
    causal = max_new > 1 and all(c.num_cached == 0 for c in chunks)
    num_new, num_cached = tuple(c.num_new for c in chunks), tuple(c.num_cached for c in chunks)
    return AttentionGroup(token_index, tables.to(device), index, max_new, masks, causal, num_new, num_cached)


def kv_row_bytes(head_dim: int, dtype_bytes: int, kv_dtype: str) -> int:
    """Bytes of one (token, head) row of keys (or values) in the cache."""
    if kv_dtype in HALF_KV:
        return head_dim * HALF_KV[kv_dtype].itemsize
    return head_dim + KV_SCALE_BYTES if kv_dtype == "int8" else head_dim * dtype_bytes


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., head_dim] floats -> [..., head_dim + 4] uint8 rows: int8 values, then the float32 scale."""
    x = x.float()
    scale = (x.abs().amax(dim=-1, keepdim=True) / 127).clamp(min=1e-8)
    q = torch.round(x / scale).clamp(-127, 127).to(torch.int8)
    return torch.cat([q.view(torch.uint8), scale.view(torch.uint8)], dim=-1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of `quantize_rows`, in `dtype` (rows may be any gather of the cache)."""
    head_dim = rows.shape[-1] - KV_SCALE_BYTES
    values = rows[..., :head_dim].view(torch.int8)
    scale = rows[..., head_dim:].contiguous().view(torch.float32)
    return (values.float() * scale).to(dtype)


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Each sequence's blocks, [S, max_blocks * block_size, kv_heads, head_dim], in `dtype`: an int8
    cache is dequantised as it is read (only the blocks the sequences use), a 16-bit one widened."""
    num_seqs, max_blocks = block_tables.shape
    gathered = cache[block_tables]  # [S, max_blocks, block_size, kv_heads, row]
    if cache.dtype == torch.uint8:
        gathered = dequantize_rows(gathered, dtype)
    elif cache.dtype != dtype:
        gathered = gathered.to(dtype)
    return gathered.view(num_seqs, max_blocks * cache.shape[1], cache.shape[2], -1)


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
    training = q.requires_grad  # the demo models' training: plain functions, differentiated by autograd
    if k_cache.dtype == torch.uint8:  # an int8 cache: quantised rows with their scales
        k, v = quantize_rows(k), quantize_rows(v)
    elif k_cache.dtype != k.dtype:  # a 16-bit cache under a float32 model
        k, v = k.to(k_cache.dtype), v.to(k_cache.dtype)
    # Two in-place copies, eager and compiled alike (inlined into a compiled graph): a custom op
    # around them cost 140 us a layer in eager decode steps (its Python wrapper), the copies 20.
    _write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    if len(meta.groups) == 1:
        return _attend(q, k_cache, v_cache, meta.groups[0], scale, window, training)
    out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
    for g in meta.groups:
        assert g.token_index is not None
        out.index_copy_(0, g.token_index, _attend(q[g.token_index], k_cache, v_cache, g, scale, window, training))
    return out


def _attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    g: AttentionGroup,
    scale: float,
    window: int | None,
    training: bool,
) -> torch.Tensor:
    if not training and q.device.type == "cpu" and cpu_kernels.used():
        if g.max_new == 1:
            return torch.ops.tandem_cpu.decode_attention(q, k_cache, v_cache, g.block_tables, g.masks[window], scale)
        return torch.ops.tandem_cpu.prefill_attention(
            q, k_cache, v_cache, g.block_tables, g.num_new, g.num_cached, scale, window, cpu_kernels.torch_flash()
        )
    if g.max_new == 1 and torch.compiler.is_compiling():
        # Compiled decode: attention as plain reductions that the compiler fuses with the
        # block-table gather, so each cached key is read once, in place.
        return _decode_attention(q, k_cache, v_cache, g.block_tables, g.masks[window], scale)
    attend = _attend_padded if training else torch.ops.tandem.attend
    causal = g.causal and window is None
    return attend(q, k_cache, v_cache, g.block_tables, g.query_index, g.masks[window], g.max_new, scale, causal)


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
    # Fused gather (and dequantisation, for an int8 cache) under compile.
    keys = _gather(k_cache, block_tables, q.dtype).view(num_seqs, ctx, kv_heads, 1, head_dim)
    values = _gather(v_cache, block_tables, q.dtype).view(num_seqs, ctx, kv_heads, 1, head_dim)
    qg = q.view(num_seqs, 1, kv_heads, groups, head_dim).float()
    scores = (qg * keys.float()).sum(-1) * scale  # [S, ctx, kv, g]
    scores = scores.masked_fill(~mask.view(num_seqs, ctx, 1, 1), float("-inf"))
    probs = torch.softmax(scores, dim=1)
    out = (probs.unsqueeze(-1) * values.float()).sum(1)  # [S, kv, g, hd]
    return out.to(q.dtype).reshape(num_seqs, heads * head_dim)


def _write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    _, _, kv_heads, head_dim = k_cache.shape
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def _attend_padded(
    q: torch.Tensor,  # [T, heads, hd]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks]
    query_index: torch.Tensor,  # [T]
    mask: torch.Tensor,  # [S, 1, max_new, ctx]
    max_new: int,
    scale: float,
    causal: bool = False,  # every sequence's chunk starts at position 0: `mask` is plain causal
) -> torch.Tensor:  # [T, heads * hd]
    num_seqs = block_tables.shape[0]
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[2]
    # Gather each sequence's blocks: [S, max_blocks, block_size, kv_heads, hd] -> [S, kv_heads, ctx, hd]
    keys = _gather(k_cache, block_tables, q.dtype).transpose(1, 2)
    values = _gather(v_cache, block_tables, q.dtype).transpose(1, 2)

    groups = heads // kv_heads
    if max_new == 1:  # decode: one query per sequence, already in order
        padded = q.view(num_seqs, 1, heads, head_dim)
    else:  # scatter the flat queries into [S, max_new, heads, hd]
        padded = q.new_zeros(num_seqs * max_new, heads, head_dim)
        padded.index_copy_(0, query_index, q)
        padded = padded.view(num_seqs, max_new, heads, head_dim)
    if causal:
        # Whole prompts: SDPA's own causal rule (query i sees keys 0..i) over the first max_new
        # positions, which lets its kernel skip the masked half instead of reading a mask. A shorter
        # sequence's padded keys lie beyond its own queries, so they are never seen.
        out = F.scaled_dot_product_attention(
            padded.transpose(1, 2), keys[:, :, :max_new], values[:, :, :max_new], is_causal=True, scale=scale,
            enable_gqa=True,
        )  # fmt: skip
        return out.transpose(1, 2).reshape(num_seqs * max_new, heads * head_dim).index_select(0, query_index)
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


# A custom op, so that torch.compile treats padded attention (whose shapes vary with context length)
# as an opaque call and compiles around it.
_attend_op = torch.library.custom_op("tandem::attend", mutates_args=())(_attend_padded)


@_attend_op.register_fake
def _(q, k_cache, v_cache, block_tables, query_index, mask, max_new, scale, causal=False):  # type: ignore[no-untyped-def]
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
