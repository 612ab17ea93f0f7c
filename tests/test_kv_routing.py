"""KV-aware routing's parts without servers: the workers' cache events (`KVJournal`, fed by the
block manager), a router's `PrefixIndex` of them, and placement by cost (`placement.choose` and
`LoadIndex.choose`, which must agree)."""

from __future__ import annotations

import random
import tracemalloc

import pytest
from tandem.v1 import worker_pb2

from cluster.engine.block_manager import BlockManager
from cluster.engine.block_names import UNNAMED_MODEL, chain
from cluster.engine.kv_events import KVJournal
from router.placement.index import LoadIndex
from router.placement.placement import choose
from router.placement.prefix_index import PrefixIndex

BS = 4


def load(role: str, free: int = 100, running: int = 0, queued: int = 0, total: int = 100):
    return worker_pb2.WorkerLoad(
        role=role, free_kv_blocks=free, total_kv_blocks=total, running_seqs=running, queued_prompt_tokens=queued
    )


# -- the journal ---------------------------------------------------------------------------------------


def test_the_block_manager_tells_the_journal_what_it_registers_and_evicts():
    journal = KVJournal()
    blocks = BlockManager(4, BS, journal=journal)
    tokens = list(range(12))
    blocks.allocate("a", tokens)
    blocks.mark_computed("a", tokens)
    assert journal.held() == set(chain(tokens, BS, UNNAMED_MODEL)[:3])  # the names routers compute alone
    blocks.check_integrity()
    blocks.free("a")
    blocks.allocate("b", list(range(100, 112)))  # needs 3 fresh blocks: evicts cached ones
    assert len(journal.held()) == 1
    blocks.check_integrity()  # it checks the journal against the cache


def test_events_come_in_order_as_net_batches_and_a_reader_too_far_behind_gets_a_snapshot():
    journal = KVJournal(max_events=4)
    first = journal.since(None)
    assert first is not None and first.snapshot and first.stored == []
    journal.stored(1)
    journal.stored(2)
    journal.removed(1)
    batch = journal.since(first.last)
    assert (batch.first, batch.last, batch.stored, batch.removed, batch.snapshot) == (1, 3, [2], [1], False)
    assert journal.since(batch.last) is None
    for h in range(10, 16):  # six more events: the first four of them fall out of the log
        journal.stored(h)
    late = journal.since(batch.last)
    assert late.snapshot and set(late.stored) == {2, *range(10, 16)} and late.last == 9
    recent = journal.since(7)
    assert not recent.snapshot and recent.stored == [14, 15]


# -- the router's index ----------------------------------------------------------------------------------


def test_the_index_matches_leading_blocks_per_worker():
    index = PrefixIndex()
    a, b = list(range(16)), list(range(8)) + [99] * 8
    ha, hb = chain(a, BS, UNNAMED_MODEL), chain(b, BS, UNNAMED_MODEL)
    journal_a, journal_b = KVJournal(), KVJournal()
    for h in ha:
        journal_a.stored(h)
    for h in hb:
        journal_b.stored(h)
    assert index.apply("w-a", journal_a.since(None)) and index.apply("w-b", journal_b.since(None))
    assert index.match(ha) == {"w-a": 4, "w-b": 2}
    assert index.match(chain([5] * 16, BS, UNNAMED_MODEL)) == {}


def test_a_gap_is_refused_until_a_snapshot_and_a_dead_worker_is_dropped():
    index, journal = PrefixIndex(), KVJournal()
    hashes = chain(list(range(12)), BS, UNNAMED_MODEL)
    assert index.apply("w", journal.since(None))
    journal.stored(hashes[0])
    missed = journal.since(0)
    journal.stored(hashes[1])
    journal.stored(hashes[2])
    assert not index.apply("w", journal.since(missed.last))  # the first event never arrived: a gap
    assert index.match(hashes) == {}
    assert index.apply("w", journal.since(None))  # resynchronised from a snapshot
    assert index.match(hashes) == {"w": 3}
    journal.removed(hashes[1])
    assert index.apply("w", journal.since(3))
    assert index.match(hashes) == {"w": 1}  # holding the first and third is a prefix of one
    index.drop("w")
    assert index.match(hashes) == {} and len(index) == 0


def test_the_index_stays_within_its_block_bound_least_recently_used_first():
    index, journal = PrefixIndex(max_blocks=1000), KVJournal()
    index.apply("w", journal.since(None))
    hot = chain(list(range(8)), BS, UNNAMED_MODEL)
    for h in hot:
        journal.stored(h)
    index.apply("w", journal.since(0))
    cursor = journal.sequence
    for n in range(3000):
        journal.stored(10_000 + n)
        if n % 100 == 0:
            index.apply("w", journal.since(cursor))
            cursor = journal.sequence
            assert index.match(hot) == {"w": 2}  # matched: kept as recently used
    index.apply("w", journal.since(cursor))
    assert len(index) == 1000 and index.blocks_of("w") == 1000 and index.evicted == 2002
    assert index.match(hot) == {"w": 2}


def test_the_index_memory_per_block_is_what_the_docs_say():
    index, journal = PrefixIndex(max_blocks=200_000), KVJournal()
    rng = random.Random(0)
    index.apply("w0", journal.since(None))
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for worker in range(4):
        for _ in range(50_000):
            index._add(f"w{worker}", rng.getrandbits(63))
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    per_block = used / len(index)
    assert len(index) == 200_000
    assert per_block < 250, per_block  # the docstring says about 180 bytes a block


# -- placement by cost -----------------------------------------------------------------------------------


def both(prompt, loads, matches, local_max=8, max_tokens=4):
    """`placement.choose` and `LoadIndex.choose` on the same loads and cache contents (asserted equal)."""
    pure = choose(prompt, max_tokens, loads, BS, local_max, matches=matches)
    index = LoadIndex(stale_after_s=1e9)
    index.prefix = PrefixIndex()
    hashes = chain(prompt, BS, UNNAMED_MODEL)
    for name, load_ in loads.items():
        index.update(name, load_)
        journal = KVJournal()
        for h in hashes[: matches.get(name, 0)]:
            journal.stored(h)
        index.prefix.apply(name, journal.since(None))
    pushed = index.choose(prompt, max_tokens, BS, local_max)
    assert pushed == pure
    return pure


PROMPT = list(range(40))  # ten full blocks


def test_the_next_turn_goes_back_to_the_decode_worker_holding_the_history():
    loads = {"decode-0": load("decode", free=90), "decode-1": load("decode", free=95), "prefill-0": load("prefill")}
    choice = both(PROMPT, loads, {"decode-0": 9})
    assert (choice.decode, choice.prefill, choice.reason, choice.cached_blocks) == (
        "decode-0", None, "local:cached-prefix", 9,
    )  # fmt: skip
    cold = both(PROMPT, loads, {})
    assert (cold.decode, cold.reason) == ("decode-1", "remote:prefix-owner")  # no knowledge: as before


def test_a_busy_holder_loses_to_an_idle_worker_when_the_cost_says_so():
    loads = {"decode-0": load("decode", free=20, running=9), "decode-1": load("decode", free=100)}
    # holding 9 of 10 blocks saves 9; 80 blocks in use cost 80: the idle worker prefills it all
    choice = both(PROMPT, loads, {"decode-0": 9})
    assert choice.decode == "decode-1" and choice.reason == "local:no-prefill-worker"
    lighter = {"decode-0": load("decode", free=96, running=1), "decode-1": load("decode", free=100)}
    assert both(PROMPT, lighter, {"decode-0": 9}).decode == "decode-0"  # 4 in use < 9 saved


def test_remote_prefill_goes_to_the_prefill_worker_holding_the_longest_prefix():
    loads = {
        "decode-0": load("decode"),
        "prefill-0": load("prefill", queued=100),
        "prefill-1": load("prefill", queued=0),
    }
    choice = both(PROMPT, loads, {"prefill-0": 6, "prefill-1": 2}, local_max=4)
    assert (choice.prefill, choice.reason, choice.cached_blocks) == ("prefill-0", "remote:cached-prefix", 6)
    swamped = {**loads, "prefill-0": load("prefill", queued=10_000)}
    choice = both(PROMPT, swamped, {"prefill-0": 6, "prefill-1": 2}, local_max=4)
    assert (choice.prefill, choice.reason) == ("prefill-1", "remote:shortest-queue")


@pytest.mark.parametrize("seed", range(20))
def test_pushed_and_pure_placement_agree_on_random_clusters(seed):
    rng = random.Random(seed)
    loads, matches = {}, {}
    for i in range(rng.randint(1, 6)):
        loads[f"decode-{i}"] = load("decode", free=rng.randint(0, 100), running=rng.randint(0, 8))
    for i in range(rng.randint(0, 3)):
        loads[f"prefill-{i}"] = load("prefill", queued=rng.choice([0, 100, 5000]))
    for name in loads:
        if rng.random() < 0.5:
            matches[name] = rng.randint(1, 10)
    both(PROMPT, loads, matches, local_max=rng.choice([0, 8, 32]))
