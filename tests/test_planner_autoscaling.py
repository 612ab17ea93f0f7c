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
