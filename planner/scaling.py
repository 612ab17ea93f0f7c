"""The pool controllers in the simulator: the real autoscaling policy on simulated signals.

    scaler = PoolScaler(sim, "decode", config, slo_s=0.1, planned=None, start_s=20.0)
    scaler.start()      # before sim.run: decides every config.interval_s while requests are in flight

Every `interval_s` each pool's scaler reads its workers as `cluster.pools.controller` reads the
real ones (queued prompt tokens, running sequences, KV cache use, and the p90 TTFT or TPOT of the
requests finished in the last `window_s`, through `cluster.slo.SLOWindow` on the simulated clock)
and calls `cluster.pools.autoscaling.decide` (with `planned`, the predictive mode). A new worker
serves `start_s` after it was asked for; a worker scaled away is drained (out of placement) and
stops when its work is done. A pool's goodput per worker then counts its mean workers.
"""

from __future__ import annotations

from cluster.config import AutoscalingConfig
from cluster.pools.autoscaling import PolicyState, Signals, decide
from cluster.slo import SLOWindow


class PoolScaler:
    def __init__(
        self,
        sim,  # planner.sim.Simulator  # type: ignore[no-untyped-def]
        role: str,
        config: AutoscalingConfig,
        slo_s: float,
        planned: int | None = None,
        start_s: float = 20.0,
        window_s: float = 30.0,
    ) -> None:
        self.sim = sim
        self.role = role
        self.config = config
        self.slo_s = slo_s
        self.planned = planned
        self.start_s = start_s
        self.window = SLOWindow(window_s, clock=lambda: sim.now)
        self.state = PolicyState(len(self._pool()))
        self.starting = 0
        self.decisions: list[tuple[float, int, str]] = []

    def _pool(self) -> dict:
        return self.sim.decode if self.role == "decode" else self.sim.prefill

    def start(self) -> None:
        self.sim.scalers.append(self)
        self.sim.at(self.config.interval_s, self.tick)

    def observe(self, ttft: float, tpot: float | None) -> None:
        self.window.record(True, ttft, tpot)

    def signals(self) -> Signals:
        serving = [w for w in self._pool().values() if not w.draining]
        ttft, tpot = self.window.latency(90)
        if self.role == "prefill":
            queued = sum(w.queued_tokens for w in serving)
            return Signals(len(serving), queued_prompt_tokens=queued, latency_s=ttft, latency_target_s=self.slo_s)
        running = sum(len(w.scheduler.running) + len(w.scheduler.waiting) for w in serving)
        usage = sum(w.blocks.usage for w in serving) / max(1, len(serving))
        return Signals(
            len(serving), running_seqs=running, kv_cache_usage=usage, latency_s=tpot, latency_target_s=self.slo_s
        )

    def tick(self, now: float) -> None:
        self.sim.retire_idle(now)
        decision = decide(self.role, self.config, self.signals(), self.state, now, self.planned)
        self.state = decision.state
        serving = [w for w in self._pool().values() if not w.draining]
        have = len(serving) + self.starting
        if decision.target != have:
            self.decisions.append((now, decision.target, decision.reason))
        for _ in range(decision.target - have):
            self.starting += 1
            self.sim.at(now + self.start_s, self._started)
        if decision.target < have:  # the newest go first
            keep = max(0, decision.target - self.starting)
            for worker in sorted(serving, key=lambda w: int(w.name.rsplit("-", 1)[1]))[keep:]:
                self.sim.drain(worker)
        if self.sim.busy:
            self.sim.at(now + self.config.interval_s, self.tick)

    def _started(self, now: float) -> None:
        self.starting -= 1
        self.sim.add_worker(self.role, now)
