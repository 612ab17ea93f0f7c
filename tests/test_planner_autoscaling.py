"""The autoscaler's predictive mode: the planner's target for a pool, the reactive signals as the guard."""

from __future__ import annotations

from cluster.config import AutoscalingConfig
from cluster.pools.autoscaling import PolicyState, Signals, decide

CONFIG = AutoscalingConfig(min_replicas=1, max_replicas=10, upscale_delay_s=30, downscale_delay_s=300, max_step=2)


def quiet(workers: int) -> Signals:
    return Signals(workers=workers)


def busy(workers: int, seqs_per_worker: int) -> Signals:
    return Signals(workers=workers, running_seqs=workers * seqs_per_worker)


def test_without_a_plan_nothing_changes():
    assert decide("decode", CONFIG, quiet(1), PolicyState(1), 0) == decide(
        "decode", CONFIG, quiet(1), PolicyState(1), 0, None
    )


def test_the_pool_grows_to_the_plan_at_once_by_max_step():
    state = PolicyState(1)
    targets = []
    for now in (0, 2, 4):
        decision = decide("decode", CONFIG, quiet(state.target), state, now, planned=6)
        state = decision.state
        targets.append(decision.target)
    assert targets == [3, 5, 6]
    assert "plan" in decision.reason


def test_the_signals_guard_above_the_plan_with_their_delay():
    """Load beyond the forecast raises the pool above the plan, after upscale_delay_s; it stays
    until the signals have asked for less for downscale_delay_s, and never drops below the plan."""
    state = PolicyState(4)
    overloaded = busy(4, 64)  # twice target_running_seqs
    assert decide("decode", CONFIG, overloaded, state, 0, planned=4).target == 4
    state = decide("decode", CONFIG, overloaded, state, 0, planned=4).state
    up = decide("decode", CONFIG, overloaded, state, 31, planned=4)
    assert up.target == 6 and up.reason.startswith("scale up")
    state = up.state
    for now in (40, 100, 200):
        state = decide("decode", CONFIG, quiet(6), state, now, planned=4).state
        assert state.target == 6
    down = decide("decode", CONFIG, quiet(6), state, 341, planned=4)
    assert down.target == 4  # the plan, not the 1 an idle pool asks for


def test_the_plan_is_bounded_and_a_manual_override_still_wins():
    assert decide("decode", CONFIG, quiet(9), PolicyState(9), 0, planned=50).target == 10
    manual = decide("decode", CONFIG, quiet(2), PolicyState(2, override=2), 0, planned=8)
    assert manual.target == 2 and "manual" in manual.reason


def scaled_run(planned: int | None):
    from planner.profile import DecodeCost, LinearCost, PrefillCost, Profile, StepCosts
    from planner.scaling import PoolScaler
    from planner.sim import Layout, Simulator
    from planner.workload import parse

    step = StepCosts(PrefillCost(0.002, 1e-4), DecodeCost(0.01, 2e-3))
    profile = Profile({1: step}, {"grpc": LinearCost(0.001, 0.0)}, LinearCost(0.0, 0.0), 1024)
    workload = parse({
        "arrival": {"process": "poisson", "rate": 40.0}, "requests": 1500,
        "classes": [{"prompt": {"dist": "fixed", "value": 32}, "output": {"dist": "fixed", "value": 64}}],
    })  # fmt: skip
    sim = Simulator(profile, Layout(0, 1))
    config = AutoscalingConfig(
        max_replicas=4, upscale_delay_s=2, downscale_delay_s=5, interval_s=1, target_running_seqs=8, max_step=4
    )
    scaler = PoolScaler(sim, "decode", config, slo_s=0.05, planned=planned, start_s=3)
    scaler.start()
    return sim.run(workload), scaler


def test_the_simulated_pool_scales_on_the_real_policy():
    result, scaler = scaled_run(None)
    assert result.requests == 1500
    assert scaler.decisions and scaler.decisions[0][0] >= 2 and "scale up" in scaler.decisions[0][2]
    assert 1 < result.workers["decode"] <= 4


def test_a_planned_pool_starts_at_its_plan():
    result, scaler = scaled_run(4)
    assert scaler.decisions[0][:2] == (1.0, 4) and "plan" in scaler.decisions[0][2]
    baseline, _ = scaled_run(None)
    assert sorted(result.ttft)[len(result.ttft) // 2] < sorted(baseline.ttft)[len(baseline.ttft) // 2]
