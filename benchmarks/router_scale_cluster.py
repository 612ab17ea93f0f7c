"""Section 4 of `router_scale.py`: the serving path on a real local cluster (Ray, the demo model, one
prefill and one decode worker) driven through `tandem bench`'s client, beside one `Engine` in this
process on the same requests."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

DEMO = ROOT / "models" / "tandem-demo-code"


def cluster_config(first_token_from_prefill: bool = True, model: Path = DEMO, dtype: str = "float32"):  # type: ignore[no-untyped-def]
    from cluster.config import parse_config

    return parse_config(
        {
            "model": {"path": str(model), "dtype": dtype},
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


def engine_alone(requests: list, threads: int, concurrency: int, model: Path = DEMO, dtype: str = "float32") -> dict:
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
        engine = Engine(load_model(model, dtype), Tokenizer(model), CacheConfig(block_size=16, num_blocks=1024),
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


def ttft_rows(routers: dict, targets: dict, short: list) -> tuple[dict, dict]:
    """TTFT at concurrency 1, cold (prompts no worker has seen: 128 tokens, remote prefill) and warm
    (the same prompts again: the decode worker holds their prefix, so placement may prefill the rest
    there), with each row's placements as the router counted them."""
    cold = {flag: bench_requests(16, 128, 16, seed=3 + flag) for flag in (True, False)}
    rows = {
        "remote, cold, first token from prefill": (True, cold[True]),
        "remote, cold, first token from decode": (False, cold[False]),
        "warm (the cold prompts again)": (True, cold[True]),
        "local prefill (32-token prompts)": (True, short),
    }
    ttft, placements = {}, {}
    for name, (flag, requests) in rows.items():
        before = dict(routers[flag].decisions)
        ttft[name] = drive(targets[flag], requests, 1)["ttft_ms"]
        after = routers[flag].decisions
        placements[name] = {k: n - before.get(k, 0) for k, n in after.items() if n - before.get(k, 0)}
    return ttft, placements


def cluster_rows(num_prompts: int) -> dict:
    """Section 4: the serving path on a real local cluster beside the engine alone."""
    import ray

    from cluster.pools import ray_cluster
    from router.service.server import from_config

    long, short = bench_requests(num_prompts, 128, 64), bench_requests(16, 32, 16, seed=1)
    ray.init("local", num_cpus=2, include_dashboard=False, namespace="tandem-router-scale", log_to_driver=False)
    cluster = ray_cluster.start(cluster_config(), namespace="tandem-router-scale")
    routers = {flag: from_config(cluster_config(flag), cluster.discover) for flag in (True, False)}
    try:
        targets = {flag: router.start("127.0.0.1:0") for flag, router in routers.items()}
        drive(targets[True], bench_requests(4, 128, 8, seed=2), 4)  # warm-up: compiled paths, channels
        out: dict = {"c1": drive(targets[True], long[:16], 1), "c32": drive(targets[True], long, 32)}
        out["ttft"], out["placements"] = ttft_rows(routers, targets, short)
    finally:
        for router in routers.values():
            router.stop()
        cluster.shutdown()
        ray.shutdown()
    out["engine_c1"] = engine_alone(long[:16], threads=1, concurrency=1)
    out["engine_c32"] = {str(t): engine_alone(long, threads=t, concurrency=32) for t in (1, 2)}  # JSON keys
    return out
