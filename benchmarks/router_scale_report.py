"""The report of `router_scale.py`: the printed tables, where the time goes, the goals met or missed,
and the figures (`router_scale.png`, `router_scale_cluster.png`)."""

from __future__ import annotations

import os
from pathlib import Path


def print_rates(results: dict) -> None:
    print("\nrouter overhead (TTFT via router - TTFT direct, same quantile) and sustained rate, 16-token streams")
    print(f"{'workers':>8} {'routers':>7} {'offered':>8} {'achieved':>8} {'p50 ms':>7} {'p99 ms':>7} "
          f"{'router cpu ms/req':>17} {'fleet cpu ms/req':>16}")  # fmt: skip
    for run in results["rate"]:
        for r in run["rows"]:
            print(f"{run['workers']:>8} {run['routers']:>7} {r['offered']:>8.0f} {r['achieved']:>8.0f} "
                  f"{r['overhead_p50_ms']:>7.2f} {r['overhead_p99_ms']:>7.2f} "
                  f"{r['router_cpu_s_per_req'] * 1e3:>17.2f} {r['fleet_cpu_s_per_req'] * 1e3:>16.2f}")  # fmt: skip
        idle = run["idle_router_cpu"]
        print(f"{'':>8} sustained: {run['sustained_rps']:.0f} req/s; idle router CPU (watch streams) {idle:.0%}")


def print_floor(results: dict) -> None:
    """grpc.aio's floors on the router's core beside the router, rate by rate."""
    router = {r["offered"]: r["router_cpu_s_per_req"] for r in results["rate"][0]["rows"]}
    floors = {f["offered"]: f for f in results["floor"]["rows"]}
    print("\ngrpc.aio's floors on the router's core, no Tandem code: a bare Generate writing the same 16 messages"
          " (public side), and a bare relay over the fleet's step streams (whole path)")  # fmt: skip
    print(f"{'offered':>8} {'relay achieved':>14} {'public ms/req':>13} {'relay ms/req':>12} {'router ms/req':>13}"
          f" {'router / relay':>14}")  # fmt: skip
    nan = float("nan")
    for r in results["relay_floor"]["rows"]:
        public = floors.get(r["offered"], {}).get("floor_cpu_s_per_req", nan)
        mine, relay = router.get(r["offered"], nan), r["floor_cpu_s_per_req"]
        print(f"{r['offered']:>8.0f} {r['achieved']:>14.0f} {public * 1e3:>13.2f} {relay * 1e3:>12.2f}"
              f" {mine * 1e3:>13.2f} {mine / relay:>14.2f}")  # fmt: skip
    print(f"{'':>8} sustained: public side {results['floor']['sustained_rps']:.0f} req/s, relay"
          f" {results['relay_floor']['sustained_rps']:.0f} req/s")  # fmt: skip


def print_table(results: dict) -> None:
    print("\nplacement (one choice after one worker's snapshot changed)")
    print(f"{'workers':>8} {'pushed us':>10} {'polled compute us':>18} {'vs 16':>6}")
    at16 = next(r["pushed_us"] for r in results["placement"] if r["workers"] == 16)
    for r in results["placement"]:
        print(
            f"{r['workers']:>8} {r['pushed_us']:>10.1f} {r['polled_compute_us']:>18.1f} {r['pushed_us'] / at16:>6.2f}"
        )
    print_rates(results)
    print("\nper-token relay (closed loop, 64-token streams, workers that do not wait)")
    head = ("concurrency", "direct ms/tok", "router ms/tok", "added ms/tok", "router CPU ms/tok")
    print(" ".join(f"{h:>{w}}" for h, w in zip(head, (11, 13, 13, 12, 17), strict=True)))
    for r in results["relay"]:
        added, cpu = r["latency_ms_per_token"], r["relay_ms_per_token"]
        print(f"{r['concurrency']:>11} {r['direct_ms']:>13.3f} {r['router_ms']:>13.3f} {added:>12.3f} {cpu:>17.3f}")
    if "cluster" in results:
        print_cluster(results["cluster"])
    print("\nwhere the time goes")
    for line in breakdown(results):
        print(f"  {line}")
    print("\ngoals")
    for name, (value, goal, met) in results["goals"].items():
        print(f"  {name}: {value} (goal {goal}) {'met' if met else 'MISSED'}")


def print_cluster(c: dict) -> None:
    print("\nreal local cluster (demo model; 1 prefill + 1 decode worker, one CPU each), beside the engine alone")
    print(f"{'':<34}{'cluster':>12}{'engine alone':>14}{'ratio':>8}")
    tpot, engine = c["c1"]["tpot_ms"]["mean"], c["engine_c1"]["tpot_ms"]
    print(f"{'TPOT ms, concurrency 1 (1 thread)':<34}{tpot:>12.2f}{engine:>14.2f}{tpot / engine:>8.2f}")
    tput = c["c32"]["output_token_throughput"]
    for threads, e in c["engine_c32"].items():
        alone = e["output_token_throughput"]
        label = f"output tok/s, conc. 32 ({threads} thr)"
        print(f"{label:<34}{tput:>12.0f}{alone:>14.0f}{tput / alone:>8.2f}")
    print(f"{'TTFT ms, concurrency 1':<42}{'p50':>8}{'p99':>10}   placements")
    for name, t in c["ttft"].items():
        placed = ", ".join(f"{k} {n}" for k, n in c.get("placements", {}).get(name, {}).items())
        print(f"  {name:<40}{t['median']:>8.2f}{t['p99']:>10.2f}   {placed}")


def breakdown(results: dict) -> list[str]:
    lines = []
    for run in results["rate"]:
        if run["routers"] != 1 or not run["rows"]:
            continue
        first = run["rows"][0]
        per_req, fleet = first["router_cpu_s_per_req"] * 1e3, first["fleet_cpu_s_per_req"] * 1e3
        lines.append(
            f"{run['workers']} workers: router CPU {per_req:.2f} ms per 16-token request at {first['offered']:.0f}"
            f" req/s (16 messages out, its entries of the workers' step frames in, one call; its Watch streams"
            f" alone keep {run['idle_router_cpu']:.0%} of a core busy); the fake fleet {fleet:.2f} ms per request"
        )
    if "cluster" in results:
        lines += cluster_breakdown(results["cluster"])
    if "pinned" in results:
        last = results["rate"][-1]["rows"][-1]
        per_req = last["router_cpu_s_per_req"]
        lines.append(
            f"at {last['offered']:.0f} req/s offered: the router's core spent {per_req * 1e3:.2f} ms"
            f" per request ({last['achieved'] * per_req:.0%} of it busy), the fleet's"
            f" {last['fleet_cpu_s_per_req'] * 1e3:.2f} ms (its core also runs this load generator)"
        )
        if "relay_floor" in results:
            relay = results["relay_floor"]["rows"][-1]
            lines.append(
                f"grpc.aio's floor for the same path on the same core (a bare relay over the fleet's step streams,"
                f" no Tandem code): {relay['floor_cpu_s_per_req'] * 1e3:.2f} ms per request at {relay['offered']:.0f}"
                f" offered, sustained {results['relay_floor']['sustained_rps']:.0f} req/s (the public side alone:"
                f" {results['floor']['rows'][-1]['floor_cpu_s_per_req'] * 1e3:.2f} ms, sustained"
                f" {results['floor']['sustained_rps']:.0f})"
            )
        return lines
    lines.append(
        f"all processes share {os.cpu_count()} cores: when router + fleet + load generator fill them, a second router"
        " process has no core of its own to run on"
    )
    return lines


def goals(results: dict) -> dict:
    place = {r["workers"]: r["pushed_us"] for r in results["placement"]}
    out = {"placement 1024 / 16": (round(place[1024] / place[16], 2), "<= 1.2", place[1024] / place[16] <= 1.2)}
    sustained = {(r["workers"], r["routers"]): r["sustained_rps"] for r in results["rate"]}
    for w in sorted({w for w, _ in sustained}):
        if (w, 2) in sustained and sustained[(w, 1)]:
            ratio = sustained[(w, 2)] / sustained[(w, 1)]
            out[f"two routers / one, {w} workers"] = (round(ratio, 2), ">= 1.7", ratio >= 1.7)
    at256 = [r for run in results["rate"] if run["workers"] == 256 and run["routers"] == 1 for r in run["rows"]]
    at1000 = [r for r in at256 if r["offered"] >= 1000 and r["completed"] == r["sent"]]
    p99 = (
        round(at1000[0]["overhead_p99_ms"], 2)
        if at1000
        else f"not sustained (best {sustained.get((256, 1), 0):.0f} req/s)"
    )
    out["overhead p99 at 1000 req/s, 256 workers"] = (
        p99,
        "<= 1 ms",
        bool(at1000) and at1000[0]["overhead_p99_ms"] <= 1,
    )
    worst = max(r["relay_ms_per_token"] for r in results["relay"])
    out["per-token relay, worst concurrency"] = (round(worst, 3), "<= 0.1 ms", worst <= 0.1)
    if "cluster" in results:
        out.update(cluster_goals(results["cluster"]))
    return out


def cluster_breakdown(c: dict) -> list[str]:
    tpot, engine = c["c1"]["tpot_ms"]["mean"], c["engine_c1"]["tpot_ms"]
    itl = c["c1"]["itl_ms"]["mean"]
    alone = c["engine_c32"]["2"]["output_token_throughput"]
    return [
        f"cluster at concurrency 1: {tpot - engine:.2f} ms per token over the engine's own step ({engine:.2f} ms):"
        f" the decode worker's output queue and gRPC stream, the router's relay and the client (ITL {itl:.2f} ms)",
        f"cluster at concurrency 32: {c['c32']['output_token_throughput']:.0f} tok/s against {alone:.0f} for the"
        " engine alone on both cores: the decode worker has one core (the prefill worker the other, idle between"
        " prompts), and the router and this load generator share them",
    ]


def cluster_goals(c: dict) -> dict:
    over = c["c1"]["tpot_ms"]["mean"] - c["engine_c1"]["tpot_ms"]
    ratio = c["c32"]["output_token_throughput"] / c["engine_c32"]["2"]["output_token_throughput"]
    return {
        "cluster TPOT overhead at concurrency 1": (round(over, 2), "<= 0.5 ms", over <= 0.5),
        "cluster / engine throughput at 32, equal cores": (round(ratio, 2), ">= 0.8", ratio >= 0.8),
    }


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4))
    ws = [r["workers"] for r in results["placement"]]
    a.plot(ws, [r["pushed_us"] for r in results["placement"]], "o-", label="pushed view")
    a.plot(ws, [r["polled_compute_us"] for r in results["placement"]], "s--", label="polled (compute only)")
    a.set(xscale="log", yscale="log", xlabel="decode workers", ylabel="us per placement", title="placement")
    a.legend()
    for run in results["rate"]:
        rows = run["rows"]
        b.plot([r["offered"] for r in rows], [r["overhead_p99_ms"] for r in rows], "o-",
               label=f"{run['workers']} workers, {run['routers']} router(s)")  # fmt: skip
    b.set(xlabel="offered req/s", ylabel="p99 overhead ms", title="router overhead")
    b.legend(fontsize=7)
    cs = [r["concurrency"] for r in results["relay"]]
    c.plot(cs, [r["relay_ms_per_token"] for r in results["relay"]], "o-")
    c.axhline(0.1, ls=":", color="grey")
    c.set(xscale="log", xlabel="concurrent streams", ylabel="ms per token", title="relay cost")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def plot_rates(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for run in results["rate"]:
        rows, label = run["rows"], f"{run['workers']} workers, {run['routers']} router(s)"
        a.plot([r["offered"] for r in rows], [r["achieved"] for r in rows], "o-", label=label)
        b.plot([r["offered"] for r in rows], [r["overhead_p99_ms"] for r in rows], "o-", label=label)
    for key, label in (("floor", "grpc.aio, public side alone"), ("relay_floor", "grpc.aio, bare relay")):
        rows = results.get(key, {}).get("rows", [])
        a.plot([r["offered"] for r in rows], [r["achieved"] for r in rows], "s--", label=f"{label} (no Tandem)")
    a.plot([0, 1000], [0, 1000], ls=":", color="grey")
    a.set(xlabel="offered req/s", ylabel="completed req/s", title="16-token streams")
    b.axhline(2.0, ls=":", color="grey")
    b.set(xlabel="offered req/s", ylabel="p99 overhead ms", yscale="symlog", title="router overhead")
    a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def plot_cluster(c: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    names = list(c["ttft"])
    a.bar(range(len(names)), [c["ttft"][n]["median"] for n in names])
    a.set_xticks(range(len(names)), [n.replace(", ", "\n") for n in names], fontsize=7)
    a.set(ylabel="TTFT p50 ms", title="first token, concurrency 1")
    labels = ["cluster", *[f"engine, {t} thr" for t in c["engine_c32"]]]
    values = [c["c32"]["output_token_throughput"], *[e["output_token_throughput"] for e in c["engine_c32"].values()]]
    b.bar(labels, values)
    b.set(ylabel="output tok/s", title="concurrency 32")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
