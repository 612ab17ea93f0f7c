"""The CPU kernels' instruction sets against torch's own paths, on the same model, in one run.

    .venv/bin/python benchmarks/cpu_kernel_paths.py [--model DIR|FILE.gguf] [--dtypes float32,bfloat16]
                                                    [--isa avx2] [--rounds 2]

Each path is a process of its own (a process loads one build of the kernels): torch's kernels alone
(`TANDEM_CPU_KERNELS=0`), then each instruction set of `cluster.model.cpu_kernels.VARIANTS` this CPU
runs. The paths take turns, round after round (A B C A B C), and each row is the median over its
rounds of the median eager decode step (the default serving path) at batch 1 and 16 with a
512-token context, with the bytes the step must read, the bandwidth that gives, and its fraction of
the memory floor measured beside it (a large float32 `sum`).

`--isa avx2` runs what an AVX2-only CPU (AMD Zen 3) runs, on a CPU with AVX-512: torch's own kernels
held to AVX2 (`ATEN_CPU_CAPABILITY`, `ONEDNN_MAX_CPU_ISA`, `MKL_ENABLE_INSTRUCTIONS`) against the
kernels' AVX2 build. It is a stand-in for such a machine (same memory, same cores), not one.

Without `--model` it runs the `smollm-135m` preset (random weights). Prints a table, writes
`benchmarks/results/cpu_kernel_paths[_avx2].{json,png}` (`_avx2_machine` where the CPU itself has no
AVX-512).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

OUT = ROOT / "benchmarks" / "results"
BATCHES = (1, 16)
AVX2_ONLY = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def measure(folder: str, dtype: str, repeat: int, threads: int) -> dict:
    """This process's path: the step time, bytes and floor at each batch."""
    import torch
    from decode_roofline_measure import CONTEXT, _NoText, step_bytes, tandem_step_time

    from cluster.config import CacheConfig, SchedulerConfig
    from cluster.model import cpu_kernels
    from cluster.model.loader import load_model
    from decode_worker.engine import Engine

    torch.set_num_threads(threads)
    model = load_model(Path(folder), dtype, "cpu")
    engine = Engine(
        model, _NoText(), CacheConfig(block_size=16, num_blocks=16 * (CONTEXT // 16 + 2)),
        SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=2048),
    )  # fmt: skip
    rows = {}
    for batch in BATCHES:
        step_s, bandwidth, _ = tandem_step_time(engine, batch, "cpu", repeat, matmul=False)
        nbytes, _ = step_bytes(model, batch, CONTEXT)
        rows[batch] = {"step_ms": step_s * 1e3, "bytes": nbytes, "floor_gbps": bandwidth / 1e9}
    return {"kernels": cpu_kernels.variant() if cpu_kernels.used() else "torch", "rows": rows}


def run_path(path: str, folder: Path, dtype: str, args: argparse.Namespace) -> dict:
    env = {**os.environ, "TANDEM_CPU_KERNELS": "0" if path == "torch" else path}
    if args.isa == "avx2":
        env.update(AVX2_ONLY)
    command = [sys.executable, __file__, "--one", str(folder), "--dtypes", dtype, "--repeat", str(args.repeat)]
    done = subprocess.run([*command, "--threads", str(args.threads)], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{path} {dtype} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a model folder or GGUF file (default: the smollm-135m preset)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--isa", default="native", choices=["native", "avx2"], help="avx2: what an AVX2 CPU runs")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5, help="runs of steps per measurement")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a path's own process
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(measure(args.one, args.dtypes, args.repeat, args.threads)))
        return

    from decode_roofline import bench_model

    from cluster.cpu import cpu_kind
    from cluster.model import cpu_kernels

    folder, _ = bench_model(args.model, quick=False)
    paths = ["torch", *(["avx2"] if args.isa == "avx2" else cpu_kernels.supported())]
    samples: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.rounds):
        for dtype in args.dtypes.split(","):
            for path in paths:
                samples.setdefault((dtype, path), []).append(run_path(path, folder, dtype, args))
    records = []
    print(f"\n{cpu_kind()}, {args.threads} threads, {folder.name}, torch held to {args.isa}")
    header = f"{'dtype':<10}{'path':<14}{'batch':>6}{'ms/step':>10}{'MB/step':>9}{'GB/s':>7}{'roofline':>10}"
    print(header + f"{'vs torch':>10}")
    for (dtype, path), runs in samples.items():
        for batch in BATCHES:
            key = str(batch)
            step = statistics.median(r["rows"][key]["step_ms"] for r in runs)
            floor = statistics.median(r["rows"][key]["floor_gbps"] for r in runs)
            nbytes = runs[0]["rows"][key]["bytes"]
            torch_step = statistics.median(r["rows"][key]["step_ms"] for r in samples[(dtype, "torch")])
            gbps = nbytes / step / 1e6
            record = {
                "dtype": dtype, "path": path, "ran": runs[0]["kernels"], "batch": batch, "step_ms": step,
                "bytes": nbytes, "gbps": gbps, "floor_gbps": floor, "roofline": gbps / floor,
                "speedup_vs_torch": torch_step / step, "rounds": [r["rows"][key]["step_ms"] for r in runs],
            }  # fmt: skip
            records.append(record)
            print(
                f"{dtype:<10}{path:<14}{batch:>6}{step:>10.2f}{nbytes / 1e6:>9.0f}{gbps:>7.1f}"
                f"{record['roofline']:>10.0%}{record['speedup_vs_torch']:>9.2f}x"
            )
    # an AVX-512 machine's own paths, its AVX2 stand-in, or an AVX2-only machine's own
    suffix = "_avx2" if args.isa == "avx2" else "" if "AVX-512" in cpu_kind() else "_avx2_machine"
    name = "cpu_kernel_paths" + suffix
    OUT.mkdir(parents=True, exist_ok=True)
    meta = {"cpu": cpu_kind(), "threads": args.threads, "model": folder.name, "isa": args.isa}
    (OUT / f"{name}.json").write_text(json.dumps({**meta, "rows": records}, indent=1))
    plot(records, OUT / f"{name}.png", meta)
    print(f"\nwrote {OUT / name}.json and .png")


def plot(records: list[dict], path: Path, meta: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["dtype"], r["batch"]) for r in records})
    paths = list(dict.fromkeys(r["path"] for r in records))
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(paths)
    for i, p in enumerate(paths):
        by_group = {(r["dtype"], r["batch"]): r["roofline"] for r in records if r["path"] == p}
        values = [by_group.get(g, 0) for g in groups]
        ax.bar([j + i * width for j in range(len(groups))], values, width, label=p)
    ax.set_xticks([j + width * (len(paths) - 1) / 2 for j in range(len(groups))])
    ax.set_xticklabels([f"{d}\nbatch {b}" for d, b in groups])
    ax.set_ylabel("fraction of the memory floor")
    ax.set_title(f"Decode step by kernel path ({meta['cpu']}, torch held to {meta['isa']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
