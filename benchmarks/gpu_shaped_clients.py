"""The client processes of `benchmarks/gpu_shaped.py`: through routers with `tandem bench`'s client, or
straight to the decode worker by `Worker.Submit` or `Worker.Steps`. Each reports ready after its imports,
starts on "go", and sends back its tokens and failures.

Each stream's first request is shorter than the rest by its place among the streams (`staggered`), so
requests end a few a step, as in a served cluster, and never all in one step: a closed loop whose
requests all started together would finish them together and leave the engine waiting a round trip
for the next batch once every `max_tokens` steps."""

from __future__ import annotations

import argparse
import time


def staggered(i: int, concurrency: int, max_tokens: int) -> int:
    """Request `i`'s output length: the first `concurrency` (one per stream) end 1/concurrency of
    `max_tokens` apart; the others are `max_tokens` long."""
    return max(1, max_tokens * (i + 1) // concurrency) if i < concurrency else max_tokens


def run_clients(target: str, n: int, concurrency: int, max_tokens: int, conn) -> None:  # type: ignore[no-untyped-def]
    """One client process: `n` requests of 16 prompt ids, `concurrency` at a time."""
    import asyncio

    from cli.bench import BenchRequest, _drive

    requests = [
        BenchRequest([100 + (i * 7 + j) % 1500 for j in range(16)], staggered(i, concurrency, max_tokens))
        for i in range(n)
    ]
    conn.send("ready")
    conn.recv()  # go: every client starts at once, after its imports
    args = argparse.Namespace(seed=0, concurrency=concurrency, rate=float("inf"), burstiness=1.0, timeout=600.0,
                              api_key=None, tls_ca=None, no_progress=True)  # fmt: skip
    results, duration = asyncio.run(_drive(target, requests, args))
    done = [r.timing for r in results if r.timing is not None]
    conn.send({"duration_s": duration, "completed": len(done), "failed": len(results) - len(done),
               "tokens": sum(t.output_tokens for t in done)})  # fmt: skip


def run_front_clients(address: str, mode: str, n: int, concurrency: int, max_tokens: int, conn) -> None:  # type: ignore[no-untyped-def]
    """One client process speaking to the decode worker itself, as a router would: a `Submit` call
    per request (`mode` "submit"), or every request up one `Steps` stream ("steps")."""
    import os

    from tandem.v1 import api_pb2, worker_pb2

    def request(i: int) -> worker_pb2.WorkerRequest:
        prompt = [100 + (i * 7 + j) % 1500 for j in range(16)]
        params = api_pb2.SamplingParams(
            max_tokens=staggered(i, concurrency, max_tokens), ignore_eos=True, temperature=0.0
        )
        return worker_pb2.WorkerRequest(request_id=f"{os.getpid()}-{i}", prompt_token_ids=prompt, sampling=params)

    def start() -> float:
        """Ready (imported and connected), then the time of the go: every client starts at once."""
        conn.send("ready")
        conn.recv()
        return time.perf_counter()

    client = _steps_client if mode == "steps" else _submit_client
    tokens, failed, started = client(address, request, n, concurrency, start)
    conn.send({"duration_s": time.perf_counter() - started, "completed": n - failed, "failed": failed,
               "tokens": tokens})  # fmt: skip


def _steps_client(address: str, request, n: int, concurrency: int, start) -> tuple[int, int, float]:  # type: ignore[no-untyped-def]
    import queue

    import grpc
    from tandem.v1 import worker_pb2, worker_pb2_grpc

    commands: queue.Queue = queue.Queue()
    with grpc.insecure_channel(address) as channel:
        grpc.channel_ready_future(channel).result(timeout=60)
        started = start()
        frames = worker_pb2_grpc.WorkerStub(channel).Steps(iter(commands.get, None))
        sent = done = tokens = failed = 0
        for _ in range(min(concurrency, n)):
            commands.put(worker_pb2.StepCommand(submit=request(sent)))
            sent += 1
        for frame in frames:
            ended = [t.request_id for t in frame.tokens if t.finish_reason] + [e.request_id for e in frame.ended]
            tokens += sum(len(t.token_ids) for t in frame.tokens)
            failed += len(frame.ended)
            done += len(ended)
            for _ in ended:
                if sent < n:
                    commands.put(worker_pb2.StepCommand(submit=request(sent)))
                    sent += 1
            if done >= n:
                break
        commands.put(None)
    return tokens, failed, started


def _submit_client(address: str, request, n: int, concurrency: int, start) -> tuple[int, int, float]:  # type: ignore[no-untyped-def]
    import asyncio

    import grpc
    from tandem.v1 import worker_pb2_grpc

    async def drive() -> tuple[int, int, float]:
        limit = asyncio.Semaphore(concurrency)
        async with grpc.aio.insecure_channel(address) as channel:
            await asyncio.wait_for(channel.channel_ready(), 60)
            started = await asyncio.to_thread(start)
            stub = worker_pb2_grpc.WorkerStub(channel)

            async def one(i: int) -> tuple[int, int]:
                async with limit:
                    try:
                        return sum([len(m.token_ids) async for m in stub.Submit(request(i))]), 0
                    except grpc.RpcError:
                        return 0, 1

            results = await asyncio.gather(*(one(i) for i in range(n)))
        return sum(r[0] for r in results), sum(r[1] for r in results), started

    return asyncio.run(drive())
