"""What a simulation measured: each request's TTFT, TPOT, E2E (and ITL for a sample of them), the
wait in each stage's queue, and each pool's use; with the serving metrics of `cluster.slo`.

`Recorder` follows requests in flight (a short list each, dropped when the request finishes);
`SimResult` holds the finished ones' numbers and summarises them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from cluster.slo import Targets, percentile
from planner.profile import LinearCost

# a request in flight: [arrival, first token, last token, tokens, stage, stage entered, gaps or None]
_ARRIVAL, _FIRST, _LAST, _TOKENS, _STAGE, _ENTERED, _GAPS = range(7)


@dataclass
class SimResult:
    layout: str
    duration_s: float
    ttft: list[float] = field(default_factory=list)
    tpot: list[float | None] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    queue: dict[str, list[float]] = field(default_factory=dict)  # stage -> waits
    busy_s: dict[str, float] = field(default_factory=dict)  # pool -> summed busy seconds
    workers: dict[str, float] = field(default_factory=dict)  # pool -> mean workers over the run
    steps: int = 0
    rejected: int = 0

    @property
    def requests(self) -> int:
        return len(self.ttft)

    def attained(self, targets: Targets) -> int:
        return sum(targets.met(a, b) for a, b in zip(self.ttft, self.tpot, strict=True))

    def goodput(self, targets: Targets) -> float:
        """Requests per second that met every SLO."""
        return self.attained(targets) / self.duration_s if self.duration_s > 0 else 0.0

    def goodput_per_worker(self, targets: Targets) -> float:
        return self.goodput(targets) / max(1, sum(self.workers.values()))

    def utilisation(self, pool: str) -> float:
        n = self.workers.get(pool, 0)
        return self.busy_s.get(pool, 0.0) / (n * self.duration_s) if n and self.duration_s > 0 else 0.0

    def summary(self, targets: Targets | None = None) -> dict[str, Any]:
        tpots = [t for t in self.tpot if t is not None]
        out: dict[str, Any] = {
            "layout": self.layout,
            "requests": self.requests,
            "rejected": self.rejected,
            "duration_s": self.duration_s,
            "steps": self.steps,
        }
        for name, values in (("ttft", self.ttft), ("tpot", tpots), ("itl", self.itl), ("e2e", self.e2e)):
            for q in (50, 90, 99):
                out[f"{name}_p{q}_s"] = percentile(values, q) if values else None
        for stage, waits in sorted(self.queue.items()):
            out[f"queue_{stage}_mean_s"] = sum(waits) / len(waits) if waits else 0.0
            out[f"queue_{stage}_p99_s"] = percentile(waits, 99) if waits else 0.0
        for pool in self.workers:
            out[f"{pool}_workers"] = self.workers[pool]
            out[f"{pool}_utilisation"] = self.utilisation(pool)
        if targets is not None:
            out["goodput_req_s"] = self.goodput(targets)
            out["goodput_per_worker"] = self.goodput_per_worker(targets)
            out["slo_attainment"] = self.attained(targets) / max(1, self.requests)
        return out


class Recorder:
    def __init__(self, router: LinearCost, itl_every: int = 20) -> None:
        self.router = router
        self.itl_every = itl_every
        self.live: dict[str, list[Any]] = {}
        self.result = _Partial()
        self._arrivals = 0

    @property
    def arrived(self) -> int:
        return self._arrivals

    def arrive(self, rid: str, time: float, prompt_tokens: int) -> None:
        gaps: list[float] | None = [] if self._arrivals % self.itl_every == 0 else None
        self._arrivals += 1
        self.live[rid] = [time, None, None, 0, None, 0.0, gaps]

    def reject(self, rid: str) -> None:
        self.live.pop(rid, None)
        self.result.rejected += 1

    def stage(self, rid: str, stage: str, now: float) -> None:
        rec = self.live[rid]
        rec[_STAGE], rec[_ENTERED] = stage, now

    def started(self, rid: str, stage: str, now: float) -> None:
        rec = self.live.get(rid)
        if rec is not None and rec[_STAGE] == stage:
            self.result.queue.setdefault(stage, []).append(now - rec[_ENTERED])
            rec[_STAGE] = None

    def token(self, rid: str, now: float) -> None:
        rec = self.live[rid]
        if rec[_FIRST] is None:
            rec[_FIRST] = now
        elif rec[_GAPS] is not None:
            rec[_GAPS].append(now - rec[_LAST])
        rec[_LAST] = now
        rec[_TOKENS] += 1

    def tokens(self, rid: str, start: float, ends: Sequence[float]) -> None:
        """Tokens from a run of steps that began at `start`, one at each step's end after it."""
        rec = self.live[rid]
        gaps = rec[_GAPS]
        if gaps is not None:
            for end in ends:
                self.token(rid, start + end)
            return
        if rec[_FIRST] is None:
            rec[_FIRST] = start + ends[0]
        rec[_LAST] = start + ends[-1]
        rec[_TOKENS] += len(ends)

    def finish(self, rid: str, now: float) -> tuple[float, float | None]:
        """Records a finished request; returns its TTFT and TPOT."""
        rec = self.live.pop(rid)
        delay = self.router.per_s  # each token's relay through the router
        n, r = rec[_TOKENS], self.result
        ttft = rec[_FIRST] + delay - rec[_ARRIVAL]
        tpot = (rec[_LAST] - rec[_FIRST]) / (n - 1) if n > 1 else None
        r.ttft.append(ttft)
        r.e2e.append(rec[_LAST] + delay - rec[_ARRIVAL])
        r.tpot.append(tpot)
        if rec[_GAPS]:
            r.itl.extend(rec[_GAPS])
        return ttft, tpot

    def result_for(self, layout: str, now: float, lives: Sequence[tuple[Any, float]]) -> SimResult:
        """`lives`: each worker that ran, with the seconds it ran (a pool that scaled has fewer
        than all the time); a pool's workers are its mean over the run."""
        r = self.result
        out = SimResult(layout, now, r.ttft, r.tpot, r.e2e, r.itl, r.queue, rejected=r.rejected)
        seconds: dict[str, float] = {}
        for w, alive in lives:
            out.busy_s[w.role] = out.busy_s.get(w.role, 0.0) + w.busy_s
            seconds[w.role] = seconds.get(w.role, 0.0) + alive
            out.steps += w.steps
        for role, total in seconds.items():
            out.workers[role] = total / now if now > 0 else 0.0
        return out


@dataclass
class _Partial:
    ttft: list[float] = field(default_factory=list)
    tpot: list[float | None] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    queue: dict[str, list[float]] = field(default_factory=dict)
    rejected: int = 0
