"""A sharded simulation: each shard's slice of the layout and of the arrivals, the merge, and the
sharded percentiles against one process on a cluster large enough that placement samples."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cluster.slo import percentile
from planner import shards
from planner.profile import DecodeCost, LinearCost, PrefillCost, Profile, StepCosts
from planner.sim import Layout, simulate
from planner.workload import arrivals, load


def profile() -> Profile:
    step = StepCosts(PrefillCost(0.01, 2e-4, 1e-8), DecodeCost(0.02, 1e-3, 1e-7))
    return Profile({1: step}, {"grpc": LinearCost(0.002, 1e-9)}, LinearCost(1e-4, 1e-5), 1024)


def test_split_divides_each_pool_and_refuses_pools_smaller_than_the_shards():
    parts = shards.split(Layout(5, 11), 3)
    assert [(p.prefill, p.decode) for p in parts] == [(2, 4), (2, 4), (1, 3)]
    assert shards.split(Layout(0, 4), 2)[1].prefill == 0, "colocated stays colocated"
    with pytest.raises(ValueError, match="too few workers"):
        shards.split(Layout(1, 4), 2)
    with pytest.raises(ValueError, match="too few workers"):
        shards.split(Layout(2, 1), 2)


def test_thinning_deals_every_arrival_to_exactly_one_shard():
    wl = load("short-chat").with_requests(3000)
    dealt = [list(shards.thinned(wl, 5, i, 3)) for i in range(3)]
    assert sorted(a.time for part in dealt for a in part) == [a.time for a in arrivals(wl, 5)]
    assert all(900 < len(part) < 1100 for part in dealt)


def test_one_shard_is_the_plain_simulation_and_shards_are_deterministic():
    prof, layout = profile(), Layout(2, 4)
    wl = load("short-chat").with_rate(6.0).with_requests(400)
    plain = simulate(prof, layout, wl, seed=3)
    assert shards.simulate_sharded(prof, layout, wl, 1, seed=3).ttft == plain.ttft
    a, b = (shards.simulate_sharded(prof, layout, wl, 2, seed=3) for _ in range(2))
    assert a.ttft == b.ttft and a.tpot == b.tpot and a.requests == 400


def test_merge_pools_requests_and_weighs_workers_by_the_time_they_ran():
    prof = profile()
    wl = load("short-chat").with_rate(6.0).with_requests(300)
    one, two = (simulate(prof, Layout(1, 2), wl.with_requests(n), seed=1) for n in (300, 150))
    merged = shards.merge("x", [one, two])
    assert merged.requests == one.requests + two.requests
    assert merged.duration_s == max(one.duration_s, two.duration_s)
    assert merged.steps == one.steps + two.steps
    seconds = one.workers["decode"] * one.duration_s + two.workers["decode"] * two.duration_s
    assert merged.workers["decode"] == pytest.approx(seconds / merged.duration_s)


def test_two_shards_of_a_large_cluster_predict_what_one_process_does():
    """200 workers (40 prefill, 160 decode: placement samples beyond 64 a pool), 12,000 requests."""
    prof = profile()
    layout = replace(Layout(40, 160), decode_blocks=6000, prefill_blocks=6000)
    wl = load("short-chat").with_rate(60.0).with_requests(12000)
    whole, split = simulate(prof, layout, wl, seed=0), shards.simulate_sharded(prof, layout, wl, 2, seed=0)
    assert split.requests == whole.requests == 12000
    for name in ("ttft", "e2e"):
        for q in (50, 90, 99):
            a, b = percentile(getattr(whole, name), q), percentile(getattr(split, name), q)
            assert b == pytest.approx(a, rel=0.1), f"{name} p{q}"
    tpot = [[t for t in r.tpot if t is not None] for r in (whole, split)]
    for q in (50, 90, 99):
        assert percentile(tpot[1], q) == pytest.approx(percentile(tpot[0], q), rel=0.1), f"tpot p{q}"
    for pool in ("prefill", "decode"):
        assert split.utilisation(pool) == pytest.approx(whole.utilisation(pool), rel=0.1), pool
