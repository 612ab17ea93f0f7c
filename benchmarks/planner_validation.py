"""The planner's predictions against real runs on this machine, side by side.

    .venv/bin/python benchmarks/planner_validation.py [--profile P] [--requests 24]

Two layouts of this machine's two cores, as `benchmarks/disagg.py` sets them up (workers in their
own processes pinned with `sched_setaffinity`, the router in this one, KV over gRPC):

- colocated: one decode worker on both cores (2 torch threads) prefills and decodes everything;
- 1P + 1D: a prefill worker on core 0 and a decode worker on core 1 (1 thread each), prompts over
  64 tokens prefilled remotely.

Two workloads, open loop (Poisson arrivals, the same draws for the simulation and the real run):
`disagg` (benchmarks/disagg.py's mix: 3 of 4 requests a 16-token prompt for 64 tokens, 1 of 4 a
1024-token prompt for 4) and `short-chat`, each at three rates: 25 %, 50 % and 80 % of the
better layout's simulated goodput. The model is the `smollm-135m` preset with random weights in
float32 (bfloat16 products are ~5x slower than float32 on a CPU without AVX-512). SLOs come from
the simulated latencies of a request alone (TTFT 3x, TPOT 2x), the same for both layouts.

For each run: predicted and measured TTFT p50/p99, TPOT p50/p99 and goodput, with the prediction's
error. Writes `benchmarks/results/planner_validation.{json,png}`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import disagg  # noqa: E402

from cli.plan import base_layout  # noqa: E402
from cluster.slo import RequestTiming, Targets, goodput, percentile  # noqa: E402
from planner import profile as profiles  # noqa: E402
from planner import search, workload  # noqa: E402
from planner.sim import simulate  # noqa: E402

OUT = ROOT / "benchmarks" / "results"
LAYOUTS = {"1P+1D": {"prefill": "0", "decode": "1"}, "colocated": {"decode": "0,1"}}
METRICS = ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "goodput_req_s")


def config_for(folder: str, colocated: bool):  # type: ignore[no-untyped-def]
    from cluster.config import parse_config

    return parse_config(
        {
            "model": {"path": folder, "dtype": "float32"},
            "cache": {"block_size": 16, "memory_gib": 0.5},
            "scheduler": {"max_num_seqs": 32, "max_num_batched_tokens": 2048, "long_prefill_chunk": 512},
            # a loaded two-core machine can queue a long prompt past the default 30 s transfer timeout
            "transfer": {"transport": "grpc", "layerwise": False, "timeout_s": 900, "lease_s": 900},
            "router": {"local_prefill_max_tokens": 10**6 if colocated else 64},
        }
    )


def sim_layout(config, prof: profiles.Profile, mode: str):  # type: ignore[no-untyped-def]
    if mode == "colocated":
        return replace(base_layout(config, prof, 2), prefill=0, decode=1)
    return replace(base_layout(config, prof, 1), prefill=1, decode=1)


async def drive(address: str, arrivals: list[workload.Arrival], vocab: int, seed: str) -> list[RequestTiming]:
    """Sends `arrivals` open loop. Every run draws its own prompts (`seed`): a run repeating an
    earlier run's prompts would find them in the prefix cache, which the simulation does not."""
    import random

    from router.sdk.client import AsyncClient

    rng = random.Random(seed)
    timings: list[RequestTiming | None] = [None] * len(arrivals)
    async with AsyncClient(address, timeout=600, retries=0) as client:
        start = time.perf_counter()

        async def one(i: int, a: workload.Arrival) -> None:
            await asyncio.sleep(max(0.0, start + a.time - time.perf_counter()))
            prompt = [rng.randrange(3, vocab) for _ in range(a.prompt_tokens)]
            sent, chunks = time.perf_counter(), []
            async for d in client.stream(prompt, max_tokens=a.output_tokens, temperature=0.0, ignore_eos=True):
                chunks.append((time.perf_counter(), len(d.token_ids)))
            timings[i] = RequestTiming(sent, tuple(chunks))

        await asyncio.gather(*(one(i, a) for i, a in enumerate(arrivals)))
    return [t for t in timings if t is not None]


def measure(mode: str, folder: str, runs: list[tuple[workload.Workload, Targets]]) -> list[dict]:
    """Starts the layout once and drives every (workload at a rate) through it, in turn."""
    from cluster.config import dump_config
    from router.service.server import from_config

    config = config_for(folder, mode == "colocated")
    procs, addresses = disagg.launch(LAYOUTS[mode], dump_config(config))
    router = from_config(config, lambda: addresses)
    out = []
    try:
        address = router.start("127.0.0.1:0")
        for wl, targets in runs:
            arrivals = list(workload.arrivals(wl, seed=0))
            started, (busy0, total0) = time.perf_counter(), cpu_ticks()
            cpu0 = {role: process_cpu_s(proc.pid) for role, proc in procs.items()} | {"router": process_cpu_s()}
            vocab = router.settings.limits.vocab_size
            timings = asyncio.run(drive(address, arrivals, vocab, f"{mode} {wl.name} {wl.rate}"))
            duration = max(t.chunks[-1][0] for t in timings) - started
            busy1, total1 = cpu_ticks()
            cpu = {role: process_cpu_s(proc.pid) - cpu0[role] for role, proc in procs.items()}
            cpu["router"] = process_cpu_s() - cpu0["router"]
            seen = observed(timings, targets, duration)
            out.append({**seen, "cpu_busy": (busy1 - busy0) / max(1, total1 - total0), "cpu_s": cpu})
            print(f"  measured {mode} {wl.name} at {wl.rate:.2f} req/s: {duration:.0f} s", flush=True)
    finally:
        router.stop()
        for proc in procs.values():
            proc.stdin.close()  # type: ignore[union-attr]
            proc.wait(30)
    return out


def process_cpu_s(pid: int | None = None) -> float:
    """User + system CPU seconds of a process (this one by default) and its threads, from /proc."""
    fields = Path(f"/proc/{pid or 'self'}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of every core since boot, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def observed(timings: list[RequestTiming], targets: Targets, duration: float) -> dict:
    tpots = [t.tpot for t in timings if t.tpot is not None]
    return {
        "requests": len(timings),
        "ttft_p50_s": percentile([t.ttft for t in timings], 50),
        "ttft_p99_s": percentile([t.ttft for t in timings], 99),
        "tpot_p50_s": percentile(tpots, 50),
        "tpot_p99_s": percentile(tpots, 99),
        "goodput_req_s": goodput(timings, targets, duration),
        "duration_s": duration,
    }


def plan_runs(prof: profiles.Profile, folder: str, requests: int) -> list[dict]:
    """Every (workload, rate) with its SLOs and both layouts' predictions; the rates are shares of
    the better layout's simulated goodput."""
    runs = []
    for name in ("disagg", "short-chat"):
        wl = workload.load(name).with_requests(requests)
        coloc = sim_layout(config_for(folder, True), prof, "colocated")
        targets = search.idle_targets(prof, wl, (coloc, sim_layout(config_for(folder, False), prof, "1P+1D")))
        ev = search.Evaluator(prof, wl, targets, requests=max(requests, 200))
        disagg_layout = sim_layout(config_for(folder, False), prof, "1P+1D")
        capacity = max(ev.goodput(coloc).goodput, ev.goodput(disagg_layout).goodput)
        if capacity <= 0:
            raise SystemExit(f"{name}: neither layout meets the SLOs {targets} at any rate in the simulation")
        for share in (0.25, 0.5, 0.8):
            at = wl.with_rate(share * capacity)
            row = {"workload": name, "rate_req_s": at.rate, "share": share, "slo": vars(targets), "predicted": {}}
            for mode in LAYOUTS:
                layout = sim_layout(config_for(folder, mode == "colocated"), prof, mode)
                row["predicted"][mode] = simulate(prof, layout, at, seed=0).summary(targets)
            runs.append({"row": row, "workload": at, "targets": targets})
    return runs


def error(pred: float, meas: float) -> float:
    return (pred - meas) / meas if meas else float("nan")


def report(rows: list[dict]) -> None:
    head = f"{'workload':<11}{'rate':>6} {'layout':<10}"
    for m in ("TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "goodput"):
        head += f"{m + ' pred/meas (err)':>27}"
    print(head)
    for row in rows:
        for mode in LAYOUTS:
            p, m = row["predicted"][mode], row["measured"][mode]
            line = f"{row['workload']:<11}{row['rate_req_s']:>6.2f} {mode:<10}"
            for key in METRICS:
                scale, unit = (1e3, "ms") if "tpot" in key else (1.0, "s" if "ttft" in key else "")
                line += f"{p[key] * scale:>9.2f}/{m[key] * scale:<7.2f}{unit:<2}({error(p[key], m[key]):+5.0%})"
            print(line)


def breakdown(rows: list[dict]) -> None:
    """Where the time went: each worker's predicted busy seconds against the CPU seconds its process
    used, and the router's (the benchmark process: router and client) CPU seconds, per run."""
    print(f"\n{'workload':<11}{'rate':>6} {'layout':<10}{'span pred/meas':>18}{'decode busy/CPU':>18}"
          f"{'prefill busy/CPU':>19}{'router CPU':>12}")  # fmt: skip
    for row in rows:
        for mode in LAYOUTS:
            p, m = row["predicted"][mode], row["measured"][mode]
            line = f"{row['workload']:<11}{row['rate_req_s']:>6.2f} {mode:<10}"
            line += f"{p['duration_s']:>10.0f}/{m['duration_s']:<5.0f}s "
            for role in ("decode", "prefill"):
                if role in m["cpu_s"]:
                    busy = p.get(f"{role}_utilisation", 0.0) * p.get(f"{role}_workers", 0.0) * p["duration_s"]
                    line += f"{busy:>10.1f}/{m['cpu_s'][role]:<6.1f}s "
                else:
                    line += f"{'-':>18} "
            print(line + f"{m['cpu_s']['router']:>9.1f} s")


def rankings(rows: list[dict]) -> list[dict]:
    """Per run: does the predicted goodput order of the layouts match the measured one?"""
    out = []
    for row in rows:
        pred = sorted(LAYOUTS, key=lambda mode: -row["predicted"][mode]["goodput_req_s"])
        meas = sorted(LAYOUTS, key=lambda mode: -row["measured"][mode]["goodput_req_s"])
        out.append({"workload": row["workload"], "rate": row["rate_req_s"], "predicted": pred, "measured": meas})
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(METRICS), figsize=(17, 3.6))
    for ax, key in zip(axes, METRICS, strict=True):
        for mode, marker in zip(LAYOUTS, ("o", "s"), strict=True):
            for wl, color in (("disagg", "tab:blue"), ("short-chat", "tab:orange")):
                pts = [(r["measured"][mode][key], r["predicted"][mode][key]) for r in rows if r["workload"] == wl]
                ax.scatter(*zip(*pts, strict=True), marker=marker, color=color, label=f"{wl} {mode}")
        hi = max([r[side][mode][key] for r in rows for side in ("measured", "predicted") for mode in LAYOUTS] + [1e-9])
        ax.plot([0, hi], [0, hi], "k-", lw=0.8)
        ax.fill_between([0, hi], [0, hi * 0.8], [0, hi * 1.2], color="gray", alpha=0.15)
        ax.set_title(key)
        ax.set_xlabel("measured")
        ax.set_ylabel("predicted")
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default=str(OUT / "planner_profile.json"), help="`tandem profile` of this model")
    parser.add_argument("--requests", type=int, default=24, help="requests per run")
    args = parser.parse_args()
    prof = profiles.load(args.profile)
    from cluster.model.builder import init_model_folder

    with tempfile.TemporaryDirectory() as folder:
        init_model_folder(folder, "smollm-135m", dtype="float32", seed=0)
        runs = plan_runs(prof, folder, args.requests)
        for mode in LAYOUTS:
            measured = measure(mode, folder, [(r["workload"], r["targets"]) for r in runs])
            for run, m in zip(runs, measured, strict=True):
                run["row"].setdefault("measured", {})[mode] = m
            OUT.mkdir(parents=True, exist_ok=True)  # what is measured so far, in case a later layout fails
            (OUT / "planner_validation.json").write_text(json.dumps({"rows": [r["row"] for r in runs]}, indent=1))
    rows = [r["row"] for r in runs]
    report(rows)
    breakdown(rows)
    ranks = rankings(rows)
    agree = sum(r["predicted"] == r["measured"] for r in ranks)
    print(f"goodput ranking of the layouts right in {agree} of {len(ranks)} runs")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "planner_validation.json").write_text(
        json.dumps({"args": vars(args), "rows": rows, "rankings": ranks}, indent=1)
    )
    plot(rows, OUT / "planner_validation.png")
    print(f"wrote {OUT / 'planner_validation.json'} and {OUT / 'planner_validation.png'}")


if __name__ == "__main__":
    main()
