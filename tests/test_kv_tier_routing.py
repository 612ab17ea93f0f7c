"""Routers know the KV tiers: the journal's events name each block's tier and stay in order, a
reader that mirrors them holds what the worker holds, and placement weighs a tier hit by what the
worker measured loading from that tier costs; the shared tier is a tier any worker can load from."""

from __future__ import annotations

from tandem.v1 import worker_pb2

from cluster.engine.block_names import UNNAMED_MODEL, chain
from cluster.engine.kv_events import KVJournal, replay
from cluster.grpc_server import kv_events_message
from cluster.kv.stores import HostStore
from cluster.kv.tiers import Tiers
from router.placement.index import LoadIndex
from router.placement.prefix_index import PrefixIndex

BS = 16
PROMPT = list(range(100, 100 + 8 * BS + 1))  # eight full blocks and one token
NAMES = chain(PROMPT[:-1], BS, UNNAMED_MODEL)


def test_the_tiers_tell_the_journal_what_they_store_and_evict_in_order():
    journal = KVJournal()
    tiers = Tiers([HostStore(2 * 100)], b"secret", b"layout", journal=journal)  # room for two 100-byte blocks
    cursor, mirror = None, KVJournal()
    seen = []
    for i in range(4):
        tiers.offer(NAMES[i], bytes(100))
        assert tiers.flush()
        batch = journal.since(cursor)
        assert batch is not None
        cursor = batch.last
        replay(mirror, batch)
        seen.append({t.tier: (t.stored, t.removed) for t in batch.tiers})
    assert seen[0] == {"host": ([NAMES[0]], [])} and seen[1] == {"host": ([NAMES[1]], [])}
    assert seen[2] == {"host": ([NAMES[2]], [NAMES[0]])} and seen[3] == {"host": ([NAMES[3]], [NAMES[1]])}
    assert mirror.held("host") == journal.held("host") == {NAMES[2], NAMES[3]}
    assert journal.held() == set(), "a tier's block was told as the pool's"
    snapshot = journal.since(None)
    assert snapshot.snapshot and [(t.tier, set(t.stored)) for t in snapshot.tiers] == [("host", {NAMES[2], NAMES[3]})]
    tiers.close()


def load(free: int = 100, **costs: float) -> worker_pb2.WorkerLoad:
    return worker_pb2.WorkerLoad(role="decode", free_kv_blocks=free, total_kv_blocks=100, tier_block_cost=costs)


def index_with(tier_of: dict[str, tuple[str, list[bytes]]], costs: dict[str, dict[str, float]]) -> LoadIndex:
    """Two decode workers with empty pools; each tier's blocks as the named worker's events tell."""
    index = LoadIndex(stale_after_s=1e9)
    index.prefix = PrefixIndex()
    for worker in ("decode-0", "decode-1"):
        index.update(worker, load(**costs.get(worker, {})))
        journal = KVJournal()
        for tier, names in [tier_of[worker]] if worker in tier_of else []:
            for name in names:
                journal.stored(name, tier)
        assert index.prefix.apply(worker, kv_events_message(journal.since(None)))  # as the wire carries it
    return index


def test_placement_goes_to_the_worker_whose_tier_holds_the_prompt_while_loading_it_pays():
    held = {"decode-1": ("host", NAMES)}  # decode-1's host tier holds the whole prompt; decode-0 nothing
    assert index_with(held, {}).choose(PROMPT, 4, BS, 8).decode == "decode-1"  # not measured yet: worth a try
    cheap = index_with(held, {"decode-1": {"host": 0.1}})
    choice = cheap.choose(PROMPT, 4, BS, 8)
    assert choice.decode == "decode-1" and choice.cached_blocks == 0, "a tier's blocks counted as the pool's"
    dear = index_with(held, {"decode-1": {"host": 1.5}})  # loading there costs more than computing
    assert dear.choose(PROMPT, 4, BS, 8).decode == "decode-0"


def test_the_shared_tier_makes_any_worker_a_local_prefill_for_a_long_prompt():
    shared = {"decode-0": ("shared", NAMES)}  # told by decode-0, which wrote them; any worker loads them
    index = index_with(shared, {"decode-0": {"shared": 0.05}, "decode-1": {"shared": 0.05}})
    index.update("prefill-0", worker_pb2.WorkerLoad(role="prefill", total_kv_blocks=100, free_kv_blocks=100))
    choice = index.choose(PROMPT, 4, BS, 8)
    assert choice.prefill is None and choice.reason == "local:cached-prefix"
    without = index_with({}, {})
    without.update("prefill-0", worker_pb2.WorkerLoad(role="prefill", total_kv_blocks=100, free_kv_blocks=100))
    assert without.choose(PROMPT, 4, BS, 8).prefill == "prefill-0"


def test_tandem_status_shows_each_workers_tier_hits_and_costs(capsys):
    from cli.admin import _print_tiers

    tiered = worker_pb2.WorkerLoad(tier_hit_blocks={"host": 70, "shared": 12}, tier_block_cost={"host": 0.004})
    workers = [
        worker_pb2.WorkerStatus(name="decode-0", load=tiered),
        worker_pb2.WorkerStatus(name="decode-1", load=worker_pb2.WorkerLoad()),  # no tiers: not shown
    ]
    _print_tiers(workers)
    assert capsys.readouterr().out == (
        "KV tiers, blocks loaded (cost against computing): decode-0 host 70 (0.00), shared 12 (-)\n"
    )
    _print_tiers(workers[1:])
    assert capsys.readouterr().out == ""
