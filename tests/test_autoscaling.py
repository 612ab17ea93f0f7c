"""The autoscaling policy with a fake clock: sustained load scales up, noise does not flap, bounds
and delays hold, a manual override wins until cleared."""

from __future__ import annotations

import itertools
import random

from cluster.config import AutoscalingConfig
from cluster.pools.autoscaling import PolicyState, Signals, decide, wanted

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
    slow = Signals(2, running_seqs=2, latency_s=0.3, latency_target_s=0.1)
    assert wanted("decode", CONFIG, slow) == (6, "TPOT against its SLO at 300% of target")
    assert wanted("decode", CONFIG, Signals(2, latency_s=0.3, latency_target_s=0.1))[0] == 0, "idle: latency is stale"


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


class FakeWorkers:
    """`WorkerOps` over dicts: what remains on each worker is set by the test."""

    def __init__(self) -> None:
        self.running: dict[str, int] = {}
        self.draining: set[str] = set()
        self.stopped: list[str] = []

    def start(self, name):
        self.running[name] = 0

    def load(self, name):
        from tandem.v1 import worker_pb2

        return worker_pb2.WorkerLoad(
            running_seqs=self.running[name], total_kv_blocks=100, free_kv_blocks=100, draining=name in self.draining
        )

    def drain(self, name):
        self.draining.add(name)
        return self.running[name]

    def stop(self, name):
        self.stopped.append(name)
        del self.running[name]

    def latency(self):
        return None, None


def controller(replicas=2, **autoscaling):
    from cluster.config import PoolConfig, SLOConfig
    from cluster.pools.controller import PoolController

    bounds = dict(min_replicas=1, max_replicas=3, upscale_delay_s=0, downscale_delay_s=0, drain_grace_s=2)
    pool = PoolConfig(replicas=replicas, autoscaling={**bounds, **autoscaling})
    ops = FakeWorkers()
    c = PoolController("decode", pool, SLOConfig(), ops)
    c.start()
    return c, ops


def test_scale_down_drains_the_least_loaded_and_stops_it_only_when_empty():
    c, ops = controller()
    ops.running.update({"decode-0": 3, "decode-1": 1})
    c.set_override(1)
    c.tick(now=0.0)
    assert c.serving == ["decode-0"] and set(c.draining) == {"decode-1"}
    assert "decode-1" in ops.draining and ops.stopped == []
    c.tick(now=5.0)
    assert ops.stopped == [], "a worker with a sequence left is not stopped"
    ops.running["decode-1"] = 0
    c.tick(now=5.5)
    assert ops.stopped == ["decode-1"] and not c.draining
    status = c.status()
    assert status.target == 1 and status.override == 1 and list(status.workers) == ["decode-0"]


def test_a_drained_worker_waits_out_the_grace_period():
    c, ops = controller()
    c.set_override(1)
    c.tick(now=10.0)
    c.tick(now=11.0)
    assert ops.stopped == [], "requests placed just before the drain may still arrive"
    c.tick(now=12.5)
    assert len(ops.stopped) == 1


def test_scale_up_starts_new_names_and_autoscaling_resumes_after_the_override():
    c, ops = controller(replicas=1, target_running_seqs=2)
    ops.running["decode-0"] = 10
    c.set_override(1)
    c.tick(now=0.0)
    assert c.serving == ["decode-0"]
    c.set_override(None)
    c.tick(now=1.0)
    assert c.serving == ["decode-0", "decode-1"] and c.status().scale_ups == 1
    assert "scale up: running sequences" in c.status().reason


def test_a_planned_target_grows_the_pool_at_once_and_holds_it_while_the_signals_ask_for_less():
    c, _ = controller(replicas=1, max_replicas=4, max_step=4, upscale_delay_s=60, downscale_delay_s=0)
    c.set_plan(3)
    c.tick(now=0.0)
    assert c.serving == ["decode-0", "decode-1", "decode-2"], "the plan needs no upscale delay"
    status = c.status()
    assert status.planned == 3 and status.target == 3 and "scale up to plan" in status.reason
    c.tick(now=100.0)  # idle pool: the signals alone would drain to the minimum
    assert len(c.serving) == 3 and not c.draining


def test_the_signals_take_a_planned_pool_above_its_plan_and_clearing_the_plan_lets_it_shrink():
    c, ops = controller(replicas=1, max_replicas=4, target_running_seqs=2, upscale_delay_s=5, downscale_delay_s=0)
    c.set_plan(2)
    c.tick(now=0.0)
    ops.running.update({"decode-0": 4, "decode-1": 4})  # 4 a worker against a target of 2: 4 workers wanted
    c.tick(now=1.0)
    assert len(c.serving) == 2, "above the plan, the signals keep their delay"
    c.tick(now=7.0)
    assert len(c.serving) == 3
    ops.running.update({name: 0 for name in ops.running})
    c.tick(now=8.0)
    assert len(c.serving) == 2, "back down to the plan, not below it"
    c.set_plan(None)
    c.tick(now=9.0)
    assert len(c.serving) == 1 and not c.status().HasField("planned")


def test_the_configs_planned_replicas_is_the_initial_plan():
    c, _ = controller(replicas=1, planned_replicas=2)
    assert c.planned == 2
    c.tick(now=0.0)
    assert len(c.serving) == 2
