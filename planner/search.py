"""`tandem plan`: which layout of N workers serves a workload best, by simulation.

A layout's goodput is the highest arrival rate (the workload's process and lengths, its rate
scaled) at which at least `attainment` of the requests meet both SLOs, found by bracketing and
bisection; goodput per worker divides it by the workers. The advisor first ranks every split
(colocated, 1:N-1, ..., N-1:1) at the default knobs, then tunes the best `refine` of them one knob
at a time (`local_prefill_max_tokens`, the decode chunk, the batch limit, the prefill batch),
keeping a change when it raises goodput. `exhaustive` simulates the whole grid instead: what the
advisor is checked against.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from cluster.config import SchedulerConfig
from cluster.slo import Targets
from planner.profile import Profile
from planner.sim import Layout, simulate
from planner.workload import Workload

KNOBS: dict[str, tuple[int, ...]] = {
    "local_prefill_max_tokens": (0, 64, 256, 1024),
    "long_prefill_chunk": (256, 512, 1024),
    "max_num_seqs": (16, 32, 64),
    "prefill_max_num_batched_tokens": (1024, 2048, 4096),
}


class PlanError(ValueError):
    """The planner cannot answer: SLOs no layout meets, no workers, an empty workload."""


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    goodput: float  # requests per second meeting the SLOs at `attainment`
    at_rate: dict[str, Any]  # the simulation's summary at the workload's own rate

    @property
    def goodput_per_worker(self) -> float:
        return self.goodput / self.layout.workers

    def knobs(self) -> dict[str, int]:
        return knobs_of(self.layout)


def knobs_of(layout: Layout) -> dict[str, int]:
    return {
        "local_prefill_max_tokens": layout.local_prefill_max_tokens if layout.prefill else -1,
        "long_prefill_chunk": layout.decode_scheduler.long_prefill_chunk,
        "max_num_seqs": layout.decode_scheduler.max_num_seqs,
        "prefill_max_num_batched_tokens": layout.prefill_scheduler.max_num_batched_tokens if layout.prefill else -1,
    }


def layout_key(layout: Layout) -> tuple:
    """Equal for equal layouts (pydantic configs built two ways compare unequal on the fields set)."""
    fields = {f.name: getattr(layout, f.name) for f in dataclasses.fields(layout)}
    if not layout.prefill:  # a colocated layout has no prefill pool to configure
        for name in ("local_prefill_max_tokens", "prefill_scheduler", "prefill_blocks", "prefill_threads", "transport"):
            fields.pop(name)
    return tuple((k, v.model_dump_json() if isinstance(v, SchedulerConfig) else v) for k, v in fields.items())


def with_knob(layout: Layout, name: str, value: int) -> Layout:
    if name == "local_prefill_max_tokens":
        return replace(layout, local_prefill_max_tokens=value)
    if name == "prefill_max_num_batched_tokens":
        return replace(layout, prefill_scheduler=_sched(layout.prefill_scheduler, max_num_batched_tokens=value))
    return replace(layout, decode_scheduler=_sched(layout.decode_scheduler, **{name: value}))


def _sched(config: SchedulerConfig, **changes: int) -> SchedulerConfig:
    return SchedulerConfig.model_validate({**config.model_dump(), **changes})


def applicable(layout: Layout) -> list[str]:
    """The knobs that mean something for this layout (a colocated one has no prefill pool)."""
    return [
        k for k in KNOBS if layout.prefill or k not in ("local_prefill_max_tokens", "prefill_max_num_batched_tokens")
    ]


def splits(base: Layout, workers: int) -> list[Layout]:
    """Colocated, then every P:D with at least one of each."""
    if workers < 1:
        raise PlanError("--workers must be at least 1")
    return [replace(base, prefill=p, decode=workers - p) for p in range(workers)]


@dataclass
class Evaluator:
    profile: Profile
    workload: Workload
    targets: Targets
    attainment: float = 0.9
    requests: int = 600
    seed: int = 0
    bisections: int = 5
    simulations: int = 0
    _seen: dict[tuple, Candidate] = field(default_factory=dict)

    def attained(self, layout: Layout, rate: float) -> tuple[float, dict[str, Any]]:
        self.simulations += 1
        result = simulate(self.profile, layout, self.workload.with_rate(rate).with_requests(self.requests), self.seed)
        summary = result.summary(self.targets)
        return summary["slo_attainment"], summary

    def goodput(self, layout: Layout) -> Candidate:
        key = layout_key(layout)
        if key not in self._seen:
            self._seen[key] = self._search(layout)
        return self._seen[key]

    def _search(self, layout: Layout) -> Candidate:
        rate = float(self.workload.rate or 1.0)
        share, at_rate = self.attained(layout, rate)
        good = rate * share if share >= self.attainment else 0.0
        lo, hi = (rate, rate * 2) if good else (0.0, rate)
        while good and hi <= rate * 2**10:
            share = self.attained(layout, hi)[0]
            if share < self.attainment:
                break
            lo, hi, good = hi, hi * 2, hi * share
        for _ in range(self.bisections):
            mid = (lo + hi) / 2
            share = self.attained(layout, mid)[0]
            if share >= self.attainment:
                lo, good = mid, mid * share
            else:
                hi = mid
        return Candidate(layout, good, at_rate)


@dataclass(frozen=True)
class Plan:
    ranked: list[Candidate]
    recommended: Candidate
    simulations: int
    exhaustive: bool

    def targets_for(self, rate: float) -> dict[str, int]:
        """Workers each pool needs for `rate` requests per second, in the recommended ratio."""
        best = self.recommended
        scale = rate / best.goodput if best.goodput > 0 else math.inf
        prefill = math.ceil(best.layout.prefill * scale) if best.layout.prefill else 0
        return {"prefill": prefill, "decode": max(1, math.ceil(best.layout.decode * scale))}


def plan(
    evaluator: Evaluator,
    base: Layout,
    workers: int,
    refine: int = 2,
    exhaustive: bool = False,
    progress: Callable[[str], None] = lambda _: None,
) -> Plan:
    check_reachable(evaluator, base)
    tried = (
        _exhaustive(evaluator, base, workers, progress)
        if exhaustive
        else _advise(evaluator, base, workers, refine, progress)
    )
    candidates = {layout_key(c.layout): c for c in tried}  # a layout reached twice counts once
    ranked = sorted(candidates.values(), key=lambda c: (-c.goodput, c.layout.name))
    return Plan(ranked, ranked[0], evaluator.simulations, exhaustive)


def check_reachable(evaluator: Evaluator, base: Layout) -> None:
    """Raises PlanError when a request alone on an idle worker already misses an SLO."""
    lone = replace(evaluator, requests=min(50, evaluator.requests), _seen={})
    rate = 1e-3 * float(evaluator.workload.rate or 1.0)
    for layout in (replace(base, prefill=0, decode=1), replace(base, prefill=1, decode=1)):
        share, summary = lone.attained(layout, rate)
        if share >= evaluator.attainment:
            return
    t = evaluator.targets
    raise PlanError(
        f"no layout can meet these SLOs: even a request alone on idle workers takes TTFT p50 "
        f"{summary['ttft_p50_s'] * 1e3:.3g} ms (target {t.ttft_s * 1e3:.3g} ms) and TPOT p50 "
        f"{(summary['tpot_p50_s'] or 0) * 1e3:.3g} ms (target {t.tpot_s * 1e3:.3g} ms)"
    )


def idle_targets(
    profile: Profile, workload: Workload, layouts: Iterable[Layout], ttft_x: float = 3, tpot_x: float = 2
) -> Targets:
    """SLOs relative to what this machine can do at all: `ttft_x` times the best TTFT p90 and
    `tpot_x` times the best TPOT p90 of requests arriving one at a time onto idle `layouts`."""
    ev = Evaluator(profile, workload, Targets(math.inf, math.inf), requests=60)
    rate = 1e-3 * float(workload.rate or 1.0)
    summaries = [ev.attained(layout, rate)[1] for layout in layouts]
    ttft = min(s["ttft_p90_s"] for s in summaries)
    tpot = min(s["tpot_p90_s"] or math.inf for s in summaries)
    return Targets(ttft_x * ttft, tpot_x * tpot)


def _advise(
    ev: Evaluator, base: Layout, workers: int, refine: int, progress: Callable[[str], None]
) -> Iterable[Candidate]:
    first = []
    for layout in splits(base, workers):
        progress(layout.name)
        first.append(ev.goodput(layout))
    yield from first
    for start in sorted(first, key=lambda c: -c.goodput)[:refine]:
        best = start
        for knob in applicable(best.layout):
            for value in KNOBS[knob]:
                if knobs_of(best.layout)[knob] == value:
                    continue
                progress(f"{best.layout.name} {knob}={value}")
                tried = ev.goodput(with_knob(best.layout, knob, value))
                yield tried
                if tried.goodput > best.goodput:
                    best = tried


def _exhaustive(ev: Evaluator, base: Layout, workers: int, progress: Callable[[str], None]) -> Iterable[Candidate]:
    for split in splits(base, workers):
        knobs = applicable(split)
        for values in itertools.product(*(KNOBS[k] for k in knobs)):
            layout = split
            for knob, value in zip(knobs, values, strict=True):
                layout = with_knob(layout, knob, value)
            progress(f"{layout.name} {dict(zip(knobs, values, strict=True))}")
            yield ev.goodput(layout)


def to_json(result: Plan, evaluator: Evaluator) -> dict[str, Any]:
    rate = float(evaluator.workload.rate or 1.0)
    return {
        "workload": evaluator.workload.name,
        "rate": rate,
        "slo": {"ttft_s": evaluator.targets.ttft_s, "tpot_s": evaluator.targets.tpot_s},
        "attainment": evaluator.attainment,
        "simulations": result.simulations,
        "exhaustive": result.exhaustive,
        "recommended": _row(result.recommended),
        "targets": result.targets_for(rate),
        "ranked": [_row(c) for c in result.ranked],
    }


def _row(c: Candidate) -> dict[str, Any]:
    return {
        "layout": c.layout.name,
        "prefill": c.layout.prefill,
        "decode": c.layout.decode,
        "knobs": c.knobs(),
        "goodput_req_s": c.goodput,
        "goodput_per_worker": c.goodput_per_worker,
        "at_rate": c.at_rate,
    }


def table(result: Plan, top: int = 15) -> str:
    lines = [
        f"{'#':>3} {'layout':<14}{'local≤':>7}{'chunk':>6}{'seqs':>5}{'P batch':>8}"
        f"{'goodput':>9}{'/worker':>9}{'SLO met':>8}{'TTFT p99':>10}{'TPOT p99':>10}"
    ]
    for i, c in enumerate(result.ranked[:top], 1):
        k, s = c.knobs(), c.at_rate
        dash = lambda v: "-" if v < 0 else str(v)  # noqa: E731
        lines.append(
            f"{i:>3} {c.layout.name:<14}{dash(k['local_prefill_max_tokens']):>7}{k['long_prefill_chunk']:>6}"
            f"{k['max_num_seqs']:>5}{dash(k['prefill_max_num_batched_tokens']):>8}{c.goodput:>9.2f}"
            f"{c.goodput_per_worker:>9.3f}{s['slo_attainment']:>8.0%}{s['ttft_p99_s'] * 1e3:>8.0f}ms"
            f"{(s['tpot_p99_s'] or 0) * 1e3:>8.1f}ms"
        )
    return "\n".join(lines)


def plot(result: Plan, path: str, title: str) -> None:
    """Goodput per worker against the prefill share of the workers (0: colocated)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best: dict[int, Candidate] = {}
    for c in result.ranked:
        p = c.layout.prefill
        if p not in best or c.goodput > best[p].goodput:
            best[p] = c
    xs = sorted(best)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(xs, [best[x].goodput_per_worker for x in xs], "o-", color="tab:blue")
    ax.set_xticks(xs, [("coloc" if x == 0 else f"{x}:{best[x].layout.decode}") for x in xs])
    rec = result.recommended
    ax.plot(
        [rec.layout.prefill],
        [rec.goodput_per_worker],
        "*",
        ms=16,
        color="tab:red",
        label=f"recommended {rec.layout.name}",
    )
    ax.set_xlabel("layout (P:D)")
    ax.set_ylabel("goodput per worker (req/s)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
