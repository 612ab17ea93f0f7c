"""`tandem status` and `tandem scale`: the router's `Admin` service from the command line.

tandem status [--target HOST:PORT]            pools, workers, KV use, queues, placement counters
tandem scale POOL N|auto [--target HOST:PORT] hold a pool at N workers by hand / hand it back
tandem scale POOL --plan N|none               set or clear the planner's target for the pool
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import grpc
from tandem.v1 import worker_pb2, worker_pb2_grpc

from cli.client_options import add_client_options, channel, metadata


def add_commands(commands: argparse._SubParsersAction) -> None:
    status = commands.add_parser("status", help="show pools, workers, KV use, queues and placement counters")
    add_client_options(status)
    status.set_defaults(run=_status)

    scale = commands.add_parser(
        "scale", help="hold a pool at N workers by hand, give it back to its autoscaler, or set its planned target"
    )
    scale.add_argument("pool", choices=["prefill", "decode"], help="the pool")
    scale.add_argument("replicas", nargs="?", help="workers to hold the pool at, or 'auto' to clear the override")
    scale.add_argument(
        "--plan", default=None, help="the planner's target for the pool (predictive autoscaling), or 'none' to clear it"
    )
    add_client_options(scale)
    scale.set_defaults(run=_scale)


def _scale(args: argparse.Namespace) -> int:
    if (args.replicas is None) == (args.plan is None):
        raise ValueError("give the workers to hold the pool at (or 'auto'), or --plan N (or --plan none): one of them")
    request = worker_pb2.ScaleRequest(pool=args.pool)
    if args.plan == "none":
        request.clear_planned = True
    elif args.plan is not None:
        request.planned = _count(args.plan, "--plan")
    elif args.replicas != "auto":
        request.replicas = _count(args.replicas, "replicas")
    with channel(args) as chan:
        try:
            pool = worker_pb2_grpc.AdminStub(chan).Scale(request, timeout=60, metadata=metadata(args)).pool
        except grpc.RpcError as e:
            print(f"tandem: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    held = (
        f"held at {pool.override} by hand until `tandem scale {pool.role} auto`"
        if pool.HasField("override")
        else f"autoscaled, never below the plan's {pool.planned}"
        if pool.HasField("planned")
        else "autoscaled"
    )
    print(f"{pool.role} pool: target {pool.target} ({held}); serving {', '.join(pool.workers) or 'none'}")
    return 0


def _count(text: str, name: str) -> int:
    if not text.isdigit():
        raise ValueError(f"{name} takes a number of workers, not {text!r}")
    return int(text)


def _status(args: argparse.Namespace) -> int:
    try:
        status = get_status(args)
    except grpc.RpcError as e:
        print(f"tandem: cannot reach the router at {args.target}: {e.code().name}", file=sys.stderr)
        return 1
    routers = "router" if len(status.routers) == 1 else "routers"
    print(f"model {status.model}, {status.requests_in_flight} requests in flight over {len(status.routers)} {routers}")
    if status.ray:  # Ray's GCS silent: no pool rows below
        print(f"Ray {status.ray}")
    _print_routers(status.routers)
    print(
        f"{'worker':<12}{'role':<9}{'address':<22}{'health':<8}{'running':>8}{'waiting':>8}"
        f"{'queued tok':>11}{'KV used':>14}  metrics"
    )
    for w in status.workers:
        load = w.load
        used = load.total_kv_blocks - load.free_kv_blocks
        kv = f"{used}/{load.total_kv_blocks}" if load.total_kv_blocks else "-"
        health = "up" if w.healthy else "DOWN"
        role = load.role or "?"
        print(
            f"{w.name:<12}{role:<9}{w.address:<22}{health:<8}{load.running_seqs:>8}{load.waiting_seqs:>8}"
            f"{load.queued_prompt_tokens:>11}{kv:>14}  {load.metrics_address or '-'}"
        )
    _print_tiers(status.workers)
    if status.decisions:
        print("placement: " + ", ".join(f"{k} {v}" for k, v in sorted(status.decisions.items())))
    for pool in status.pools:
        held = f", held at {pool.override} by hand" if pool.HasField("override") else ""
        held += f", planned {pool.planned}" if pool.HasField("planned") else ""
        draining = f", draining {', '.join(pool.draining)}" if pool.draining else ""
        print(
            f"{pool.role} pool: {len(pool.workers)} serving, target {pool.target} "
            f"[{pool.min_replicas}, {pool.max_replicas}]{held}{draining}; {pool.reason} "
            f"(up {pool.scale_ups}, down {pool.scale_downs})"
        )
    return 0


def _print_tiers(workers: Any) -> None:
    """The KV tiers of the workers that have any: blocks loaded from each tier, and what a block
    from it has cost against computing one ("-" before it has loaded any)."""
    shown = []
    for w in workers:
        hits, costs = w.load.tier_hit_blocks, w.load.tier_block_cost
        tiers = [f"{t} {hits[t]} ({costs[t]:.2f})" if t in costs else f"{t} {hits[t]} (-)" for t in sorted(hits)]
        if tiers:
            shown.append(f"{w.name} {', '.join(tiers)}")
    if shown:
        print("KV tiers, blocks loaded (cost against computing): " + "; ".join(shown))


def _print_routers(routers: Any) -> None:
    """One line per live router: its requests in flight, its SLO window's attainment and p90
    latencies, how old its report is, and its Prometheus endpoint."""
    width = max(len("router"), *(len(r.name) for r in routers)) + 2

    def seconds(r: Any, field: str) -> str:
        return f"{getattr(r, field):.3f}s" if r.HasField(field) else "-"

    print(
        f"{'router':<{width}}{'address':<22}{'in flight':>10}{'SLO':>6}{'TTFT p90':>10}{'TPOT p90':>10}"
        f"{'report':>8}  metrics"
    )
    for r in routers:
        slo = f"{r.slo_attainment:.0%}" if r.HasField("slo_attainment") else "-"
        print(
            f"{r.name:<{width}}{r.address:<22}{r.requests_in_flight:>10}{slo:>6}{seconds(r, 'ttft_p90_seconds'):>10}"
            f"{seconds(r, 'tpot_p90_seconds'):>10}{r.age_seconds:>7.1f}s  http://{r.metrics_address}/metrics"
        )


def get_status(args: argparse.Namespace) -> worker_pb2.ClusterStatus:
    """The cluster's status, as the router at `--target` reports it."""
    with channel(args) as chan:
        return worker_pb2_grpc.AdminStub(chan).GetStatus(
            worker_pb2.GetStatusRequest(), timeout=10, metadata=metadata(args)
        )
