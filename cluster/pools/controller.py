"""A pool's controller: reconciles the pool toward the autoscaler's target. No Ray here: the worker
operations come in as `WorkerOps` (Ray actors in `cluster.pools.ray_cluster`, a fake in tests).

Each `tick(now)`:

    read      every serving worker's load (and the router's recent TTFT / TPOT)
    decide    `cluster.pools.autoscaling.decide` -> the target and its reason (logged and counted); with
              a planned target (`set_plan`, or the config's `planned_replicas`), the predictive mode
    grow      start workers named `<role>-<n>` until the serving count reaches the target
    shrink    drain the surplus, the least loaded first: the worker reports itself draining, so the
              router sends it nothing new; it finishes its running sequences and outstanding KV
              transfers
    retire    stop a draining worker once nothing remains on it and `drain_grace_s` has passed
              since it began draining (a request placed just before the drain is still counted)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from tandem.v1 import worker_pb2

from cluster.config import PoolConfig, SLOConfig
from cluster.pools.autoscaling import Decision, PolicyState, Signals, decide

log = logging.getLogger("tandem.autoscaler")


class WorkerOps(Protocol):
    def start(self, name: str) -> None:
        """Starts a worker (returns at once; it serves once `load` answers)."""
        ...

    def load(self, name: str) -> worker_pb2.WorkerLoad | None:
        """The worker's load, or None while it is starting or unreachable."""
        ...

    def drain(self, name: str) -> int:
        """Stops the worker taking new work (idempotent); returns what remains on it."""
        ...

    def stop(self, name: str) -> None: ...

    def latency(self) -> tuple[float | None, float | None]:
        """The router's recent TTFT and TPOT (p90), when known."""
        ...


@dataclass
class PoolController:
    role: str
    pool: PoolConfig
    slo: SLOConfig
    ops: WorkerOps
    clock: Callable[[], float] = time.monotonic
    serving: list[str] = field(default_factory=list)
    draining: dict[str, float] = field(default_factory=dict)  # name -> when its drain began
    last: Decision | None = None
    scale_ups: int = 0
    scale_downs: int = 0
    planned: int | None = None  # the planner's target (predictive mode); None: the signals alone
    _next_index: int = 0
    _state: PolicyState | None = None

    def __post_init__(self) -> None:
        self._state = PolicyState(self.pool.replicas)
        if self.planned is None:
            self.planned = self.pool.autoscaling.planned_replicas

    def start(self) -> list[str]:
        """Starts the pool's initial workers; returns their names."""
        for _ in range(self.pool.replicas):
            self._grow()
        return list(self.serving)

    def set_override(self, replicas: int | None) -> None:
        assert self._state is not None
        self._state = PolicyState(self._state.target, override=replicas)

    def set_plan(self, planned: int | None) -> None:
        """The planner's target for the pool (None clears it); the next tick acts on it."""
        self.planned = planned

    def tick(self, now: float | None = None) -> Decision:
        now = self.clock() if now is None else now
        assert self._state is not None
        loads = [load for name in self.serving if (load := self.ops.load(name)) is not None]
        decision = decide(self.role, self.pool.autoscaling, self._signals(loads), self._state, now, self.planned)
        if decision.target != self._state.target:
            direction = "up" if decision.target > self._state.target else "down"
            self.scale_ups += direction == "up"
            self.scale_downs += direction == "down"
            log.info("%s pool: %d -> %d workers (%s)", self.role, self._state.target, decision.target, decision.reason)
        self._state, self.last = decision.state, decision
        while len(self.serving) < decision.target:
            self._grow()
        if len(self.serving) > decision.target:
            by_load = sorted(
                self.serving, key=lambda n: _busy(self.ops.load(n)), reverse=False
            )  # least loaded drains first
            for name in by_load[: len(self.serving) - decision.target]:
                self.begin_drain(name, now)
        self._retire(now)
        return decision

    def begin_drain(self, name: str, now: float | None = None) -> None:
        """Takes `name` out of service; it is stopped once nothing remains on it."""
        if name in self.serving:
            self.serving.remove(name)
            self.draining[name] = self.clock() if now is None else now
            self.ops.drain(name)
            log.info("%s pool: draining %s", self.role, name)

    def status(self) -> worker_pb2.PoolStatus:
        assert self._state is not None
        a = self.pool.autoscaling
        status = worker_pb2.PoolStatus(
            role=self.role, target=self._state.target, workers=self.serving, draining=sorted(self.draining),
            reason=self.last.reason if self.last else "starting", min_replicas=a.min_replicas,
            max_replicas=a.max_replicas, scale_ups=self.scale_ups, scale_downs=self.scale_downs,
        )  # fmt: skip
        if self._state.override is not None:
            status.override = self._state.override
        if self.planned is not None:
            status.planned = self.planned
        return status

    def stop_all(self) -> None:
        for name in [*self.serving, *self.draining]:
            self.ops.stop(name)
        self.serving.clear()
        self.draining.clear()

    # -- internals ---------------------------------------------------------------------------------

    def _grow(self) -> None:
        name = f"{self.role}-{self._next_index}"
        self._next_index += 1
        self.ops.start(name)
        self.serving.append(name)

    def _retire(self, now: float) -> None:
        for name, since in list(self.draining.items()):
            if now - since < self.pool.autoscaling.drain_grace_s:
                continue
            if self.ops.drain(name) == 0:
                self.ops.stop(name)
                del self.draining[name]
                log.info("%s pool: stopped %s after draining", self.role, name)

    def _signals(self, loads: list[worker_pb2.WorkerLoad]) -> Signals:
        ttft, tpot = self.ops.latency()
        latency, target = (ttft, self.slo.ttft_s) if self.role == "prefill" else (tpot, self.slo.tpot_s)
        usage = [1 - load.free_kv_blocks / load.total_kv_blocks for load in loads if load.total_kv_blocks]
        return Signals(
            workers=len(self.serving),
            queued_prompt_tokens=sum(load.queued_prompt_tokens for load in loads),
            running_seqs=sum(load.running_seqs + load.waiting_seqs for load in loads),
            kv_cache_usage=sum(usage) / len(usage) if usage else 0.0,
            latency_s=latency,
            latency_target_s=target,
        )


def _busy(load: worker_pb2.WorkerLoad | None) -> tuple[int, int]:
    if load is None:
        return (0, 0)
    return (load.running_seqs + load.waiting_seqs, load.total_kv_blocks - load.free_kv_blocks)
