"""Sections 1 to 3 of `router_scale.py`, the router measured alone: the cost of one placement, then a
fleet process of fake workers (no model, real gRPC) behind one or two router processes (the script
run with `--serve-router`), the load this process sends them at fixed rates and in closed loops, and
the CPU each process spent."""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc
from tandem.v1 import api_pb2, api_pb2_grpc, worker_pb2, worker_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
SCRIPT = Path(__file__).with_name("router_scale.py")  # a router process is the script with --serve-router
# The cores each process may run on (`router_scale.py --taskset`: "router", "fleet"); empty: any.
PIN: dict[str, set[int]] = {}


def _pinned(role: str):  # type: ignore[no-untyped-def]
    """The child's affinity, set before it runs anything (every thread it starts inherits it)."""
    cpus = PIN.get(role)
    return None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))


# -- 1. placement ------------------------------------------------------------------------------------


def placement_cost(num_decode: int, calls: int) -> dict:
    import random

    from router.placement.index import LoadIndex
    from router.placement.placement import choose

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
        [PY, "-m", "tests.fake_workers", "--workers", str(workers), "--step-s", str(step_s)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT, env=_env(), text=True, preexec_fn=_pinned("fleet"),
    )  # fmt: skip
    return fleet, json.loads(fleet.stdout.readline())  # type: ignore[union-attr]


def start_router(addresses: dict[str, str]) -> tuple[subprocess.Popen, str]:
    router = subprocess.Popen(
        [PY, str(SCRIPT), "--serve-router", json.dumps(addresses)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT, env=_env(), text=True, preexec_fn=_pinned("router"),
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
    from router.placement.discovery import WorkerDiscovery
    from router.service.server import Router
    from router.service.settings import RouterSettings
    from router.service.validate import Limits
    from tests.fake_workers import VOCAB, FakeTokenizer

    found = json.loads(addresses)
    settings = RouterSettings(
        model_name="fake", architecture="fake", limits=Limits(4096, VOCAB), block_size=16, eos_token_ids=(),
        has_chat_template=False, dtype="none", max_queued_requests=2048,
    )  # fmt: skip
    router = Router(
        settings, FakeTokenizer(), WorkerDiscovery(lambda: found), Telemetry(TelemetryConfig(), "bench-router")
    )
    print(router.start("127.0.0.1:0"), flush=True)
    sys.stdin.read()
    router.stop()


async def _serve_until_eof(servicer: api_pb2_grpc.TandemServicer) -> None:
    """Serves `servicer` as `tandem.v1.Tandem` on a free port, prints its address, stops on EOF."""
    server = grpc.aio.server()
    api_pb2_grpc.add_TandemServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"127.0.0.1:{port}", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.stop(0)


def serve_floor(step_s: str) -> None:
    """This script as grpc.aio's own floor for the router's public side: a bare `Tandem.Generate` that
    writes 16 token messages, one per `step_s`, with no Tandem code at all (no placement, no worker,
    no telemetry); prints its address, stops on EOF."""

    class Floor(api_pb2_grpc.TandemServicer):
        async def Generate(self, request, context):  # type: ignore[no-untyped-def]
            for i in range(request.sampling.max_tokens):
                await asyncio.sleep(float(step_s))
                yield api_pb2.GenerateResponse(token_ids=[i + 10])

    asyncio.run(_serve_until_eof(Floor()))


def serve_relay(addresses: str) -> None:
    """This script as the least a router over step streams can be: a bare `Tandem.Generate` that sends
    each request to a fake worker (round robin) as one command on that worker's step stream and
    writes each of its entries to the client as one message. No validation, placement, telemetry or
    text: grpc.aio's floor for the router's whole path. Prints its address, stops on EOF."""
    workers = list(json.loads(addresses).values())

    async def main() -> None:
        channels = [grpc.aio.insecure_channel(a) for a in workers]
        commands: list[asyncio.Queue] = [asyncio.Queue() for _ in workers]
        waiting: dict[str, asyncio.Queue] = {}

        async def link(channel: grpc.aio.Channel, queue: asyncio.Queue) -> None:
            async def sent():  # type: ignore[no-untyped-def]
                while True:
                    yield await queue.get()

            async for frame in worker_pb2_grpc.WorkerStub(channel).Steps(sent()):
                for entry in frame.tokens:
                    waiting[entry.request_id].put_nowait(entry)

        links = [asyncio.create_task(link(c, q)) for c, q in zip(channels, commands, strict=True)]
        count = iter(range(1 << 62))

        class Relay(api_pb2_grpc.TandemServicer):
            async def Generate(self, request, context):  # type: ignore[no-untyped-def]
                n = next(count)
                rid, inbox = f"r{n}", asyncio.Queue()
                waiting[rid] = inbox
                submit = worker_pb2.WorkerRequest(request_id=rid, prompt_token_ids=[1, 2, 3], sampling=request.sampling)
                commands[n % len(commands)].put_nowait(worker_pb2.StepCommand(submit=submit))
                try:
                    while True:
                        entry = await inbox.get()
                        yield api_pb2.GenerateResponse(token_ids=entry.token_ids)
                        if entry.finish_reason:
                            return
                finally:
                    del waiting[rid]

        await _serve_until_eof(Relay())
        for task in links:
            task.cancel()

    asyncio.run(main())


def floor_rows(rates: list[float], duration_s: float, step_s: float, addresses: dict[str, str] | None = None) -> dict:
    """grpc.aio's floor on the router's core at the same rates, CPU per call: `serve_floor` (the public
    side alone), or `serve_relay` over the fleet at `addresses` (the router's whole path)."""
    mode = ["--serve-floor", str(step_s)] if addresses is None else ["--serve-relay", json.dumps(addresses)]
    floor = subprocess.Popen(
        [PY, str(SCRIPT), *mode],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT, env=_env(), text=True, preexec_fn=_pinned("router"),
    )  # fmt: skip
    target = Target([floor.stdout.readline().strip()], direct=False, max_tokens=16)  # type: ignore[union-attr]
    try:
        rows = []
        for rate in rates:
            cpu = cpu_seconds(floor.pid)
            row = target.run(open_loop, rate, duration_s)
            row["floor_cpu_s_per_req"] = (cpu_seconds(floor.pid) - cpu) / max(1, row["sent"])
            rows.append(row)
            if row["completed"] < row["sent"] or row["achieved"] < 0.9 * rate:
                break
        return {"rows": rows, "sustained_rps": sustained(rows)}
    finally:
        stop(floor)


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


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'proto'}"}
