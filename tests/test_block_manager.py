"""The block manager: unit cases, then randomized operation mixes checked after every step."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.engine.block_manager import BlockManager, NoFreeBlocks, kv_block_bytes, num_blocks_for_budget

BS = 4


def test_allocate_append_free_roundtrip():
    bm = BlockManager(8, BS)
    assert bm.allocate("a", list(range(6))) == 0
    assert len(bm.block_table("a")) == 2 and bm.num_free_blocks == 6
    bm.append("a", 8)  # still two blocks
    assert len(bm.block_table("a")) == 2
    bm.append("a", 9)  # a third
    assert len(bm.block_table("a")) == 3
    bm.check_integrity()
    bm.free("a")
    bm.free("a")  # twice is harmless
    assert bm.num_free_blocks == 8
    bm.check_integrity()


def test_shared_prefix_is_reused_and_ref_counted():
    bm = BlockManager(16, BS)
    prompt = list(range(10))  # two full blocks + 2 tokens
    bm.allocate("a", prompt)
    assert bm.allocate("early", prompt) == 0  # nothing is shared before its KV is computed
    bm.free("early")
    bm.mark_computed("a", prompt)
    assert bm.allocate("b", [*prompt[:8], 99, 98, 97]) == 8
    assert bm.block_table("a")[:2] == bm.block_table("b")[:2]
    assert bm.block_table("a")[2] != bm.block_table("b")[2]
    assert bm.num_free_blocks == 16 - 4
    bm.free("a")
    assert bm.num_free_blocks == 16 - 3  # shared blocks still held by b
    bm.check_integrity()
    bm.free("b")
    # Freed blocks keep their contents: a third request hits them from the free queue.
    assert bm.allocate("c", prompt) == 8
    assert bm.prefix_hits == 4 and bm.prefix_queries == 8
    bm.check_integrity()


def test_divergent_prefix_does_not_match_later_blocks():
    bm = BlockManager(16, BS)
    bm.allocate("a", [1, 2, 3, 4, 5, 6, 7, 8])
    bm.mark_computed("a", [1, 2, 3, 4, 5, 6, 7, 8])
    assert bm.allocate("b", [9, 9, 9, 9, 5, 6, 7, 8]) == 0  # same second block, different first
    bm.check_integrity()


def test_decode_blocks_become_cached_when_full():
    bm = BlockManager(16, BS)
    seq = [1, 2, 3]
    bm.allocate("a", seq)
    for t in range(4, 10):
        seq.append(t)
        bm.append("a", len(seq))
        bm.mark_computed("a", seq)
    bm.free("a")
    assert bm.allocate("b", list(range(1, 10))) == 8


def test_eviction_takes_least_recently_freed_and_tail_first():
    bm = BlockManager(4, BS, prefix_caching=True)
    bm.allocate("a", list(range(8)))  # blocks for [0..4) and [4..8)
    bm.mark_computed("a", list(range(8)))
    head, tail = bm.block_table("a")
    bm.free("a")  # tail freed first, so it is evicted first
    bm.allocate("x", [50, 51])  # takes one of the two never-used blocks
    bm.allocate("y", [60, 61])  # the other
    bm.allocate("z", [70, 71])  # must evict: the tail goes, the head survives
    assert bm.block_table("z") == [tail]
    bm.free("x")
    assert bm.allocate("b", [0, 1, 2, 3, 9]) == 4  # head still cached
    assert bm.block_table("b")[0] == head
    bm.check_integrity()


def test_watermark_blocks_admission_but_not_growth():
    bm = BlockManager(10, BS, watermark=0.2)  # 2 blocks held back
    assert bm.can_allocate(list(range(32)))  # 8 blocks, leaves 2
    assert not bm.can_allocate(list(range(33)))  # 9 blocks
    bm.allocate("a", list(range(32)))
    assert bm.can_append("a", 40) and not bm.can_append("a", 41)
    with pytest.raises(NoFreeBlocks):
        bm.append("a", 41)
    bm.check_integrity()


def test_failed_allocation_leaves_nothing_behind():
    bm = BlockManager(3, BS)
    bm.allocate("a", list(range(8)))
    bm.mark_computed("a", list(range(8)))
    bm.free("a")
    with pytest.raises(NoFreeBlocks):
        bm.allocate("b", list(range(20)))  # hits 2 cached blocks, then needs 3 more
    assert "b" not in bm and bm.num_free_blocks == 3
    bm.check_integrity()


def test_sizing_from_budget():
    per_block = kv_block_bytes(16, num_layers=30, num_kv_heads=3, head_dim=64, dtype_bytes=2)
    assert per_block == 2 * 30 * 16 * 3 * 64 * 2
    assert num_blocks_for_budget(2**30, per_block) == 2**30 // per_block


def run_random_ops(seed: int, num_blocks: int, steps: int) -> None:
    rng = random.Random(seed)
    bm = BlockManager(num_blocks, BS, watermark=rng.choice([0.0, 0.1]), prefix_caching=rng.random() < 0.8)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 14))] for _ in range(4)]
    seqs: dict[int, list[int]] = {}
    next_id = 0
    for _ in range(steps):
        op = rng.random()
        if op < 0.35:  # add
            tokens = [*rng.choice(prefixes), *(rng.randrange(50) for _ in range(rng.randrange(0, 9)))]
            if tokens and bm.can_allocate(tokens):
                cached = bm.allocate(next_id, tokens)
                assert cached % BS == 0 and cached < len(tokens)
                bm.mark_computed(next_id, tokens)
                seqs[next_id] = tokens
                next_id += 1
        elif op < 0.8 and seqs:  # grow; preempt the newest sequence when blocks run out
            seq = rng.choice(list(seqs))
            tokens = seqs[seq] + [rng.randrange(50) for _ in range(rng.randrange(1, 6))]
            while not bm.can_append(seq, len(tokens)):
                victim = max(seqs)
                bm.free(victim)
                del seqs[victim]
                if victim == seq:
                    break
            if seq in seqs:
                bm.append(seq, len(tokens))
                bm.mark_computed(seq, tokens)
                seqs[seq] = tokens
        elif seqs:  # finish or abort
            seq = rng.choice(list(seqs))
            bm.free(seq)
            del seqs[seq]
        bm.check_integrity()
        for seq, tokens in seqs.items():
            assert len(bm.block_table(seq)) * BS >= len(tokens)
    for seq in list(seqs):
        bm.free(seq)
    bm.check_integrity()
    assert bm.num_free_blocks == num_blocks


@pytest.mark.parametrize("seed", range(20))
def test_random_operation_mix(seed):
    run_random_ops(seed, num_blocks=24, steps=400)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_blocks=st.integers(1, 40))
def test_random_operation_mix_hypothesis(seed, num_blocks):
    run_random_ops(seed, num_blocks, steps=150)
