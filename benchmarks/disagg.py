"""Does disaggregation pay on this machine? The same workload against two layouts of the same cores.

    .venv/bin/python benchmarks/disagg.py [--duration 30]

Workload (`smollm-135m` preset, random weights, bfloat16): steady decodes — `--streams` clients each
sending a 16-token prompt for 64 output tokens, back to back — plus, every `--burst-every` seconds,
a burst of `--burst-size` 1024-token prompts wanting 4 tokens.

- colocated: one decode worker on both cores (2 torch threads) prefills and decodes everything
  (chunked prefill, 512 tokens per request per step);
- disaggregated: one prefill worker on core 0 and one decode worker on core 1 (1 thread each),
  long prompts prefilled on the prefill worker and their KV shipped over gRPC; the short prompts
  are prefilled on the decode worker.

Workers are separate processes pinned with `sched_setaffinity`; the router runs here. Reports TTFT
p99 of the burst prompts, TPOT and ITL p99 of the steady streams, and goodput against
`--slo-ttft` / `--slo-tpot`, side by side. Writes `benchmarks/results/disagg.{json,png}`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OUT = ROOT / "benchmarks" / "results"
LONG_PROMPT, SHORT_PROMPT, SHORT_OUTPUT = 1024, 16, 64


def worker_main(role: str, cpus: str, config_json: str) -> None:
    """Runs in a worker process: pin, build, serve, print the address, wait for stdin to close."""
    cores = {int(c) for c in cpus.split(",")}
    os.sched_setaffinity(0, cores)
    import torch

    torch.set_num_threads(len(cores))
    from cluster.config import ClusterConfig

    config = ClusterConfig.model_validate_json(config_json)
    if role == "prefill":
        from prefill_worker.service import from_config
    else:
        from decode_worker.service import from_config  # type: ignore[no-redef]
    worker = from_config(config, f"{role}-0")
    print(worker.start("127.0.0.1:0"), flush=True)
    sys.stdin.read()
    worker.stop()


def cluster_config(folder: str, colocated: bool):  # type: ignore[no-untyped-def]
    from cluster.config import parse_config

    return parse_config(
        {
            "model": {"path": folder, "dtype": "bfloat16"},
            "cache": {"block_size": 16, "memory_gib": 0.5},
            "scheduler": {"max_num_seqs": 32, "max_num_batched_tokens": 2048, "long_prefill_chunk": 512},
            "transfer": {"transport": "grpc", "layerwise": False},
            "router": {"local_prefill_max_tokens": 10**6 if colocated else 64},
        }
    )


def launch(layout: dict[str, str], config_json: str) -> tuple[dict[str, subprocess.Popen], dict[str, str]]:
    procs, addresses = {}, {}
    for role, cpus in layout.items():
        procs[role] = subprocess.Popen(
            [sys.executable, __file__, "--worker", role, "--cpus", cpus],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, "TANDEM_CONFIG": config_json},
        )  # fmt: skip
    for role, proc in procs.items():
        addresses[f"{role}-0"] = proc.stdout.readline().strip()  # type: ignore[union-attr]
    return procs, addresses


async def workload(address: str, args: argparse.Namespace, vocab: int) -> dict[str, list]:
    import random

    from cluster.slo import RequestTiming
    from router.sdk.client import AsyncClient

    rng = random.Random(0)
    timings: dict[str, list] = {"steady": [], "burst": []}
    stop_at = time.perf_counter() + args.duration

    async with AsyncClient(address, timeout=300, retries=0) as client:

        async def one(kind: str, prompt_len: int, max_tokens: int) -> None:
            prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
            sent, chunks = time.perf_counter(), []
            async for d in client.stream(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True):
                chunks.append((time.perf_counter(), len(d.token_ids)))
            timings[kind].append(RequestTiming(sent, tuple(chunks)))

        async def steady() -> None:
            while time.perf_counter() < stop_at:
                await one("steady", SHORT_PROMPT, SHORT_OUTPUT)

        async def bursts() -> None:
            tasks = []
            await asyncio.sleep(args.burst_every / 2)
            while time.perf_counter() < stop_at:
                tasks += [asyncio.create_task(one("burst", LONG_PROMPT, 4)) for _ in range(args.burst_size)]
                await asyncio.sleep(args.burst_every)
            await asyncio.gather(*tasks)

        await asyncio.gather(bursts(), *(steady() for _ in range(args.streams)))
    return timings


def measure(mode: str, folder: str, args: argparse.Namespace) -> dict:
    from cluster.config import dump_config
    from cluster.slo import Targets, goodput, percentile
    from router.service.server import from_config

    config = cluster_config(folder, mode == "colocated")
    layout = {"decode": "0,1"} if mode == "colocated" else {"prefill": "0", "decode": "1"}
    procs, addresses = launch(layout, dump_config(config))
    router = from_config(config, lambda: addresses)
    try:
        address = router.start("127.0.0.1:0")
        started = time.perf_counter()
        timings = asyncio.run(workload(address, args, router.settings.limits.vocab_size))
        duration = time.perf_counter() - started
    finally:
        router.stop()
        for proc in procs.values():
            proc.stdin.close()  # type: ignore[union-attr]
            proc.wait(30)
    steady, burst = timings["steady"], timings["burst"]
    targets = Targets(args.slo_ttft, args.slo_tpot)
    return {
        "mode": mode,
        "cores": layout,
        "requests": {"steady": len(steady), "burst": len(burst)},
        "burst_ttft_p99_s": percentile([t.ttft for t in burst], 99),
        "burst_ttft_median_s": percentile([t.ttft for t in burst], 50),
        "steady_tpot_p99_s": percentile([t.tpot for t in steady if t.tpot], 99),
        "steady_tpot_median_s": percentile([t.tpot for t in steady if t.tpot], 50),
        "steady_itl_p99_s": percentile([g for t in steady for g in t.itl], 99),
        "output_tokens_per_s": sum(t.output_tokens for t in steady + burst) / duration,
        "goodput_req_s": goodput(steady + burst, targets, duration),
        "slo_attainment": sum(targets.met(t.ttft, t.tpot) for t in steady + burst) / max(1, len(steady + burst)),
        "timings": {k: [[t.sent, list(t.chunks)] for t in v] for k, v in timings.items()},
    }


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [
        ("burst_ttft_p99_s", "burst TTFT p99 (s)"),
        ("steady_tpot_p99_s", "steady TPOT p99 (s)"),
        ("steady_itl_p99_s", "steady ITL p99 (s)"),
        ("goodput_req_s", "goodput (req/s)"),
    ]
    fig, axes = plt.subplots(1, len(metrics), figsize=(14, 3.5))
    for ax, (key, title) in zip(axes, metrics, strict=True):
        ax.bar([r["mode"] for r in results], [r[key] for r in results], color=["tab:gray", "tab:blue"])
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of load per layout")
    parser.add_argument("--streams", type=int, default=6, help="steady decode clients")
    parser.add_argument("--burst-every", type=float, default=4.0, help="seconds between bursts")
    parser.add_argument("--burst-size", type=int, default=2, help="long prompts per burst")
    parser.add_argument("--slo-ttft", type=float, default=4.0, help="TTFT target for goodput, seconds")
    parser.add_argument("--slo-tpot", type=float, default=0.1, help="TPOT target for goodput, seconds")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--cpus", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker_main(args.worker, args.cpus, os.environ["TANDEM_CONFIG"])
        return
    from cluster.model.builder import init_model_folder

    with tempfile.TemporaryDirectory() as folder:
        init_model_folder(folder, "smollm-135m", dtype="bfloat16", seed=0)
        results = [measure(mode, folder, args) for mode in ("colocated", "disaggregated")]
    print(
        f"{'layout':<15}{'burst TTFT p99':>15}{'steady TPOT p99':>17}{'steady ITL p99':>16}{'tok/s':>8}{'goodput':>9}"
    )
    for r in results:
        print(
            f"{r['mode']:<15}{r['burst_ttft_p99_s']:>14.2f}s{r['steady_tpot_p99_s'] * 1e3:>15.1f}ms"
            f"{r['steady_itl_p99_s'] * 1e3:>14.1f}ms{r['output_tokens_per_s']:>8.0f}{r['goodput_req_s']:>9.2f}"
        )
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "disagg.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    plot(results, OUT / "disagg.png")
    print(f"wrote {OUT / 'disagg.json'} and {OUT / 'disagg.png'}")


if __name__ == "__main__":
    main()
