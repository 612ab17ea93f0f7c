"""A flat batch mixing prefill, chunked prefill and decode gives each sequence what it gets alone."""

from __future__ import annotations

import random

import pytest
import torch

from cluster.generate import generate
from cluster.model.attention import SeqChunk, allocate_kv_cache, as_decode_rows, build_attention_metadata
from cluster.model.loader import load_model

BLOCK = 8
# (tokens already in the KV cache, tokens computed in the mixed pass)
SHAPES = [(0, 9), (20, 1), (17, 12), (5, 1), (0, 1), (31, 3)]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


class Paged:
    """A KV cache and scattered block tables for a set of sequences (deliberately non-contiguous)."""

    def __init__(self, model, lengths: list[int], seed: int = 0) -> None:
        self.model = model
        needed = [-(-n // BLOCK) for n in lengths]
        ids = list(range(sum(needed) + 3))
        random.Random(seed).shuffle(ids)
        self.tables = [[ids.pop() for _ in range(n)] for n in needed]
        arch = model.arch
        self.kv = allocate_kv_cache(
            arch.num_layers, sum(needed) + 3, BLOCK, arch.num_kv_heads, arch.head_dim, torch.float32
        )

    @torch.inference_mode()
    def run(
        self, seqs: list[int], tokens: list[list[int]], starts: list[int], as_rows: bool = False
    ) -> list[torch.Tensor]:
        """One forward pass; sequence seqs[i] computes tokens[i] from position starts[i]. Logits per
        sequence. `as_rows`: every new token as a decode row of its sequence."""
        chunks = [SeqChunk(self.tables[s], start, len(t)) for s, start, t in zip(seqs, starts, tokens, strict=True)]
        if as_rows:
            chunks = as_decode_rows(chunks)
        meta = build_attention_metadata(chunks, BLOCK, self.model.windows)
        ids = torch.tensor([t for ts in tokens for t in ts])
        logits = self.model.compute_logits(self.model(ids, meta.positions, self.kv, meta))
        return list(logits.split([len(t) for t in tokens]))


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_mixed_batch_equals_each_sequence_alone(hf_models, name):
    model = load_model(hf_models[name][0], "float32")
    rng = torch.Generator().manual_seed(7)
    seqs = [torch.randint(3, 320, (c + n,), generator=rng).tolist() for c, n in SHAPES]

    alone = []
    for s, (cached, _) in zip(seqs, SHAPES, strict=True):
        paged = Paged(model, [len(s)])
        if cached:
            paged.run([0], [s[:cached]], [0])
        alone.append(paged.run([0], [s[cached:]], [cached])[0])

    paged = Paged(model, [len(s) for s in seqs], seed=1)
    warm = [i for i, (c, _) in enumerate(SHAPES) if c]
    paged.run(warm, [seqs[i][: SHAPES[i][0]] for i in warm], [0] * len(warm))
    mixed = paged.run(
        list(range(len(seqs))), [s[c:] for s, (c, _) in zip(seqs, SHAPES, strict=True)], [c for c, _ in SHAPES]
    )

    for i, (a, b) in enumerate(zip(alone, mixed, strict=True)):
        assert a.shape == b.shape
        assert rel_err(b, a) <= 1e-5, f"sequence {i} {SHAPES[i]}"
        assert torch.equal(a.argmax(-1), b.argmax(-1)), f"sequence {i} {SHAPES[i]}"


def test_few_new_tokens_as_decode_rows_equal_the_chunked_pass(hf_models):
    """Drafts to verify run as one decode row per new token (`as_decode_rows`), through the decode
    attention path: the same logits as the same tokens computed as chunks."""
    model = load_model(hf_models["llama"][0], "float32")
    shapes = [(20, 1), (17, 5), (3, 2), (31, 4)]
    rng = torch.Generator().manual_seed(3)
    seqs = [torch.randint(3, 320, (c + n,), generator=rng).tolist() for c, n in shapes]
    results = []
    for as_rows in (False, True):
        paged = Paged(model, [len(s) for s in seqs], seed=2)
        paged.run(list(range(len(seqs))), [s[:c] for s, (c, _) in zip(seqs, shapes, strict=True)], [0] * len(seqs))
        tokens = [s[c:] for s, (c, _) in zip(seqs, shapes, strict=True)]
        results.append(paged.run(list(range(len(seqs))), tokens, [c for c, _ in shapes], as_rows=as_rows))
    chunked, rows = results
    assert len(torch.cat(rows)) == sum(n for _, n in shapes)
    for a, b in zip(chunked, rows, strict=True):
        assert rel_err(b, a) <= 1e-5
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_batched_generation_equals_single(hf_models):
    model = load_model(hf_models["qwen2"][0], "float32")
    prompts = [list(range(10, 10 + n)) for n in (3, 17, 8, 1)]
    together = generate(model, prompts, 12, block_size=BLOCK)
    for p, g in zip(prompts, together, strict=True):
        assert g.tokens == generate(model, [p], 12, block_size=BLOCK)[0].tokens


def test_eos_stops_only_that_sequence(hf_models):
    model = load_model(hf_models["llama"][0], "float32")
    prompts = [[5, 6, 7], [40, 41, 42, 43]]
    free = generate(model, prompts, 10)
    eos = free[0].tokens[3]
    stopped = generate(model, prompts, 10, eos_token_ids=[eos])
    assert stopped[0].tokens == free[0].tokens[: free[0].tokens.index(eos) + 1]
    assert stopped[0].finish_reason == "stop"
    expected = free[1].tokens[: free[1].tokens.index(eos) + 1] if eos in free[1].tokens else free[1].tokens
    assert stopped[1].tokens == expected


def test_metadata_rejects_short_block_table():
    with pytest.raises(ValueError, match="needs 2 blocks"):
        build_attention_metadata([SeqChunk([0], 7, 2)], BLOCK)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_reductions_equal_the_sdpa_path(dtype):
    """The compiled-decode attention (plain reductions over the paged cache, used where the CPU
    kernel cannot be built) equals the gather-then-SDPA path."""
    from cluster.model.attention import _attend_padded, _decode_attention, _write_kv

    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, hd, blocks = 6, 2, 16, 12
    k_cache = torch.randn(blocks, BLOCK, kv_heads, hd, generator=gen).to(dtype)
    v_cache = torch.randn(blocks, BLOCK, kv_heads, hd, generator=gen).to(dtype)
    chunks = [SeqChunk([3, 7, 1], 17, 1), SeqChunk([0], 2, 1), SeqChunk([5, 2], 8, 1)]
    meta = build_attention_metadata(chunks, BLOCK, frozenset({None, 5}))
    q = torch.randn(3, heads, hd, generator=gen).to(dtype)
    k = torch.randn(3, kv_heads, hd, generator=gen).to(dtype)
    v = torch.randn(3, kv_heads, hd, generator=gen).to(dtype)
    for window in (None, 5):
        kv = (k_cache.clone(), v_cache.clone())
        _write_kv(k, v, kv[0], kv[1], meta.slot_mapping)
        (group,) = meta.groups
        expected = _attend_padded(q, kv[0], kv[1], group.block_tables, group.query_index, group.masks[window], 1, 0.25)
        got = _decode_attention(q, kv[0], kv[1], group.block_tables, group.masks[window], 0.25)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert rel_err(got.float(), expected.float()) <= tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_whole_prompts_take_the_causal_path_and_equal_the_masked_one(dtype):
    """A group of chunks that all start at position 0 attends with SDPA's own causal rule; the
    result equals the general masked path, prompts of different lengths padded alike. A group with
    a chunk that does not start at 0 is not causal."""
    from cluster.model.attention import _attend_padded

    gen = torch.Generator().manual_seed(4)
    heads, kv_heads, hd = 6, 2, 16
    k_cache = torch.randn(20, BLOCK, kv_heads, hd, generator=gen).to(dtype)
    v_cache = torch.randn(20, BLOCK, kv_heads, hd, generator=gen).to(dtype)
    chunks = [SeqChunk([4, 9, 1], 0, 19), SeqChunk([7], 0, 5), SeqChunk([2, 11], 0, 12)]  # whole prompts
    (group,) = build_attention_metadata(chunks, BLOCK).groups
    assert group.causal
    q = torch.randn(36, heads, hd, generator=gen).to(dtype)
    args = (q, k_cache, v_cache, group.block_tables, group.query_index, group.masks[None], group.max_new, 0.25)
    causal, masked = _attend_padded(*args, causal=True), _attend_padded(*args, causal=False)
    assert rel_err(causal.float(), masked.float()) <= (1e-5 if dtype == torch.float32 else 2e-2)
    later = build_attention_metadata([*chunks[:2], SeqChunk([2, 11], 3, 9)], BLOCK)
    assert not later.groups[0].causal
