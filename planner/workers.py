"""Simulated workers: the real schedulers and block managers, with a step's time from the profile.

Lifecycle of a simulated worker, driven by the simulator's event heap:

    add(request)          a request arrives (a prompt to prefill, or one to prefill and decode here)
    kick(now)             idle with work: plan = scheduler.schedule(), charge its time, wake at the end
    step_done(now, plan)  scheduler.update(plan, ...) with a token per sampling row; then kick again

A decode worker also takes transferred requests (`intake`): they wait until blocks and a batch slot
are free, then `allocate` + `Scheduler.admit` as `decode_worker.engine.Engine.reserve` / `admit`
do. A worker with nothing to do costs nothing: no event is scheduled for it.

Runs of decode steps: while a decode worker's batch is all decode rows, nothing waits, and no
request can finish sooner, the next `k` steps (up to `macro_steps`) change nothing but lengths.
They are planned as one pass that keeps `k` tokens a row: the scheduler's speculative path
(`speculate` with `k - 1` drafts, every one accepted by `update`), charged the `k` steps' times.
A request that arrives meanwhile cuts the run at the end of the step in flight (`update` keeps
that many tokens and trims the rest, as for rejected drafts), so it joins the batch exactly when
it would have step by step. Tokens are stamped with their own step's end.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Sequence
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

    def tokens(self, request_id: str, start: float, ends: Sequence[float]) -> None: ...

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
        self,
        name: str,
        clock: Clock,
        costs: StepCosts,
        blocks: BlockManager,
        config: SchedulerConfig,
        compiled: bool,
        macro_steps: int = 16,
    ) -> None:
        super().__init__(name, clock, costs, blocks, compiled)
        self.scheduler = Scheduler(config, blocks)
        self.intake: deque[Request] = deque()  # transferred, waiting for blocks and a batch slot
        self.macro_steps = macro_steps
        self._run: tuple[StepPlan, float, list[float]] | None = None  # plan, start, each step's end after start
        self._generation = 0  # a cut run's end event finds a newer generation and does nothing

    @property
    def idle(self) -> bool:
        return not (self.busy or self.scheduler.has_work or self.intake)

    def add(self, request: Request, now: float) -> None:
        self.scheduler.add(request)
        self._cut(now)
        self.kick(now)

    def receive(self, request: Request, now: float) -> None:
        """A request whose prompt KV arrived by transfer, with its first token."""
        self.intake.append(request)
        self._admit(now)
        self._cut(now)
        self.kick(now)

    def refresh(self) -> worker_pb2.WorkerLoad:
        s, load = self.scheduler, self.load
        load.running_seqs = len(s.running)
        load.waiting_seqs = len(s.waiting) + len(self.intake)
        load.free_kv_blocks = self.blocks.num_free_blocks
        load.draining = self.draining
        return load

    def kick(self, now: float) -> None:
        if self.busy:
            return
        plan = self.scheduler.schedule()
        if not plan.chunks:
            return
        k = self._run_length(plan)
        if k > 1:
            rows, context = len(plan.chunks), sum(c.start + 1 for c in plan.chunks)
            first = self.costs.step_s(0.0, rows, context, self.compiled)
            growth = self.costs.step_s(0.0, rows, context + rows, self.compiled) - first  # each step reads `rows` more
            ends = [(i + 1) * first + growth * i * (i + 1) / 2 for i in range(k)]
            plan = self.scheduler.speculate(plan, {c.request.request_id: _DRAFTS[k - 1] for c in plan.chunks})
        else:
            ends = [plan_time(self.costs, plan, self.compiled)]
            for c in plan.chunks:
                if c.start == c.request.num_cached_tokens and c.request.num_preemptions == 0:
                    self.clock.started(c.request.request_id, self.role, now)
        self.busy = True
        self.steps += len(ends)
        self.busy_s += ends[-1]
        self._run = (plan, now, ends)
        self._generation += 1
        generation, n = self._generation, len(ends)
        self.clock.at(now + ends[-1], lambda t: self._end(t, n) if generation == self._generation else None)

    def _run_length(self, plan: StepPlan) -> int:
        s = self.scheduler
        if self.macro_steps <= 1 or s.waiting or self.intake or plan.preempted:
            return 1
        k = min(self.macro_steps, s.config.max_num_batched_tokens // len(plan.chunks))
        for c in plan.chunks:
            if c.num_new != 1 or not c.samples or c.start == 0:
                return 1
            r = c.request
            k = min(k, r.params.max_tokens - len(r.output_token_ids))
        room = -(-k // self.blocks.block_size) + 1  # blocks a row may need for k more tokens
        return k if k > 1 and self.blocks.num_free_blocks >= room * len(plan.chunks) else 1

    def _cut(self, now: float) -> None:
        """Ends a run of steps at the end of the step in flight, so a new request joins the next."""
        if self._run is None or not self.busy:
            return
        plan, start, ends = self._run
        done = bisect.bisect_left(ends, now - start) + 1
        if done >= len(ends):
            return
        self.steps -= len(ends) - done
        self.busy_s -= ends[-1] - ends[done - 1]
        self._run = (plan, start, ends[:done])
        self._generation += 1
        generation = self._generation
        self.clock.at(start + ends[done - 1], lambda t: self._end(t, done) if generation == self._generation else None)

    def _end(self, now: float, n: int) -> None:
        assert self._run is not None
        plan, start, ends = self._run
        self.busy, self._run = False, None
        sampled = {c.request.request_id: _DRAFTS[min(n, 1 + len(c.draft))] for c in plan.chunks if c.samples}
        for request in self.scheduler.update(plan, sampled):
            self.clock.tokens(request.request_id, start, ends[: len(sampled[request.request_id])])
            if request.finished:
                self.clock.finished(request, now)
        self._admit(now)
        self.kick(now)

    def _admit(self, now: float) -> None:
        s = self.scheduler
        while self.intake and len(s.running) < s.config.max_num_seqs:
            request = self.intake[0]
            tokens = request.all_token_ids
            if not self.blocks.can_allocate(tokens, scope=request.scope):
                return
            self.intake.popleft()
            self.blocks.allocate(request.request_id, tokens, scope=request.scope)
            self.clock.started(request.request_id, "intake", now)
            s.admit(request, TOKEN)
            if request.finished:
                self.clock.finished(request, now)


_DRAFTS = [(TOKEN,) * n for n in range(257)]  # n tokens of TOKEN, shared


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
