"""The simulator on hand-made profiles, against closed-form results: M/D/1 waiting for one prefill
worker, and a decode batch's TPOT as a function of its size; determinism; no blocks leak; the
indexed placement equals the router's."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest
from tandem.v1 import worker_pb2

from cluster.config import SchedulerConfig
from cluster.slo import Targets
from planner.profile import DecodeCost, LinearCost, PrefillCost, Profile, StepCosts
from planner.routing import Placer, Ring
from planner.sim import Layout, Simulator, simulate
from planner.workload import load, parse
from router.placement import placement


def profile(prefill: PrefillCost, decode: DecodeCost, transfer: float = 0.0, router: float = 0.0) -> Profile:
    step = StepCosts(prefill, decode)
    return Profile({1: step, 2: step}, {"grpc": LinearCost(transfer, 0.0)}, LinearCost(router, 0.0), 1024)


def fixed(rate: float, requests: int, prompt: int, output: int) -> dict:
    return {
        "arrival": {"process": "poisson", "rate": rate},
        "requests": requests,
        "classes": [{"prompt": {"dist": "fixed", "value": prompt}, "output": {"dist": "fixed", "value": output}}],
    }


@pytest.mark.parametrize("rho", [0.5, 0.8])
def test_one_prefill_worker_waits_as_m_d_1(rho):
    """Poisson arrivals, one prompt per pass, each pass D seconds: mean wait = rho D / (2 (1 - rho))."""
    service = 0.1
    costs = profile(PrefillCost(0.0, service / 256), DecodeCost(0.0, 0.0))
    layout = Layout(1, 1, prefill_scheduler=SchedulerConfig(max_num_batched_tokens=256), prefill_blocks=20000)
    result = simulate(costs, layout, parse(fixed(rho / service, 20000, 256, 1)), seed=1)
    waits = result.queue["prefill"]
    expected = rho * service / (2 * (1 - rho))
    assert len(waits) == 20000
    assert sum(waits) / len(waits) == pytest.approx(expected, rel=0.08)
    assert sum(result.ttft) / len(result.ttft) == pytest.approx(expected + service, rel=0.06)
    assert result.utilisation("prefill") == pytest.approx(rho, rel=0.03)


@pytest.mark.parametrize("batch", [1, 4, 16, 48])
def test_tpot_of_a_decode_batch(tmp_path, batch):
    """B requests arriving together decode in one batch: each step costs base + B * row, so TPOT is
    that, except for the one step the first request (admitted alone) is ahead of the others."""
    base, row = 0.01, 0.002
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        "".join(json.dumps({"arrival_s": 0, "prompt_tokens": 16, "output_tokens": 33}) + "\n" for _ in range(batch))
    )
    costs = profile(PrefillCost(0.0, 1e-5), DecodeCost(base, row))
    workload = parse({"arrival": {"process": "trace", "path": str(trace)}, "requests": batch})
    result = simulate(costs, Layout(0, 1), workload)
    tpots = sorted(result.tpot)
    expected = (31 * (base + batch * row) + (base + (batch - 1) * row)) / 32 if batch > 1 else base + row
    assert tpots[len(tpots) // 2] == pytest.approx(expected, rel=1e-9)
    assert result.itl and max(result.itl) <= base + batch * row + 1e-12


def test_tpot_grows_with_context():
    """With a per-context-token cost, one request's steps cost base + row + ctx * context."""
    base, row, ctx = 0.01, 0.001, 1e-5
    costs = profile(PrefillCost(0.0, 0.0), DecodeCost(base, row, ctx))
    result = simulate(costs, Layout(0, 1), parse(fixed(1e-3, 1, 100, 11)))
    # tokens 2..11 come from steps over contexts 101..110
    assert result.tpot[0] == pytest.approx(base + row + ctx * sum(range(101, 111)) / 10)


def disagg_profile() -> Profile:
    return profile(PrefillCost(0.004, 2e-4, 1e-8), DecodeCost(0.01, 1e-3, 1e-6), transfer=0.003, router=5e-4)


def test_same_seed_same_result_and_a_new_seed_differs():
    workload = load("disagg").with_requests(400)
    runs = [simulate(disagg_profile(), Layout(1, 1), workload, seed=s).summary(Targets(1, 0.1)) for s in (3, 3, 4)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


@pytest.mark.parametrize("layout", [Layout(0, 2), Layout(1, 1), Layout(2, 3, decode_blocks=300)])
def test_every_request_finishes_and_no_block_leaks(layout):
    sim = Simulator(disagg_profile(), layout, seed=0)
    result = sim.run(load("code").with_requests(300).with_rate(8.0))
    assert result.requests + result.rejected == 300 and result.rejected == 0
    for worker in [*sim.decode.values(), *sim.prefill.values()]:
        worker.blocks.check_integrity()
        assert worker.idle
        assert worker.blocks.num_free_blocks == worker.blocks.num_blocks
    if layout.prefill:
        assert result.queue["prefill"] and result.utilisation("prefill") > 0


def test_a_small_kv_cache_preempts_and_still_finishes():
    layout = Layout(0, 1, decode_blocks=40, decode_scheduler=SchedulerConfig(max_num_seqs=16))
    sim = Simulator(disagg_profile(), layout)
    result = sim.run(parse(fixed(50.0, 60, 100, 200)))
    assert result.requests == 60
    assert sim.decode["decode-0"].scheduler.stats.num_preemptions > 0


def test_the_ring_is_placement_s_ring():
    rng = random.Random(0)
    workers = [f"prefill-{i}" for i in range(7)]
    ring = Ring(workers)
    for _ in range(300):
        key = [rng.randrange(50000) for _ in range(16)]
        assert ring.owner(key) == placement.ring_owner(key, sorted(workers))


def test_the_placer_chooses_as_the_router_does():
    rng = random.Random(1)
    for _ in range(300):
        loads = {}
        for i in range(rng.randint(1, 4)):
            loads[f"decode-{i}"] = worker_pb2.WorkerLoad(
                role="decode", running_seqs=rng.randint(0, 5), waiting_seqs=rng.randint(0, 2),
                free_kv_blocks=rng.randint(0, 40), total_kv_blocks=40,
            )  # fmt: skip
        for i in range(rng.randint(0, 4)):
            loads[f"prefill-{i}"] = worker_pb2.WorkerLoad(role="prefill", queued_prompt_tokens=rng.randint(0, 5000))
        placer = Placer(loads.__getitem__, 16, 64)
        placer.set_workers([n for n in loads if n.startswith("d")], [n for n in loads if n.startswith("p")])
        prompt = [rng.randrange(1000) for _ in range(rng.choice([10, 64, 65, 300]))]
        try:
            expected = placement.choose(prompt, 32, loads, 16, 64)
        except placement.NoCapacity:
            with pytest.raises(placement.NoCapacity):
                placer.choose(prompt, 32)
            continue
        assert placer.choose(prompt, 32) == expected


@pytest.mark.parametrize("layout", [Layout(1, 3), Layout(0, 4)])
def test_runs_of_decode_steps_match_step_by_step(layout):
    """Planning unchanged decode steps as one run (cut when a request arrives) gives the
    step-by-step simulation's latencies."""
    workload = load("short-chat").with_requests(1500).with_rate(20.0)
    runs = [
        simulate(disagg_profile(), replace(layout, macro_steps=m), workload).summary(Targets(1, 0.05)) for m in (1, 16)
    ]
    for key in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "e2e_p99_s"):
        assert runs[1][key] == pytest.approx(runs[0][key], rel=0.03), key
    assert runs[1]["requests"] == runs[0]["requests"] == 1500
