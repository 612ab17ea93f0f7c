"""Placement from pushed worker state: the load index against the polled reference, staleness, the
ring's rebuilds, and `Worker.Watch` streams from fake workers over real gRPC."""

from __future__ import annotations

import random
import time

import pytest
from tandem.v1 import worker_pb2

from router.placement.discovery import WorkerDiscovery
from router.placement.index import LoadIndex
from router.placement.placement import NoCapacity, NoneInView, choose
from router.placement.view import WorkerView
from tests.fake_workers import FakeFleet


def random_load(rng: random.Random, role: str) -> worker_pb2.WorkerLoad:
    total = rng.choice([4, 20, 100])
    return worker_pb2.WorkerLoad(
        role=role, running_seqs=rng.randrange(4), waiting_seqs=rng.randrange(3),
        free_kv_blocks=rng.randrange(total + 1), total_kv_blocks=total,
        queued_prompt_tokens=rng.choice([0, 10, 500, 5000]), draining=rng.random() < 0.1, wedged=rng.random() < 0.05,
    )  # fmt: skip


@pytest.mark.parametrize("seed", range(20))
def test_pushed_state_makes_the_same_choices_as_polled_loads(seed):
    rng = random.Random(seed)
    index, loads = LoadIndex(stale_after_s=1e9), {}
    names = [f"decode-{i}" for i in range(rng.randrange(1, 6))] + [f"prefill-{i}" for i in range(rng.randrange(4))]
    for _ in range(200):
        name = rng.choice(names)
        if rng.random() < 0.1:
            index.remove(name)
            loads.pop(name, None)
        else:
            loads[name] = random_load(rng, name.split("-")[0])
            index.update(name, loads[name])
        prompt = [rng.randrange(50) for _ in range(rng.choice([3, 20, 70]))]
        max_tokens, slack = rng.choice([1, 30, 300, 3000]), rng.choice([100, 2048])
        try:
            expected = choose(prompt, max_tokens, loads, 16, 8, slack)
        except NoCapacity:
            with pytest.raises(NoCapacity):
                index.choose(prompt, max_tokens, 16, 8, slack)
            continue
        assert index.choose(prompt, max_tokens, 16, 8, slack) == expected


def test_stale_views_are_refused_past_their_bound():
    now = [0.0]
    index = LoadIndex(stale_after_s=2.0, clock=lambda: now[0])
    index.update("decode-0", worker_pb2.WorkerLoad(role="decode", free_kv_blocks=10, total_kv_blocks=10))
    index.update("decode-1", worker_pb2.WorkerLoad(role="decode", free_kv_blocks=9, total_kv_blocks=10, running_seqs=1))
    assert index.choose([1], 1, 16, 8).decode == "decode-0"
    now[0] = 1.5
    index.heard("decode-1")  # a heartbeat keeps decode-1's last snapshot trusted
    now[0] = 2.5
    assert index.choose([1], 1, 16, 8).decode == "decode-1", "decode-0 said nothing for 2.5 s"
    assert set(index.loads()) == {"decode-1"}
    now[0] = 4.0
    with pytest.raises(NoCapacity):
        index.choose([1], 1, 16, 8)


def test_a_late_worker_is_set_aside_and_its_next_heartbeat_brings_it_back():
    """An idle worker's load does not change, so it sends heartbeats only: one late past the
    bound is passed over, and the next heartbeat makes its last snapshot placeable again."""
    now = [0.0]
    index = LoadIndex(stale_after_s=2.0, clock=lambda: now[0])
    index.update("decode-0", worker_pb2.WorkerLoad(role="decode", free_kv_blocks=10, total_kv_blocks=10))
    index.update("prefill-0", worker_pb2.WorkerLoad(role="prefill", free_kv_blocks=10, total_kv_blocks=10))
    long_prompt = list(range(40))
    assert index.choose(long_prompt, 1, 16, 8).prefill == "prefill-0"
    now[0] = 3.0
    with pytest.raises(NoneInView, match="no decode worker has reported"):
        index.choose(long_prompt, 1, 16, 8)
    assert index.sweep() == ["prefill-0"] and not index.loads()
    now[0] = 3.5
    index.heard("decode-0")
    index.heard("prefill-0")
    choice = index.choose(long_prompt, 1, 16, 8)
    assert (choice.decode, choice.prefill) == ("decode-0", "prefill-0")
    assert set(index.loads()) == {"decode-0", "prefill-0"}
    with pytest.raises(NoCapacity, match="can hold 15 KV blocks") as e:
        index.choose(long_prompt, 200, 16, 8)  # 240 tokens: more than the worker's 10 blocks
    assert not isinstance(e.value, NoneInView), "a worker is in view: waiting would not help"


def test_a_suspected_worker_is_passed_over_until_it_is_heard_from():
    """A call to a worker failed: placement passes it over at once (its stream may still be up),
    and its next heartbeat brings it back."""
    index = LoadIndex()
    index.update("decode-0", worker_pb2.WorkerLoad(role="decode", free_kv_blocks=10, total_kv_blocks=10))
    index.update("decode-1", worker_pb2.WorkerLoad(role="decode", free_kv_blocks=9, total_kv_blocks=10, running_seqs=1))
    assert index.choose([1], 1, 16, 8).decode == "decode-0"
    index.suspect("decode-0")
    index.suspect("decode-9")  # never seen: nothing to set aside
    assert index.choose([1], 1, 16, 8).decode == "decode-1"
    index.heard("decode-0")
    assert index.choose([1], 1, 16, 8).decode == "decode-0"


def test_the_ring_is_rebuilt_only_when_membership_changes():
    index = LoadIndex()
    decode = worker_pb2.WorkerLoad(role="decode", free_kv_blocks=100, total_kv_blocks=100)
    index.update("decode-0", decode)
    for i in range(4):
        index.update(f"prefill-{i}", worker_pb2.WorkerLoad(role="prefill"))
    prompt = list(range(40))
    for queued in range(50):  # load changes: the same members
        index.update("prefill-0", worker_pb2.WorkerLoad(role="prefill", queued_prompt_tokens=queued))
        index.choose(prompt, 1, 16, 8)
    assert index.ring_builds == 1
    index.update("prefill-4", worker_pb2.WorkerLoad(role="prefill"))
    index.choose(prompt, 1, 16, 8)
    index.update("prefill-4", worker_pb2.WorkerLoad(role="prefill", draining=True))
    index.choose(prompt, 1, 16, 8)
    assert index.ring_builds == 3


@pytest.fixture
def fleet():
    fleet = FakeFleet()
    yield fleet
    fleet.close()


def wait_for(predicate, timeout_s: float = 5.0) -> float:
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout_s, "timed out"
        time.sleep(0.002)
    return time.monotonic() - start


def test_watch_driven_placement_follows_joins_breaks_and_drains(fleet):
    busy = fleet.add("decode-0")
    fleet.on_loop(busy.set_running, 5)
    pool = WorkerDiscovery(fleet.addresses, refresh_s=3600)
    view = WorkerView(pool, heartbeat_s=0.1, stale_after_s=0.5, retry_s=0.05)
    view.start()
    try:
        assert view.index.choose([1], 1, 16, 8).decode == "decode-0"
        joined = fleet.add("decode-1")
        view.refresh()  # discovery finds it; its first snapshot makes it placeable
        assert view.index.choose([1], 1, 16, 8).decode == "decode-1"
        joined.refuse_watch = True
        fleet.on_loop(joined.break_watches)
        wait_for(lambda: "decode-1" not in view.index.loads(), timeout_s=1.0)
        for _ in range(50):  # while its stream is down, it gets nothing
            assert view.index.choose([1], 1, 16, 8).decode == "decode-0"
            time.sleep(0.01)
        joined.refuse_watch = False
        wait_for(lambda: "decode-1" in view.index.loads())
        fleet.on_loop(joined.set_draining, True)
        wait_for(lambda: view.index.choose([1], 1, 16, 8).decode == "decode-0", timeout_s=1.0)
        heartbeats = view.updates
        time.sleep(0.35)
        assert view.updates - heartbeats >= 4, "idle workers keep sending heartbeats"
        assert set(view.index.loads()) == {"decode-0", "decode-1"}, "and stay in the view"
    finally:
        view.stop()
        pool.close()
