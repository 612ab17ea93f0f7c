"""The autoscaling policy with a fake clock: sustained load scales up, noise does not flap, bounds
and delays hold, a manual override wins until cleared."""

from __future__ import annotations

import itertools
import random

from cluster.autoscaling import PolicyState, Signals, decide, wanted
from cluster.config import AutoscalingConfig

CONFIG = AutoscalingConfig(
    min_replicas=1, max_replicas=4, upscale_delay_s=10, downscale_delay_s=60, max_step=1,
    target_queued_prompt_tokens=1000, target_running_seqs=8, target_kv_cache_usage=0.5,
)  # fmt: skip


def run(role: str, signals_at, seconds: int, state: PolicyState, step_s: float = 1.0):
    """Steps the policy once a second; returns the final state and every target seen."""
    targets = []
    for i in range(int(seconds / step_s)):
        now = i * step_s
        state = decide(role, CONFIG, signals_at(now, state.target), state, now).state
        targets.append(state.target)
    return state, targets


def test_each_pool_reads_its_own_signals():
    assert wanted("prefill", CONFIG, Signals(2, queued_prompt_tokens=5000))[0] == 5
    assert wanted("prefill", CONFIG, Signals(2, running_seqs=100))[0] == 0  # decode load does not move prefill
    assert wanted("decode", CONFIG, Signals(2, running_seqs=40))[0] == 5
    assert wanted("decode", CONFIG, Signals(2, kv_cache_usage=0.75))[0] == 3
    assert wanted("decode", CONFIG, Signals(1, queued_prompt_tokens=10**6))[0] == 0
    slow = Signals(2, latency_s=0.3, latency_target_s=0.1)
    assert wanted("decode", CONFIG, slow) == (6, "TPOT against its SLO at 300% of target")


def test_sustained_load_scales_up_one_step_per_delay_up_to_the_maximum():
    busy = lambda now, n: Signals(n, running_seqs=100)  # noqa: E731
    state, targets = run("decode", busy, 60, PolicyState(1))
    assert targets[8] == 1, "not before the upscale delay"
    assert targets[10] == 2
    assert max(targets) == 4 and state.target == 4, "bounded by max_replicas"
    assert all(b - a <= 1 for a, b in itertools.pairwise(targets)), "at most max_step at a time"


def test_noise_does_not_flap():
    rng = random.Random(0)
    # Load that crosses the target every few seconds, never staying above it for the upscale delay.
    noisy = lambda now, n: Signals(n, running_seqs=12 if rng.random() < 0.3 else 4)  # noqa: E731
    _, targets = run("decode", noisy, 300, PolicyState(1))
    assert set(targets) == {1}


def test_downscale_waits_for_its_delay_and_stops_at_the_minimum():
    idle = lambda now, n: Signals(n)  # noqa: E731
    state, targets = run("prefill", idle, 200, PolicyState(3))
    assert targets[58] == 3, "not before the downscale delay"
    assert targets[60] == 2
    assert state.target == 1 and min(targets) == 1, "bounded by min_replicas"


def test_a_dip_resets_the_downscale_clock():
    def dips(now, n):
        return Signals(n, queued_prompt_tokens=3000 if int(now) % 50 == 49 else 0)

    _, targets = run("prefill", dips, 200, PolicyState(3))
    assert set(targets) == {3}


def test_manual_override_wins_until_cleared():
    busy = lambda now, n: Signals(n, running_seqs=100)  # noqa: E731
    state, targets = run("decode", busy, 60, PolicyState(2, override=1))
    assert set(targets) == {1}
    decision = decide("decode", CONFIG, busy(0, 1), state, 0)
    assert decision.reason.startswith("manual override")
    cleared = PolicyState(state.target)
    _, targets = run("decode", busy, 30, cleared)
    assert targets[-1] > 1
