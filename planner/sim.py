"""The discrete-event simulator: a cluster's request path under a simulated clock.

    result = simulate(profile, layout, workload, seed=0)

One heap of timed events, O(log n) each: an arrival (drawn lazily from the workload), a worker's
step ending, a KV transfer landing, the autoscaler's tick. Workers (`planner.workers`) run the
real schedulers and block managers and charge each step the profile's time; placement is the
router's rule (`planner.routing`). The path of a request:

    arrival + router cost -> placement -> local: decode worker prefills and decodes
                                       -> remote: prefill worker -> transfer (profile) -> decode intake

The first token reaches the client when its prefill ends (plus the transfer for a remote
prefill) and every token pays the router's per-token cost on its way out. Same seed, same result.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from cluster.config import SchedulerConfig
from cluster.engine.block_manager import BlockManager
from cluster.engine.request import Request, SamplingParams
from planner.profile import Profile
from planner.report import Recorder, SimResult
from planner.routing import Placer
from planner.workers import DecodeWorker, PrefillWorker
from planner.workload import Arrival, Workload, arrivals
from router.placement.placement import NoCapacity


@dataclass(frozen=True)
class Layout:
    """A cluster to simulate. `prefill=0` is colocated: every prompt prefills on its decode worker."""

    prefill: int
    decode: int
    local_prefill_max_tokens: int = 64
    decode_scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    prefill_scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    decode_blocks: int = 4096
    prefill_blocks: int = 4096
    prefill_threads: int = 1
    decode_threads: int = 1
    transport: str = "grpc"
    compiled: bool = False
    watermark: float = 0.01
    prefix_caching: bool = True
    macro_steps: int = 16  # decode steps a worker may plan as one run when nothing changes (1: step by step)

    def __post_init__(self) -> None:
        if self.decode < 1 or self.prefill < 0:
            raise ValueError(f"a layout needs a decode worker and no negative pool, not {self.prefill}P:{self.decode}D")

    @property
    def workers(self) -> int:
        return self.prefill + self.decode

    @property
    def name(self) -> str:
        return f"colocated x{self.decode}" if self.prefill == 0 else f"{self.prefill}P:{self.decode}D"


class Simulator:
    def __init__(
        self, profile: Profile, layout: Layout, seed: int = 0, itl_every: int = 20, exact_up_to: int = 64
    ) -> None:
        self.profile = profile
        self.layout = layout
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[float], None]]] = []
        self._seq = itertools.count()
        self.recorder = Recorder(profile.router, itl_every)
        self._costs = {
            "decode": profile.step_costs(layout.decode_threads),
            "prefill": profile.step_costs(layout.prefill_threads),
        }
        self.decode: dict[str, DecodeWorker] = {}
        self.prefill: dict[str, PrefillWorker] = {}
        self.retired: list[tuple[DecodeWorker | PrefillWorker, float]] = []  # (worker, when it stopped)
        self._born: dict[str, float] = {}
        self._count = itertools.count()
        local = layout.local_prefill_max_tokens if layout.prefill else 10**12
        self.placer = Placer(self._load, profile.block_size, local, exact_up_to=exact_up_to, seed=seed)
        for _ in range(layout.decode):
            self.add_worker("decode", 0.0)
        for _ in range(layout.prefill):
            self.add_worker("prefill", 0.0)
        self._targets: dict[str, str] = {}  # request id -> its decode worker (remote prefills)
        self._transfer_s = lambda n: profile.transfer_s(layout.transport, n) if layout.prefill else 0.0
        self.pending_arrivals = True
        self.scalers: list = []  # planner.scaling.PoolScaler, when the pools autoscale

    def add_worker(self, role: str, now: float) -> None:
        layout, name = self.layout, f"{role}-{next(self._count)}"
        if role == "decode":
            blocks = self._blocks(layout.decode_blocks)
            self.decode[name] = DecodeWorker(
                name, self, self._costs[role], blocks, layout.decode_scheduler, layout.compiled, layout.macro_steps
            )
        else:
            blocks = self._blocks(layout.prefill_blocks)
            self.prefill[name] = PrefillWorker(
                name, self, self._costs[role], blocks, layout.prefill_scheduler, self._ship
            )
        self._born[name] = now
        self._placeable()

    def drain(self, worker: DecodeWorker | PrefillWorker) -> None:
        """Takes a worker out of placement; `retire_idle` stops it once its work is done."""
        worker.draining = True
        self._placeable()

    def retire_idle(self, now: float) -> None:
        for pool in (self.decode, self.prefill):
            for name, worker in list(pool.items()):
                if worker.draining and worker.idle and name not in self._targets.values():
                    del pool[name]
                    self.retired.append((worker, now))

    def _placeable(self) -> None:
        self.placer.set_workers(
            [n for n, w in self.decode.items() if not w.draining],
            [n for n, w in self.prefill.items() if not w.draining],
        )

    @property
    def busy(self) -> bool:
        """Requests still in flight, or still to arrive."""
        return self.pending_arrivals or bool(self.recorder.live)

    def _blocks(self, n: int) -> BlockManager:
        return BlockManager(n, self.profile.block_size, self.layout.watermark, self.layout.prefix_caching)

    def _load(self, name: str):  # type: ignore[no-untyped-def]
        worker = self.decode.get(name) or self.prefill[name]
        return worker.refresh()

    # -- the clock workers see ---------------------------------------------------------------------

    def at(self, time: float, event: Callable[[float], None]) -> None:
        heapq.heappush(self._heap, (time, next(self._seq), event))

    def token(self, request_id: str, now: float) -> None:
        self.recorder.token(request_id, now)

    def tokens(self, request_id: str, start: float, ends: Sequence[float]) -> None:
        self.recorder.tokens(request_id, start, ends)

    def started(self, request_id: str, stage: str, now: float) -> None:
        self.recorder.started(request_id, stage, now)

    def finished(self, request: Request, now: float) -> None:
        ttft, tpot = self.recorder.finish(request.request_id, now)
        for scaler in self.scalers:
            scaler.observe(ttft, tpot)

    # -- a request's path ----------------------------------------------------------------------------

    def _arrive(self, n: int, a: Arrival, now: float) -> None:
        rid = f"r{n}"
        prompt = _prompt(n, a)
        params = SamplingParams(max_tokens=a.output_tokens, ignore_eos=True)
        self.recorder.arrive(rid, a.time, a.prompt_tokens)
        try:
            choice = self.placer.choose(prompt, a.output_tokens)
        except NoCapacity:
            self.recorder.reject(rid)
            return
        decode = self.decode[choice.decode]
        try:
            if choice.prefill is None:
                self.recorder.stage(rid, "decode", now)
                decode.add(Request(rid, prompt, params), now)
            else:
                self._targets[rid] = choice.decode
                self.recorder.stage(rid, "prefill", now)
                self.prefill[choice.prefill].add(Request(rid, prompt, params), now)
        except ValueError:  # can never fit this worker's cache
            self.recorder.reject(rid)

    def _ship(self, worker: PrefillWorker, request: Request, now: float) -> None:
        landed = now + self._transfer_s(request.num_tokens)
        decode = self.decode[self._targets.pop(request.request_id)]

        def land(t: float) -> None:
            worker.scheduler.release(request.request_id)
            worker.kick(t)  # freed blocks may admit a waiting prompt
            self.recorder.token(request.request_id, t)
            self.recorder.stage(request.request_id, "intake", t)
            moved = Request(request.request_id, request.prompt_token_ids, request.params)
            decode.receive(moved, t)

        self.at(landed, land)

    # -- running -----------------------------------------------------------------------------------

    def run(
        self, workload: Workload, seed: int = 0, until: float | None = None, stream: Iterable[Arrival] | None = None
    ) -> SimResult:
        """Serves `workload`'s arrivals (or `stream`, arrivals drawn elsewhere) until the last finishes."""
        numbered = enumerate(arrivals(workload, seed) if stream is None else stream)

        def next_arrival() -> None:
            item = next(numbered, None)
            if item is None:
                self.pending_arrivals = False
                return
            n, a = item
            self.at(a.time + self.profile.router.base_s, lambda t: (self._arrive(n, a, t), next_arrival()))

        next_arrival()
        heap = self._heap
        while heap:
            time, _, event = heapq.heappop(heap)
            if until is not None and time > until:
                break
            self.now = time
            event(time)
        born, end = self._born, self.now
        lives = [(w, end - born[w.name]) for w in (*self.prefill.values(), *self.decode.values())]
        lives += [(w, stopped - born[w.name]) for w, stopped in self.retired]
        return self.recorder.result_for(self.layout.name, self.now, lives)


def _prompt(n: int, a: Arrival) -> list[int]:
    """Token ids whose only shared blocks are a group's prefix: equal prefixes hit the prefix cache."""
    head = list(range(10**6 * (a.prefix_group + 2), 10**6 * (a.prefix_group + 2) + a.prefix_tokens))
    base = 10**12 + n * 10**6
    return head + list(range(base, base + a.prompt_tokens - a.prefix_tokens))


def simulate(profile: Profile, layout: Layout, workload: Workload, seed: int = 0) -> SimResult:
    return Simulator(profile, layout, seed).run(workload, seed)


__all__ = ["Layout", "SimResult", "Simulator", "simulate"]
