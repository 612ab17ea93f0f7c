"""A simulation split into shards, one process each, for clusters larger than one core simulates
in the time wanted.

    result = simulate_sharded(profile, layout, workload, shards=2, seed=0)

Shard `i` of `k` is a cluster of its own: `1/k` of each pool (the remainder to the first shards)
and each arrival with probability `1/k`, by one seeded draw per request that every shard makes
alike. Thinning a Poisson stream so gives each shard a Poisson stream at `rate/k`, exactly; a gamma
stream or a trace is thinned the same way. The shards' finished requests, queue waits and pool
seconds are pooled into one `SimResult`.

What a shard changes is whom a request may choose: its own shard's workers. Placement already
draws a request's candidates at random from a pool beyond 64 workers (8 of them, the power of d
choices; `planner.routing.Placer`), and a shard keeps the whole cluster's rule (it draws whenever
the whole pool would), so a 500-worker shard chooses as a 1,000-worker cluster does. A prompt's
prefix owner is its shard's. Small clusters, whose pools are ranked in full, are best run in one
process: there a shard ranks fewer workers than the cluster would. `tests/test_planner_shards.py`
checks the sharded percentiles against one process.
"""

from __future__ import annotations

import json
import multiprocessing
import random
from collections.abc import Iterator
from dataclasses import asdict, replace

from planner.profile import Profile
from planner.report import SimResult
from planner.sim import Layout, Simulator
from planner.workload import Arrival, Workload, arrivals

EXACT_UP_TO = 64  # as planner.routing.Placer: pools up to this size are ranked in full


def split(layout: Layout, shards: int) -> list[Layout]:
    """Each shard's layout: the pools divided as evenly as they go."""
    if shards < 1:
        raise ValueError(f"shards must be at least 1, not {shards}")
    if layout.decode < shards or 0 < layout.prefill < shards:
        raise ValueError(f"{layout.name} has too few workers a pool for {shards} shards")
    return [
        replace(layout, prefill=_share(layout.prefill, shards, i), decode=_share(layout.decode, shards, i))
        for i in range(shards)
    ]


def thinned(workload: Workload, seed: int, index: int, shards: int) -> Iterator[Arrival]:
    """The arrivals of shard `index`: each of the workload's, kept by a draw every shard repeats."""
    pick = random.Random(seed * 1_000_003 + 7919)
    for a in arrivals(workload, seed):
        if int(pick.random() * shards) == index:
            yield a


def simulate_sharded(profile: Profile, layout: Layout, workload: Workload, shards: int, seed: int = 0) -> SimResult:
    if shards == 1:
        return Simulator(profile, layout, seed).run(workload, seed)
    context = multiprocessing.get_context("fork")  # a forked child has its arguments already: nothing pickled
    running = []
    for i, part in enumerate(split(layout, shards)):
        receive, send = context.Pipe(duplex=False)
        child = context.Process(target=_run_shard, args=(send, profile, part, workload, seed, i, shards), daemon=True)
        child.start()
        send.close()
        running.append((child, receive))
    parts = []
    for i, (child, receive) in enumerate(running):
        try:
            parts.append(_from_json(receive.recv_bytes()))
        except EOFError:
            child.join()
            raise RuntimeError(f"shard {i} of {shards} died (exit code {child.exitcode})") from None
        child.join()
    return merge(layout.name, parts)


def merge(name: str, parts: list[SimResult]) -> SimResult:
    """One result of the shards': their requests together, over the longest shard's span."""
    span = max(p.duration_s for p in parts)
    out = SimResult(name, span)
    for p in parts:
        out.ttft += p.ttft
        out.tpot += p.tpot
        out.e2e += p.e2e
        out.itl += p.itl
        for stage, waits in p.queue.items():
            out.queue.setdefault(stage, []).extend(waits)
        for pool, busy in p.busy_s.items():
            out.busy_s[pool] = out.busy_s.get(pool, 0.0) + busy
        for pool, mean in p.workers.items():  # worker-seconds over the merged span
            out.workers[pool] = out.workers.get(pool, 0.0) + (mean * p.duration_s / span if span else mean)
        out.steps += p.steps
        out.rejected += p.rejected
    return out


def _run_shard(send, profile: Profile, layout: Layout, workload: Workload, seed: int, index: int, shards: int) -> None:  # type: ignore[no-untyped-def]
    sim = Simulator(profile, layout, seed + index, exact_up_to=EXACT_UP_TO // shards)
    result = sim.run(workload, seed, stream=thinned(workload, seed, index, shards))
    send.send_bytes(json.dumps(asdict(result)).encode())  # plain JSON back across the process boundary
    send.close()


def _from_json(text: str) -> SimResult:
    return SimResult(**json.loads(text))


def _share(n: int, shards: int, index: int) -> int:
    return n // shards + (index < n % shards)


__all__ = ["merge", "simulate_sharded", "split", "thinned"]
