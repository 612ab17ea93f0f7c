"""The client processes of `benchmarks/gpu_shaped.py`: through routers with `tandem bench`'s client, or
straight to the decode worker by `Worker.Submit` or `Worker.Steps`. Each reports ready after its imports,
starts on "go", and sends back its tokens and failures."""

from __future__ import annotations

import argparse
import time


def run_clients(target: str, n: int, concurrency: int, max_tokens: int, conn) -> None:  # type: ignore[no-untyped-def]
    """One client process: `n` requests of 16 prompt ids, `concurrency` at a time."""
    import asyncio

    from cli.bench import BenchRequest, _drive

    requests = [BenchRequest([100 + (i * 7 + j) % 1500 for j in range(16)], max_tokens) for i in range(n)]
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

    params = api_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)

    def request(i: int) -> worker_pb2.WorkerRequest:
        prompt = [100 + (i * 7 + j) % 1500 for j in range(16)]
        return worker_pb2.WorkerRequest(request_id=f"{os.getpid()}-{i}", prompt_token_ids=prompt, sampling=params)

    conn.send("ready")
    conn.recv()  # go: every client starts at once, after its imports
    started = time.perf_counter()
    tokens, failed = (_steps_client if mode == "steps" else _submit_client)(address, request, n, concurrency)
    conn.send({"duration_s": time.perf_counter() - started, "completed": n - failed, "failed": failed,
               "tokens": tokens})  # fmt: skip


def _steps_client(address: str, request, n: int, concurrency: int) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    import queue

    import grpc
    from tandem.v1 import worker_pb2, worker_pb2_grpc

    commands: queue.Queue = queue.Queue()
    with grpc.insecure_channel(address) as channel:
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
    return tokens, failed


def _submit_client(address: str, request, n: int, concurrency: int) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    import asyncio

    import grpc
    from tandem.v1 import worker_pb2_grpc

    async def drive() -> tuple[int, int]:
        limit = asyncio.Semaphore(concurrency)
        async with grpc.aio.insecure_channel(address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)

            async def one(i: int) -> tuple[int, int]:
                async with limit:
                    try:
                        return sum([len(m.token_ids) async for m in stub.Submit(request(i))]), 0
                    except grpc.RpcError:
                        return 0, 1

            results = await asyncio.gather(*(one(i) for i in range(n)))
        return sum(r[0] for r in results), sum(r[1] for r in results)

    return asyncio.run(drive())
