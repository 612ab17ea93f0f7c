"""Simulated workers: the real schedulers and block managers, with a step's time from the profile.

Lifecycle of a simulated worker, driven by the simulator's event heap:

    add(request)          a request arrives (a prompt to prefill, or one to prefill and decode here)
    kick(now)             idle with work: plan = scheduler.schedule(), charge its time, wake at the end
    step_done(now, plan)  scheduler.update(plan, ...) with a token per sampling row; then kick again

A decode worker also takes transferred requests (`intake`): they wait until blocks and a batch slot
are free, then `allocate` + `Scheduler.admit` as `decode_worker.engine.Engine.reserve` / `admit`
do. A worker with nothing to do costs nothing: no event is scheduled for it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Protocol

from tandem.v1 import worker_pb2

from cluster.config import SchedulerConfig
from cluster.engine.block_manager import BlockManager
from cluster.engine.request import Request, StepPlan
from decode_worker.scheduler import Scheduler
from planner.profile import StepCosts
from prefill_worker.scheduler import PrefillScheduler

TOKEN = 1  # every simulated output token; no EOS is configured, so requests run to max_tokens


class Clock(Protocol):
    """What a worker needs of the simulator."""

    def at(self, time: float, event: Callable[[float], None]) -> None: ...

    def token(self, request_id: str, now: float) -> None: ...

    def started(self, request_id: str, stage: str, now: float) -> None: ...

    def finished(self, request: Request, now: float) -> None: ...


def plan_time(costs: StepCosts, plan: StepPlan, compiled: bool) -> float:
    """The profile's time for one pass over `plan`: prompt chunks and decode rows."""
    prefill_s, rows, context = 0.0, 0, 0
    chunk_s = costs.prefill.chunk_s
    for c in plan.chunks:
        if c.num_new == 1 and c.start > 0:
            rows += 1
            context += c.start + 1
        else:
            prefill_s += chunk_s(c.num_new, c.start)
    return costs.step_s(prefill_s, rows, context, compiled)


class _Worker:
    role = ""

    def __init__(self, name: str, clock: Clock, costs: StepCosts, blocks: BlockManager, compiled: bool) -> None:
        self.name = name
        self.clock = clock
        self.costs = costs
        self.blocks = blocks
        self.compiled = compiled
        self.busy = False
        self.busy_s = 0.0
        self.steps = 0
        self.draining = False
        self.load = worker_pb2.WorkerLoad(worker_id=name, role=self.role, total_kv_blocks=blocks.num_blocks)

    @property
    def idle(self) -> bool:
        raise NotImplementedError

    def kick(self, now: float) -> None:
        if self.busy:
            return
        plan = self._schedule()
        if not plan.chunks:
            return
        self.busy = True
        self.steps += 1
        cost = plan_time(self.costs, plan, self.compiled)
        self.busy_s += cost
        for c in plan.chunks:
            if c.start == c.request.num_cached_tokens and c.request.num_preemptions == 0:
                self.clock.started(c.request.request_id, self.role, now)
        self.clock.at(now + cost, lambda t: self.step_done(t, plan))

    def step_done(self, now: float, plan: StepPlan) -> None:
        raise NotImplementedError

    def _schedule(self) -> StepPlan:
        raise NotImplementedError


class DecodeWorker(_Worker):
    role = "decode"

    def __init__(
        self, name: str, clock: Clock, costs: StepCosts, blocks: BlockManager, config: SchedulerConfig, compiled: bool
    ) -> None:
        super().__init__(name, clock, costs, blocks, compiled)
        self.scheduler = Scheduler(config, blocks)
        self.intake: deque[Request] = deque()  # transferred, waiting for blocks and a batch slot

    @property
    def idle(self) -> bool:
        return not (self.busy or self.scheduler.has_work or self.intake)

    def add(self, request: Request, now: float) -> None:
        self.scheduler.add(request)
        self.kick(now)

    def receive(self, request: Request, now: float) -> None:
        """A request whose prompt KV arrived by transfer, with its first token."""
        self.intake.append(request)
        self._admit(now)
        self.kick(now)

    def refresh(self) -> worker_pb2.WorkerLoad:
        s, load = self.scheduler, self.load
        load.running_seqs = len(s.running)
        load.waiting_seqs = len(s.waiting) + len(self.intake)
        load.free_kv_blocks = self.blocks.num_free_blocks
        load.draining = self.draining
        return load

    def step_done(self, now: float, plan: StepPlan) -> None:
        self.busy = False
        sampled = {c.request.request_id: (TOKEN,) for c in plan.chunks if c.samples}
        for request in self.scheduler.update(plan, sampled):
            self.clock.token(request.request_id, now)
            if request.finished:
                self.clock.finished(request, now)
        self._admit(now)
        self.kick(now)

    def _admit(self, now: float) -> None:
        s = self.scheduler
        while self.intake and len(s.running) < s.config.max_num_seqs:
            request = self.intake[0]
            tokens = request.all_token_ids
            if not self.blocks.can_allocate(tokens):
                return
            self.intake.popleft()
            self.blocks.allocate(request.request_id, tokens)
            self.clock.started(request.request_id, "intake", now)
            s.admit(request, TOKEN)
            if request.finished:
                self.clock.finished(request, now)

    def _schedule(self) -> StepPlan:
        return self.scheduler.schedule()


class PrefillWorker(_Worker):
    role = "prefill"

    def __init__(
        self,
        name: str,
        clock: Clock,
        costs: StepCosts,
        blocks: BlockManager,
        config: SchedulerConfig,
        ship: Callable[[PrefillWorker, Request, float], None],
    ) -> None:
        super().__init__(name, clock, costs, blocks, compiled=False)
        self.scheduler = PrefillScheduler(config, blocks)
        self.ship = ship  # the simulator's: transfer the KV, then hand the request to its decode worker
        self.queued_tokens = 0  # kept as requests come and go (the scheduler's property walks its queue)

    @property
    def idle(self) -> bool:
        return not (self.busy or self.scheduler.has_work or self.scheduler.held)

    def add(self, request: Request, now: float) -> None:
        self.scheduler.add(request)
        self.queued_tokens += request.num_tokens
        self.kick(now)

    def refresh(self) -> worker_pb2.WorkerLoad:
        self.load.queued_prompt_tokens = self.queued_tokens
        self.load.free_kv_blocks = self.blocks.num_free_blocks
        self.load.draining = self.draining
        return self.load

    def step_done(self, now: float, plan: StepPlan) -> None:
        self.busy = False
        self.queued_tokens -= sum(c.num_new for c in plan.chunks)
        for request in self.scheduler.update(plan):
            self.queued_tokens -= request.num_cached_tokens
            self.ship(self, request, now)
        self.kick(now)

    def _schedule(self) -> StepPlan:
        return self.scheduler.schedule()
