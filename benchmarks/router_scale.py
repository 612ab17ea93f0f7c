"""The router at cluster scale, measured alone: fake workers (no model, real gRPC), real routers.

    .venv/bin/python benchmarks/router_scale.py [--quick] [--table] [--cluster | --cluster-only | --taskset]

1. Placement: the cost of one placement from the pushed view (`LoadIndex.choose`, after one
   worker's snapshot changes, as each request changes one) for 1, 16, 256 and 1,024 decode workers
   (and a prefill worker per four), beside the polled path's own computation
   (`placement.choose` over every load, without its `GetLoad` RPCs). Goal: 1,024 ≤ 1.2x 16.
2. Overhead and rate: a fleet process hosts the fake workers (one token per `--step-s`); one
   router process, then two (the load split between them), place and relay 16-token streams sent
   by this process at fixed rates. Router overhead is TTFT through the router minus TTFT straight
   to a fake worker at the same rate, the same quantile of each (p50, p99). The highest sustained
   rate is the highest offered rate at which every stream completed and completions kept up
   (≥ 95 % of the offered rate). Goals: overhead ≤ 1 ms p99 at 1,000 req/s with 256 workers;
   two routers ≥ 1.7x one.
3. Relay: per-token cost at concurrency 1, 64 and 512 (closed loop, 64-token streams, workers
   that step every 0 s): the router process's CPU seconds per token relayed, beside the time per
   token a stream sees through the router minus straight to a worker. Goal: ≤ 0.1 ms.

4. A real local cluster (`--cluster`, or alone with `--cluster-only`): the demo model, one prefill
   and one decode worker with one CPU each, 64 prompts of 128 token ids, 64 tokens out. TPOT at
   concurrency 1 beside the engine's own step (one `Engine` in this process, one thread, the same
   requests one at a time), and output tokens/s at concurrency 32 beside the engine alone on the
   same 64 requests (one and two threads). TTFT p50/p99 of remote prefill (128-token prompts) with
   the prefill worker's first token streamed at once and without (`router.first_token_from_prefill`),
   and of local prefill (32-token prompts), at concurrency 1, three routers over the same workers.
   Goals: TPOT overhead at concurrency 1 ≤ 0.5 ms; throughput at 32 ≥ 0.8 of the engine alone on
   equal cores (two threads).

Every process shares this machine's cores (the fleet, each router and this load generator): on a
2-core box the load generator and the fleet take CPU the router would otherwise have, so rates are
floors for the router, and the breakdown says which process was busy. Prints a table and writes
`benchmarks/results/router_scale.{json,png}` (`--taskset`: `router_scale_taskset.*`, suffixed by
`cluster.cpu.results_suffix()`: `_avx2` on a CPU without AVX-512, `_amx` with AMX).

`--taskset` also runs grpc.aio's own floors on the router's core at the same rates, with no Tandem code:
a bare `Generate` writing the same 16 messages (the public side alone), and a bare relay that sends each
request to a fake worker as one command on its step stream and writes each entry to the client (the
router's whole path without validation, placement, telemetry or text).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "proto"))
sys.path.insert(0, str(ROOT / "benchmarks"))

# Sections 1 to 3 are router_scale_alone.py, section 4 router_scale_cluster.py, the tables, breakdown,
# goals and figures router_scale_report.py.
from router_scale_alone import (  # noqa: E402
    floor_rows,
    placement_cost,
    rate_rows,
    relay_rows,
    serve_floor,
    serve_relay,
    serve_router,
    start_fleet,
    stop,
)
from router_scale_cluster import cluster_rows  # noqa: E402
from router_scale_report import (  # noqa: E402
    breakdown,
    cluster_breakdown,
    cluster_goals,
    goals,
    plot,
    plot_cluster,
    plot_rates,
    print_cluster,
    print_floor,
    print_rates,
    print_table,
)

OUT = ROOT / "benchmarks" / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer workers, rates and seconds")
    parser.add_argument("--step-s", type=float, default=0.002, help="fake workers' time per token")
    parser.add_argument("--table", action="store_true", help="print the table of the last run's JSON, run nothing")
    parser.add_argument("--cluster", action="store_true", help="also section 4, a real local cluster (Ray)")
    parser.add_argument("--cluster-only", action="store_true", help="section 4 alone (router_scale_cluster.json)")
    parser.add_argument(
        "--taskset", action="store_true",
        help="section 2 alone at 256 workers, the router on a core of its own and the fleet and load generator on "
        "another (router_scale_taskset.json)",
    )  # fmt: skip
    parser.add_argument("--serve-router", help=argparse.SUPPRESS)
    parser.add_argument("--serve-floor", help=argparse.SUPPRESS)
    parser.add_argument("--serve-relay", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_router:
        return serve_router(args.serve_router)
    if args.serve_floor:
        return serve_floor(args.serve_floor)
    if args.serve_relay:
        return serve_relay(args.serve_relay)
    if args.table:
        return print_table(json.loads((OUT / "router_scale.json").read_text()))
    if args.cluster_only:
        return cluster_only(16 if args.quick else 64)
    if args.taskset:
        return taskset_only(args.step_s)
    sizes = [1, 16, 256, 1024]
    results: dict = {"placement": [placement_cost(n, 2000 if args.quick else 10000) for n in sizes]}
    rates = [50, 100, 200, 400, 1000] if args.quick else [50, 100, 150, 200, 300, 400, 600, 1000, 1500]
    duration = 2.0 if args.quick else 3.0
    layouts = [(16, 1), (256, 1), (256, 2)] if args.quick else [(w, r) for w in sizes for r in (1, 2)]
    results["rate"] = [rate_rows(w, r, rates, duration, args.step_s) for w, r in layouts]
    results["relay"] = relay_rows([1, 64, 512])
    if args.cluster:
        results["cluster"] = cluster_rows(16 if args.quick else 64)
    results["goals"] = goals(results)
    results["breakdown"] = breakdown(results)
    results["machine"] = {"cpus": os.cpu_count(), "note": "fleet, routers and load generator share these cores"}
    print_table(results)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "router_scale.json").write_text(json.dumps(results, indent=2))
    plot(results, OUT / "router_scale.png")
    print(f"\nwrote {OUT / 'router_scale.json'} and {OUT / 'router_scale.png'}")


def taskset_only(step_s: float) -> None:
    """One router over 256 fake workers on a core of its own; the fleet and this load generator on another."""
    import router_scale_alone

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("--taskset needs two cores")
    router_core, other = cores[0], cores[1]
    router_scale_alone.PIN.update(router={router_core}, fleet={other})
    os.sched_setaffinity(0, {other})
    rates = [50, 100, 150, 200, 300, 400, 600, 1000]
    run = rate_rows(256, 1, rates, 3.0, step_s)
    results = {"rate": [run], "pinned": {"router": router_core, "fleet and load generator": other}}
    results["floor"] = floor_rows(rates, 3.0, step_s)
    fleet, addresses = start_fleet(256, step_s)
    try:
        results["relay_floor"] = floor_rows(rates, 3.0, step_s, addresses)
    finally:
        stop(fleet)
    print(f"\nthe router on core {router_core}; the fake fleet and this load generator on core {other}")
    print_rates(results)
    print_floor(results)
    at = [r for r in run["rows"] if r["offered"] == 1000 and r["achieved"] >= 950]
    value = f"{at[0]['overhead_p99_ms']:.2f}" if at else f"not sustained (best {run['sustained_rps']:.0f} req/s)"
    met = bool(at) and at[0]["overhead_p99_ms"] <= 2.0
    results["goals"] = {"overhead p99 at 1000 req/s, 256 workers, pinned": (value, "<= 2 ms", met)}
    results["breakdown"] = breakdown(results)
    for line in results["breakdown"]:
        print(f"  {line}")
    print(f"  goal: 1,000 req/s with p99 overhead <= 2 ms: {value} {'met' if met else 'MISSED'}")
    OUT.mkdir(parents=True, exist_ok=True)
    from cluster.cpu import cpu_kind, results_suffix

    results["cpu"] = cpu_kind()
    stem = OUT / ("router_scale_taskset" + results_suffix())
    stem.with_suffix(".json").write_text(json.dumps(results, indent=2))
    plot_rates(results, stem.with_suffix(".png"))
    print(f"\n{results['cpu']}; wrote {stem}.json and .png")


def cluster_only(num_prompts: int) -> None:
    c = cluster_rows(num_prompts)
    print_cluster(c)
    result = {
        "cluster": c,
        "goals": cluster_goals(c),
        "breakdown": cluster_breakdown(c),
        "machine": {"cpus": os.cpu_count()},
    }
    print("\nwhere the time goes")
    for line in cluster_breakdown(c):
        print(f"  {line}")
    print("\ngoals")
    for name, (value, goal, met) in result["goals"].items():
        print(f"  {name}: {value} (goal {goal}) {'met' if met else 'MISSED'}")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "router_scale_cluster.json").write_text(json.dumps(result, indent=2))
    plot_cluster(c, OUT / "router_scale_cluster.png")
    print(f"\nwrote {OUT / 'router_scale_cluster.json'} and {OUT / 'router_scale_cluster.png'}")


if __name__ == "__main__":
    main()
