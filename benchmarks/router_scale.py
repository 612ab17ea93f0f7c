"""The router at cluster scale, measured alone: fake workers (no model, real gRPC), real routers.

    .venv/bin/python benchmarks/router_scale.py [--quick] [--table]

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
`benchmarks/results/router_scale.{json,png}`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "proto"))

import grpc  # noqa: E402
from tandem.v1 import api_pb2, api_pb2_grpc, worker_pb2, worker_pb2_grpc  # noqa: E402

OUT = ROOT / "benchmarks" / "results"
PY = sys.executable


# -- 1. placement ------------------------------------------------------------------------------------


def placement_cost(num_decode: int, calls: int) -> dict:
    import random

    from router.index import LoadIndex
    from router.placement import choose

    rng = random.Random(num_decode)
    index, loads = LoadIndex(stale_after_s=1e9), {}
    names = [f"decode-{i}" for i in range(num_decode)] + [f"prefill-{i}" for i in range(max(1, num_decode // 4))]

    def load(name: str) -> worker_pb2.WorkerLoad:
        role = name.split("-")[0]
        return worker_pb2.WorkerLoad(
            role=role, running_seqs=rng.randrange(8), free_kv_blocks=rng.randrange(200, 1000), total_kv_blocks=1000,
            queued_prompt_tokens=rng.randrange(500) if role == "prefill" else 0,
        )  # fmt: skip

    for name in names:
        loads[name] = load(name)
        index.update(name, loads[name])
    prompts = [[rng.randrange(1000) for _ in range(rng.choice([20, 200]))] for _ in range(64)]
    changes = [(rng.choice(names), None) for _ in range(calls)]
    changes = [(n, load(n)) for n, _ in changes]

    def timed(fn, n: int) -> float:  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        for i in range(n):
            fn(i)
        return (time.perf_counter() - start) / n

    def update(i: int) -> None:
        index.update(*changes[i])

    def pushed(i: int) -> None:
        index.choose(prompts[i % 64], 16, 16, 64)

    def polled(i: int) -> None:
        name, new = changes[i]
        loads[name] = new
        choose(prompts[i % 64], 16, loads, 16, 64)

    update_s = statistics.median(timed(update, calls) for _ in range(5))
    pushed_s = statistics.median(timed(pushed, calls) for _ in range(5))
    polled_s = statistics.median(timed(polled, max(20, calls // max(1, num_decode // 16))) for _ in range(3))
    return {"workers": num_decode, "pushed_us": pushed_s * 1e6, "update_us": update_s * 1e6,
            "polled_compute_us": polled_s * 1e6}  # fmt: skip


# -- processes ----------------------------------------------------------------------------------------


def start_fleet(workers: int, step_s: float) -> tuple[subprocess.Popen, dict[str, str]]:
    fleet = subprocess.Popen(
        [PY, "-m", "router.fake_workers", "--workers", str(workers), "--step-s", str(step_s)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT, env=_env(), text=True,
    )  # fmt: skip
    return fleet, json.loads(fleet.stdout.readline())  # type: ignore[union-attr]


def start_router(addresses: dict[str, str]) -> tuple[subprocess.Popen, str]:
    router = subprocess.Popen(
        [PY, __file__, "--serve-router", json.dumps(addresses)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT, env=_env(), text=True,
    )  # fmt: skip
    return router, router.stdout.readline().strip()  # type: ignore[union-attr]


def stop(process: subprocess.Popen) -> None:
    process.stdin.close()  # type: ignore[union-attr]
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def serve_router(addresses: str) -> None:
    """This script as a router process over the fake workers; prints its address, stops on EOF."""
    from cluster.config import TelemetryConfig
    from cluster.telemetry import Telemetry
    from router.fake_workers import VOCAB, FakeTokenizer
    from router.pool import WorkerPool
    from router.server import Router
    from router.settings import RouterSettings
    from router.validate import Limits

    found = json.loads(addresses)
    settings = RouterSettings(
        model_name="fake", architecture="fake", limits=Limits(4096, VOCAB), block_size=16, eos_token_ids=(),
        has_chat_template=False, dtype="none", max_queued_requests=2048,
    )  # fmt: skip
    router = Router(settings, FakeTokenizer(), WorkerPool(lambda: found), Telemetry(TelemetryConfig(), "bench-router"))
    print(router.start("127.0.0.1:0"), flush=True)
    sys.stdin.read()
    router.stop()


# -- 2 and 3: load ------------------------------------------------------------------------------------


class Target:
    """Streams to routers (Generate) or straight to fake workers (Submit), round robin."""

    def __init__(self, addresses: list[str], direct: bool, max_tokens: int) -> None:
        self.addresses, self.direct, self.max_tokens, self.n = addresses, direct, max_tokens, 0
        self.channels: list[grpc.aio.Channel] = []  # made on the running loop: aio channels belong to one

    def run(self, fn, *args):  # type: ignore[no-untyped-def]
        """`fn(self, *args)` on a fresh event loop."""

        async def main():  # type: ignore[no-untyped-def]
            self.channels = [grpc.aio.insecure_channel(a) for a in self.addresses for _ in range(4)]
            try:
                return await fn(self, *args)
            finally:
                for channel in self.channels:
                    await channel.close()

        return asyncio.run(main())

    async def stream(self) -> tuple[float, float, int]:
        """(TTFT, E2E, tokens) of one stream."""
        self.n += 1
        channel = self.channels[self.n % len(self.channels)]
        sampling = api_pb2.SamplingParams(max_tokens=self.max_tokens, temperature=0)
        start = time.perf_counter()
        if self.direct:
            call = worker_pb2_grpc.WorkerStub(channel).Submit(
                worker_pb2.WorkerRequest(request_id=f"r{self.n}", prompt_token_ids=[1, 2, 3], sampling=sampling)
            )
        else:
            call = api_pb2_grpc.TandemStub(channel).Generate(api_pb2.GenerateRequest(text="a b c", sampling=sampling))
        first, tokens = None, 0
        async for msg in call:
            first = first or time.perf_counter()
            tokens += len(msg.token_ids)
        return (first or time.perf_counter()) - start, time.perf_counter() - start, tokens


async def open_loop(target: Target, rate: float, duration_s: float) -> dict:
    tasks, start = [], time.perf_counter()
    n = int(rate * duration_s)
    for i in range(n):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(target.stream()))
    results = await asyncio.gather(*tasks, return_exceptions=True)
    elapsed = time.perf_counter() - start
    ok = [r for r in results if not isinstance(r, BaseException) and r[2] == target.max_tokens]
    ttfts = sorted(r[0] for r in ok)
    return {
        "offered": rate, "completed": len(ok), "sent": n, "achieved": len(ok) / elapsed,
        "ttft_p50_ms": _q(ttfts, 0.5) * 1e3, "ttft_p99_ms": _q(ttfts, 0.99) * 1e3,
    }  # fmt: skip


async def closed_loop(target: Target, concurrency: int, streams: int) -> tuple[float, int]:
    """(seconds per token of one stream, tokens) with `concurrency` streams kept open."""
    tokens, start = 0, time.perf_counter()

    async def worker(k: int) -> None:
        nonlocal tokens
        for _ in range(k):
            got = (await target.stream())[2]
            tokens += got

    per = max(1, streams // concurrency)
    await asyncio.gather(*(worker(per) for _ in range(concurrency)))
    return (time.perf_counter() - start) / (tokens / concurrency), tokens


def _q(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def sustained(rows: list[dict]) -> float:
    good = [r["offered"] for r in rows if r["completed"] == r["sent"] and r["achieved"] >= 0.95 * r["offered"]]
    return max(good, default=0.0)


def rate_rows(workers: int, routers: int, rates: list[float], duration_s: float, step_s: float) -> dict:
    fleet, addresses = start_fleet(workers, step_s)
    procs = [start_router(addresses) for _ in range(routers)]
    try:
        time.sleep(1.0)
        cpu = [cpu_seconds(p.pid) for p, _ in procs]
        time.sleep(2.0)  # idle: only the workers' Watch streams (snapshots and heartbeats)
        idle = sum(cpu_seconds(p.pid) - c for (p, _), c in zip(procs, cpu, strict=True)) / 2.0 / routers
        via = Target([a for _, a in procs], direct=False, max_tokens=16)
        direct = Target(list(addresses.values())[:4], direct=True, max_tokens=16)
        rows = []
        for rate in rates:
            base = direct.run(open_loop, rate, duration_s)
            cpu = [cpu_seconds(p.pid) for p, _ in procs] + [cpu_seconds(fleet.pid)]
            row = via.run(open_loop, rate, duration_s)
            used = [cpu_seconds(p.pid) for p, _ in procs] + [cpu_seconds(fleet.pid)]
            row["router_cpu_s_per_req"] = sum(u - c for u, c in zip(used[:-1], cpu[:-1], strict=True)) / max(
                1, row["sent"]
            )
            row["fleet_cpu_s_per_req"] = (used[-1] - cpu[-1]) / max(1, row["sent"])
            row["overhead_p50_ms"] = row["ttft_p50_ms"] - base["ttft_p50_ms"]
            row["overhead_p99_ms"] = row["ttft_p99_ms"] - base["ttft_p99_ms"]
            row["direct_ttft_p99_ms"] = base["ttft_p99_ms"]
            rows.append(row)
            if row["completed"] < row["sent"] or row["achieved"] < 0.9 * rate:
                break  # past saturation
        return {
            "workers": workers, "routers": routers, "rows": rows, "sustained_rps": sustained(rows),
            "idle_router_cpu": idle,
        }  # fmt: skip
    finally:
        for p, _ in procs:
            stop(p)
        stop(fleet)


def relay_rows(concurrencies: list[int], tokens_per_stream: int = 64) -> list[dict]:
    """Per-token relay cost: the router's CPU seconds per token relayed, and (the latency a
    stream sees) its time per token through the router minus straight to a worker."""
    fleet, addresses = start_fleet(16, 0.0)
    router, address = start_router(addresses)
    try:
        time.sleep(1.0)
        rows = []
        for c in concurrencies:
            streams = max(2 * c, 16)
            direct, _ = Target(list(addresses.values()), True, tokens_per_stream).run(closed_loop, c, streams)
            cpu = cpu_seconds(router.pid)
            via, tokens = Target([address], False, tokens_per_stream).run(closed_loop, c, streams)
            router_cpu = cpu_seconds(router.pid) - cpu
            rows.append({
                "concurrency": c, "direct_ms": direct * 1e3, "router_ms": via * 1e3,
                "latency_ms_per_token": (via - direct) * 1e3, "relay_ms_per_token": router_cpu / tokens * 1e3,
            })  # fmt: skip
        return rows
    finally:
        stop(router)
        stop(fleet)


# -- 4. a real local cluster ----------------------------------------------------------------------------

DEMO = ROOT / "models" / "tandem-demo-code"


def cluster_config(first_token_from_prefill: bool = True):  # type: ignore[no-untyped-def]
    from cluster.config import parse_config

    return parse_config(
        {
            "model": {"path": str(DEMO), "dtype": "float32"},
            "cache": {"block_size": 16, "num_blocks": 1024},
            "scheduler": {"max_num_seqs": 64, "max_num_batched_tokens": 2048},
            "transfer": {"transport": "grpc"},
            "router": {"max_queued_requests": 256, "first_token_from_prefill": first_token_from_prefill},
            "prefill": {"num_cpus": 1},
            "decode": {"num_cpus": 1},
        }
    )


def bench_requests(n: int, prompt_len: int, output_len: int, seed: int = 0) -> list:
    import random

    from cli.bench import BenchRequest

    rng = random.Random(seed)
    return [BenchRequest([rng.randrange(3, 2000) for _ in range(prompt_len)], output_len) for _ in range(n)]


def drive(target: str, requests: list, concurrency: int) -> dict:
    from cli.bench import _drive, report

    args = argparse.Namespace(seed=0, concurrency=concurrency, rate=float("inf"), burstiness=1.0, timeout=600.0,
                              api_key=None, tls_ca=None, no_progress=True)  # fmt: skip
    results, duration = asyncio.run(_drive(target, requests, args))
    return report(results, duration, None)


def engine_alone(requests: list, threads: int, concurrency: int) -> dict:
    """The decode engine in this process on the same requests, `concurrency` at a time (eager, as the
    decode worker steps): output tokens/s, and its mean time per output token after the first."""
    import torch

    from cluster.config import CacheConfig, SchedulerConfig
    from cluster.engine.request import SamplingParams
    from cluster.model.loader import load_model
    from cluster.model.tokenizer import Tokenizer
    from decode_worker.engine import Engine

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = load_model(DEMO, "float32")
        engine = Engine(model, Tokenizer(DEMO), CacheConfig(block_size=16, num_blocks=1024),
                        SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048))  # fmt: skip
        pending, running, tokens, gaps = list(enumerate(requests)), {}, 0, []
        start = time.perf_counter()
        while pending or running:
            while pending and len(running) < concurrency:
                i, r = pending.pop(0)
                params = SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)
                engine.add_request(str(i), r.prompt, params)
                running[str(i)] = None
            for out in engine.step():
                now = time.perf_counter()
                tokens += len(out.token_ids)
                if running[out.request_id] is not None:
                    gaps.append((now - running[out.request_id]) / max(1, len(out.token_ids)))
                running[out.request_id] = now
                if out.finished:
                    del running[out.request_id]
        duration = time.perf_counter() - start
    finally:
        torch.set_num_threads(before)
    return {"output_token_throughput": tokens / duration, "tpot_ms": statistics.mean(gaps) * 1e3}


def cluster_rows(num_prompts: int) -> dict:
    """Section 4: the serving path on a real local cluster beside the engine alone."""
    import ray

    from cluster.pools import ray_cluster
    from router.server import from_config

    long, short = bench_requests(num_prompts, 128, 64), bench_requests(16, 32, 16, seed=1)
    ray.init(num_cpus=2, include_dashboard=False, namespace="tandem-router-scale", log_to_driver=False)
    cluster = ray_cluster.start(cluster_config(), namespace="tandem-router-scale")
    routers = {flag: from_config(cluster_config(flag), cluster.discover) for flag in (True, False)}
    try:
        targets = {flag: router.start("127.0.0.1:0") for flag, router in routers.items()}
        drive(targets[True], bench_requests(4, 128, 8, seed=2), 4)  # warm-up: compiled paths, channels
        out: dict = {"c1": drive(targets[True], long[:16], 1), "c32": drive(targets[True], long, 32)}
        out["ttft"] = {
            "remote, first token from prefill": drive(targets[True], long[:16], 1)["ttft_ms"],
            "remote, first token from decode": drive(targets[False], long[:16], 1)["ttft_ms"],
            "local prefill (32-token prompts)": drive(targets[True], short, 1)["ttft_ms"],
        }
    finally:
        for router in routers.values():
            router.stop()
        cluster.shutdown()
        ray.shutdown()
    out["engine_c1"] = engine_alone(long[:16], threads=1, concurrency=1)
    out["engine_c32"] = {str(t): engine_alone(long, threads=t, concurrency=32) for t in (1, 2)}  # JSON keys
    return out


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'proto'}"}


# -- report -------------------------------------------------------------------------------------------


def print_table(results: dict) -> None:
    print("\nplacement (one choice after one worker's snapshot changed)")
    print(f"{'workers':>8} {'pushed us':>10} {'polled compute us':>18} {'vs 16':>6}")
    at16 = next(r["pushed_us"] for r in results["placement"] if r["workers"] == 16)
    for r in results["placement"]:
        print(
            f"{r['workers']:>8} {r['pushed_us']:>10.1f} {r['polled_compute_us']:>18.1f} {r['pushed_us'] / at16:>6.2f}"
        )
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
    print(f"{'TTFT ms, concurrency 1':<34}{'p50':>12}{'p99':>14}")
    for name, t in c["ttft"].items():
        print(f"  {name:<32}{t['median']:>12.2f}{t['p99']:>14.2f}")


def breakdown(results: dict) -> list[str]:
    lines = []
    for run in results["rate"]:
        if run["routers"] != 1 or not run["rows"]:
            continue
        first = run["rows"][0]
        per_req, fleet = first["router_cpu_s_per_req"] * 1e3, first["fleet_cpu_s_per_req"] * 1e3
        lines.append(
            f"{run['workers']} workers: router CPU {per_req:.2f} ms per 16-token request at {first['offered']:.0f}"
            f" req/s (~{per_req / 33 * 1e3:.0f} us per gRPC message: 16 in, 16 out, one call; its Watch streams"
            f" alone keep {run['idle_router_cpu']:.0%} of a core busy); the fake fleet {fleet:.2f} ms per request"
        )
    if "cluster" in results:
        lines += cluster_breakdown(results["cluster"])
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer workers, rates and seconds")
    parser.add_argument("--step-s", type=float, default=0.002, help="fake workers' time per token")
    parser.add_argument("--table", action="store_true", help="print the table of the last run's JSON, run nothing")
    parser.add_argument("--cluster", action="store_true", help="also section 4, a real local cluster (Ray)")
    parser.add_argument("--cluster-only", action="store_true", help="section 4 alone (router_scale_cluster.json)")
    parser.add_argument("--serve-router", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_router:
        return serve_router(args.serve_router)
    if args.table:
        return print_table(json.loads((OUT / "router_scale.json").read_text()))
    if args.cluster_only:
        return cluster_only(16 if args.quick else 64)
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


if __name__ == "__main__":
    main()
