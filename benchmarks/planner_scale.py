"""The simulator at scale, and where disaggregation stops paying.

    .venv/bin/python benchmarks/planner_scale.py [--profile P] [--workers 1000] [--requests 1000000]

1. Scale: `--workers` workers (a P:D split of them) serving `--requests` short-chat requests at
   about 70 % of the layout's capacity, simulated once, in `--shards` processes (one a core:
   `planner.shards`); prints the wall time it took, the simulated span, steps and steps per second.
2. Goodput per worker against the P:D split of `--split-workers` workers for three workloads
   (short chat, long-context RAG, code completion): colocated, then 1:N-1 ... N-1:1, each at the
   default knobs. SLOs are set per workload from this machine's own latencies: TTFT 3x and TPOT 2x
   those of a request alone on idle workers. The break-even is where the best P:D split's goodput
   per worker falls to the colocated one's: disaggregation pays where it is above.

The profile defaults to `benchmarks/results/planner_profile.json` (`tandem profile` on this
machine). Writes `benchmarks/results/planner_scale.{json,png}`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cluster.slo import Targets  # noqa: E402
from planner import profile as profiles  # noqa: E402
from planner import search, workload  # noqa: E402
from planner.shards import simulate_sharded  # noqa: E402
from planner.sim import Layout, Simulator  # noqa: E402

OUT = ROOT / "benchmarks" / "results"
WORKLOADS = {"short chat": "short-chat", "long-context RAG": "rag", "code completion": "code"}


def base_layout() -> Layout:
    return Layout(1, 1, decode_blocks=6000, prefill_blocks=6000)


def lone_slo(prof: profiles.Profile, wl: workload.Workload) -> Targets:
    return search.idle_targets(prof, wl, (replace(base_layout(), prefill=0), base_layout()))


def splits(prof: profiles.Profile, workers: int, requests: int) -> dict:
    out = {}
    for title, name in WORKLOADS.items():
        wl = workload.load(name)
        targets = lone_slo(prof, wl)
        ev = search.Evaluator(prof, wl, targets, requests=requests, bisections=4)
        rows = []
        for layout in search.splits(base_layout(), workers):
            c = ev.goodput(layout)
            rows.append(
                {"prefill": layout.prefill, "decode": layout.decode, "goodput_per_worker": c.goodput_per_worker}
            )
            print(f"  {title:<18}{layout.name:<14}{c.goodput_per_worker:>10.3f} req/s/worker", flush=True)
        coloc = rows[0]["goodput_per_worker"]
        best = max(rows[1:], key=lambda r: r["goodput_per_worker"])
        paying = [r["prefill"] for r in rows[1:] if r["goodput_per_worker"] > coloc]
        out[title] = {
            "workload": name, "slo": {"ttft_s": targets.ttft_s, "tpot_s": targets.tpot_s}, "rows": rows,
            "colocated": coloc, "best_split": f"{best['prefill']}P:{best['decode']}D",
            "best_gain": best["goodput_per_worker"] / coloc if coloc else float("inf"),
            "pays_at_prefill_workers": paying,
        }  # fmt: skip
    return out


def scale(prof: profiles.Profile, workers: int, requests: int, prefill_share: float, shards: int) -> dict:
    wl = workload.load("short-chat")
    targets = lone_slo(prof, wl)
    small = search.Evaluator(prof, wl, targets, requests=400)
    p = max(1, round(10 * prefill_share))
    per_worker = small.goodput(replace(base_layout(), prefill=p, decode=10 - p)).goodput / 10
    n_prefill = max(1, round(workers * prefill_share))
    layout = replace(base_layout(), prefill=n_prefill, decode=workers - n_prefill)
    rate = 0.7 * per_worker * workers
    start = time.perf_counter()
    result = simulate_sharded(prof, layout, wl.with_rate(rate).with_requests(requests), shards)
    wall = time.perf_counter() - start
    summary = result.summary(targets)
    return {
        "layout": layout.name, "workers": workers, "requests": requests, "shards": shards, "rate_req_s": rate,
        "wall_s": wall, "simulated_s": result.duration_s, "steps": result.steps,
        "steps_per_wall_s": result.steps / wall,
        "requests_per_wall_s": requests / wall, "summary": summary,
    }  # fmt: skip


def breakdown(prof: profiles.Profile, layout_name: str, workers: int, requests: int, rate: float) -> dict[str, float]:
    """Where one shard's time goes, by module: the scale run's layout and rate, `requests` of them in
    one process under cProfile (its overhead inflates every share alike)."""
    import cProfile
    import pstats

    n_prefill = int(layout_name.split("P")[0])
    layout = replace(base_layout(), prefill=n_prefill, decode=workers - n_prefill)
    sim = Simulator(prof, layout, seed=0)
    wl = workload.load("short-chat").with_rate(rate).with_requests(requests)
    profiler = cProfile.Profile()
    profiler.runcall(sim.run, wl)
    shares: dict[str, float] = {}
    for (path, _, _), row in pstats.Stats(profiler).stats.items():  # type: ignore[attr-defined]
        shares[_component(path)] = shares.get(_component(path), 0.0) + row[2]  # own time
    total = sum(shares.values())
    return {k: v / total for k, v in sorted(shares.items(), key=lambda kv: -kv[1])}


def _component(path: str) -> str:
    for part in ("block_manager", "decode_worker/scheduler", "prefill_worker/scheduler", "engine/request",
                 "planner/workers", "planner/sim", "planner/routing", "planner/report", "planner/workload",
                 "router/placement"):  # fmt: skip
        if part in path:
            return part
    return "Python built-ins and the standard library"


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for (title, d), color in zip(data["splits"].items(), ("tab:blue", "tab:orange", "tab:green"), strict=True):
        rows = d["rows"]
        n = rows[0]["decode"]
        xs = [r["prefill"] / n for r in rows[1:]]
        ax.plot(xs, [r["goodput_per_worker"] for r in rows[1:]], "o-", color=color, label=f"{title}: P:D split")
        ax.axhline(d["colocated"], color=color, ls="--", lw=1, label=f"{title}: colocated")
    ax.set_xlabel(f"prefill workers / {data['split_workers']}")
    ax.set_ylabel("goodput per worker (req/s within SLO)")
    ax.set_title("disaggregation pays where a split's curve is above its colocated line")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default=str(OUT / "planner_profile.json"))
    parser.add_argument("--workers", type=int, default=1000)
    parser.add_argument("--requests", type=int, default=1_000_000)
    parser.add_argument("--prefill-share", type=float, default=0.25, help="share of the scale run's workers prefilling")
    parser.add_argument("--split-workers", type=int, default=8)
    parser.add_argument("--split-requests", type=int, default=400, help="requests per simulation in the splits")
    parser.add_argument(
        "--shards",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="processes the scale run is split over (planner.shards; default: one a core)",
    )
    parser.add_argument("--skip-scale", action="store_true")
    parser.add_argument(
        "--breakdown-requests",
        type=int,
        default=20000,
        help="requests of the profiled run that splits the time by module",
    )
    args = parser.parse_args()
    prof = profiles.load(args.profile)
    print(f"goodput per worker by split ({args.split_workers} workers):")
    data: dict = {"profile": args.profile, "split_workers": args.split_workers}
    data["splits"] = splits(prof, args.split_workers, args.split_requests)
    print(
        f"\n{'workload':<18}{'TTFT SLO':>10}{'TPOT SLO':>10}{'colocated':>11}{'best split':>12}{'gain':>7}  pays at P ="
    )
    for title, d in data["splits"].items():
        print(
            f"{title:<18}{d['slo']['ttft_s']:>9.2f}s{d['slo']['tpot_s'] * 1e3:>8.0f}ms{d['colocated']:>11.3f}"
            f"{d['best_split']:>12}{d['best_gain']:>6.2f}x  {d['pays_at_prefill_workers'] or 'nowhere'}"
        )
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "planner_scale.json").write_text(json.dumps(data, indent=1))
    plot(data, OUT / "planner_scale.png")
    if not args.skip_scale:
        print(f"\nscale: {args.workers} workers, {args.requests} requests, {args.shards} shards ...", flush=True)
        s = data["scale"] = scale(prof, args.workers, args.requests, args.prefill_share, args.shards)
        print(
            f"{'layout':<12}{'requests':>10}{'rate':>9}{'simulated':>11}{'wall':>9}{'steps':>12}{'steps/s':>10}"
            f"{'TTFT p99':>10}{'TPOT p99':>10}\n{s['layout']:<12}{s['requests']:>10}{s['rate_req_s']:>8.0f}/s"
            f"{s['simulated_s']:>10.0f}s{s['wall_s']:>8.0f}s{s['steps']:>12}{s['steps_per_wall_s']:>10.0f}"
            f"{s['summary']['ttft_p99_s']:>9.2f}s{s['summary']['tpot_p99_s'] * 1e3:>8.0f}ms"
        )
        if args.breakdown_requests:
            share = s["workers"] // args.shards
            b = data["breakdown"] = breakdown(
                prof, s["layout"], share, args.breakdown_requests, s["rate_req_s"] / args.shards
            )
            print(f"\nwhere a shard's time goes ({share} workers, {args.breakdown_requests} requests, cProfile):")
            for part, fraction in b.items():
                print(f"  {part:<44}{fraction:>6.1%}")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "planner_scale.json").write_text(json.dumps(data, indent=1))
    plot(data, OUT / "planner_scale.png")
    print(f"wrote {OUT / 'planner_scale.json'} and {OUT / 'planner_scale.png'}")


if __name__ == "__main__":
    main()
