"""Per-pool autoscaling policy: a pure function of the pool's signals, its state and the time.

    decision = decide(role, config, signals, state, now)

Each signal asks for `ceil(workers * value / target)` workers; the pool wants the largest of them,
within `[min_replicas, max_replicas]`. Prefill signals: queued prompt tokens per worker, and TTFT
against its SLO. Decode signals: running sequences per worker, KV cache use, and TPOT against its
SLO. Latency counts only while the pool has work (an idle pool's recent latency is stale). A
change happens only once the pool has wanted it continuously for `upscale_delay_s` (more) or
`downscale_delay_s` (fewer), and by at most `max_step` workers; a want that wavers resets its
clock, so noise does not flap the pool. A manual override (`tandem scale`) replaces the policy
until it is cleared.

Predictive mode (`planned=N`, the planner's target for this pool at the expected load, e.g. from
`tandem plan`'s `targets`): the pool wants `max(N, what the signals ask)`. Growing to the plan
happens at once (by `max_step` a decision; the plan is a forecast, made before the load arrives);
every other change keeps its delay. So the reactive signals guard the plan: they raise the pool
above it when the load outruns the forecast (after `upscale_delay_s`) and hold it there until they
have asked for less for `downscale_delay_s`; they never take the pool below the plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from cluster.config import AutoscalingConfig


@dataclass(frozen=True)
class Signals:
    workers: int  # serving (not draining)
    queued_prompt_tokens: int = 0  # over the pool
    running_seqs: int = 0  # over the pool
    kv_cache_usage: float = 0.0  # mean over the pool's workers
    latency_s: float | None = None  # recent TTFT (prefill) or TPOT (decode), p90
    latency_target_s: float | None = None


@dataclass(frozen=True)
class PolicyState:
    target: int
    wants_more_since: float | None = None
    wants_fewer_since: float | None = None
    override: int | None = None


@dataclass(frozen=True)
class Decision:
    target: int
    reason: str
    state: PolicyState


def wanted(role: str, config: AutoscalingConfig, s: Signals) -> tuple[int, str]:
    """Workers the signals ask for (before bounds and delays), and the signal that asked most."""
    n = max(s.workers, 1)
    if role == "prefill":
        loads = [("queued prompt tokens", s.queued_prompt_tokens / n / config.target_queued_prompt_tokens)]
    else:
        loads = [
            ("running sequences", s.running_seqs / n / config.target_running_seqs),
            ("KV cache use", s.kv_cache_usage / config.target_kv_cache_usage),
        ]
    idle = s.queued_prompt_tokens == 0 and s.running_seqs == 0  # recent latency says nothing about an idle pool
    if s.latency_s is not None and s.latency_target_s and not idle:
        name = "TTFT" if role == "prefill" else "TPOT"
        loads.append((f"{name} against its SLO", s.latency_s / s.latency_target_s))
    name, load = max(loads, key=lambda item: item[1])
    return math.ceil(round(n * load, 6)), f"{name} at {load:.0%} of target"


def decide(
    role: str,
    config: AutoscalingConfig,
    signals: Signals,
    state: PolicyState,
    now: float,
    planned: int | None = None,
) -> Decision:
    current = state.target
    if state.override is not None:
        target = max(0, state.override)
        return Decision(
            target, f"manual override: {target} workers until cleared", PolicyState(target, override=target)
        )
    asked, why = wanted(role, config, signals)
    if planned is not None:
        plan = min(max(planned, config.min_replicas), config.max_replicas)
        asked = min(asked, config.max_replicas)
        if asked <= plan:
            why = f"planned {plan} workers; {why}"
        if asked <= plan and plan > current:
            target = min(plan, current + config.max_step)
            return Decision(target, f"scale up to plan: {why}", PolicyState(target, override=state.override))
        asked = max(asked, plan)
    desired = min(max(asked, config.min_replicas), config.max_replicas)
    if desired > current:
        since = state.wants_more_since if state.wants_more_since is not None else now
        if now - since >= config.upscale_delay_s:
            target = min(desired, current + config.max_step)
            return Decision(target, f"scale up: {why}", PolicyState(target, override=state.override))
        return Decision(
            current, f"waiting to scale up: {why}", replace(state, wants_more_since=since, wants_fewer_since=None)
        )
    if desired < current:
        since = state.wants_fewer_since if state.wants_fewer_since is not None else now
        if now - since >= config.downscale_delay_s:
            target = max(desired, current - config.max_step)
            return Decision(target, f"scale down: {why}", PolicyState(target, override=state.override))
        return Decision(
            current, f"waiting to scale down: {why}", replace(state, wants_fewer_since=since, wants_more_since=None)
        )
    return Decision(current, f"steady: {why}", PolicyState(current, override=state.override))
