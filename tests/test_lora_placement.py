"""Placement of requests through LoRA adapters, from the loads workers push: only workers serving the
adapter; among decode workers with room, one holding it in a slot first, then one with a slot free, then
one that must write a slot over; an adapter no worker serves is `NoAdapter` (NOT_FOUND to the client)."""

from __future__ import annotations

import pytest
from tandem.v1 import worker_pb2

from router.placement.index import LoadIndex, NoAdapter


def decode(running: int, adapters: dict[str, bool], max_loras: int = 2, retiring: tuple[str, ...] = ()):  # type: ignore[no-untyped-def]
    """A decode worker's load: `adapters` {name: resident}."""
    served = [worker_pb2.LoadedAdapter(name=n, digest=n.encode(), resident=r) for n, r in adapters.items()]
    served += [worker_pb2.LoadedAdapter(name=n, digest=n.encode(), retiring=True) for n in retiring]
    return worker_pb2.WorkerLoad(
        role="decode", running_seqs=running, free_kv_blocks=100, total_kv_blocks=100, adapters=served,
        max_loras=max_loras,
    )  # fmt: skip


def index(**loads: worker_pb2.WorkerLoad) -> LoadIndex:
    placed = LoadIndex(stale_after_s=1e9)
    for name, load in loads.items():
        placed.update(name, load)
    return placed


def choose(placed: LoadIndex, adapter: str) -> str:
    return placed.choose(list(range(10)), 4, 16, local_prefill_max_tokens=64, adapter=adapter).decode


def test_a_worker_holding_the_adapter_in_a_slot_wins_over_lighter_ones():
    placed = index(
        light=decode(0, {}),  # does not serve it
        free_slot=decode(1, {"a": False, "b": True}, max_loras=3),
        full=decode(2, {"a": False, "b": True, "c": True}),
        holding=decode(5, {"a": True}),
    )
    assert choose(placed, "a") == "holding"
    assert choose(placed, "") == "light", "the base model goes to the lightest"


def test_a_free_slot_wins_over_writing_one_over_and_the_lighter_wins_among_equals():
    placed = index(
        full=decode(0, {"a": False, "b": True, "c": True}),
        free_slot=decode(3, {"a": False, "b": True}, max_loras=3),
        also_free=decode(1, {"a": False}),
    )
    assert choose(placed, "a") == "also_free"


def test_an_adapter_no_worker_serves_and_one_being_unloaded_are_not_found():
    placed = index(w0=decode(0, {"a": True}, retiring=("old",)))
    with pytest.raises(NoAdapter, match="no worker serves adapter 'nope'"):
        choose(placed, "nope")
    with pytest.raises(NoAdapter, match="'old'"):
        choose(placed, "old")
    assert placed.adapter_names() == ["a"]


def test_an_adapter_held_as_widely_as_allowed_waits_where_it_is_held():
    full = worker_pb2.WorkerLoad(**{**_fields(decode(6, {"a": True})), "free_kv_blocks": 0})
    placed = index(holding=full, idle=decode(0, {"a": False}))
    assert placed.choose(list(range(10)), 4, 16, 64, adapter="a").decode == "idle", "unbounded: it spreads"
    bounded = placed.choose(list(range(10)), 4, 16, 64, adapter="a", adapter_spread=1)
    assert bounded.decode == "holding", "bounded: it waits where it is held"
    assert placed.choose(list(range(10)), 4, 16, 64, adapter="a", adapter_spread=2).decode == "idle"


def _fields(load: worker_pb2.WorkerLoad) -> dict:  # type: ignore[type-arg]
    return {f.name: getattr(load, f.name) for f, _ in load.ListFields()}
