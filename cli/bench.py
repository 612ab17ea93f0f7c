"""`tandem bench`: drive a running cluster through the client SDK and report serving metrics with
the field's definitions (`cluster.slo`; the same as vLLM's serving benchmark).

    tandem bench --target 127.0.0.1:50051 --num-prompts 64 --rate 4
    tandem bench --config examples/local.yaml --num-prompts 32      # starts the cluster itself

Requests arrive as a Poisson process at `--rate` per second (a gamma process with `--burstiness`
below 1 is burstier, above 1 steadier; `inf` sends them all at once), or `--concurrency` at a time.
Prompts come from a synthetic dataset (token ids with `--input-len` / `--output-len` drawn within
`--range-ratio`, seeded) or a JSONL file of {"prompt", "max_tokens"}. Every streamed chunk is
stamped on arrival at the client. Prints a table, writes the per-request timings and the summary
as JSON and a PNG (latency CDFs, throughput over time) under `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from cli.client_options import add_client_options
from cluster.slo import RequestTiming, Targets, goodput, summarize
from router.sdk.client import AsyncClient
from router.sdk.errors import TandemError


@dataclass(frozen=True)
class BenchRequest:
    prompt: str | list[int]
    max_tokens: int


@dataclass
class Result:
    request: BenchRequest
    timing: RequestTiming | None
    error: str | None = None
    prompt_tokens: int = 0


def add_commands(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser("bench", help="drive a running cluster and report serving metrics")
    add_arguments(bench)
    bench.set_defaults(run=lambda args: run(args) and 0)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_client_options(p)
    p.add_argument("--config", default=None, help="start this cluster config's cluster first, stop it after")
    p.add_argument("--model", default=None, help="start a cluster around this model folder or GGUF file")
    p.add_argument("--num-prompts", type=int, default=64, help="requests to send (default: 64)")
    p.add_argument("--rate", type=float, default=float("inf"), help="requests per second (default: inf, all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrivals (1 is Poisson)")
    p.add_argument("--concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument("--dataset", default=None, help="JSONL of {prompt, max_tokens}; default: synthetic token prompts")
    p.add_argument("--input-len", type=int, default=128, help="synthetic prompt tokens (mean; default: 128)")
    p.add_argument("--output-len", type=int, default=64, help="synthetic output tokens (mean; default: 64)")
    p.add_argument("--range-ratio", type=float, default=0.5, help="synthetic lengths vary within +-this share")
    p.add_argument("--seed", type=int, default=0, help="dataset and arrival seed")
    p.add_argument("--goodput", nargs="*", default=[], metavar="KEY:MS", help="SLOs for goodput: ttft:MS tpot:MS")
    p.add_argument("--timeout", type=float, default=600.0, help="deadline of each request, seconds")
    p.add_argument("--out", default="benchmarks/results", help="folder for serve_bench.{json,png}")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.config is None and args.model is None:
        return _bench(args, args.target)
    from cluster.config import serve_config
    from cluster.pools import ray_cluster
    from router.service.server import from_config

    config = serve_config(args.config, args.model)
    cluster = ray_cluster.start(config)
    router = from_config(config, cluster.discover, cluster)
    try:
        return _bench(args, router.start("127.0.0.1:0"))
    finally:
        router.stop()
        cluster.shutdown()


def _bench(args: argparse.Namespace, target: str) -> dict[str, Any]:
    requests = load_requests(args, target)
    results, duration = asyncio.run(_drive(target, requests, args))
    summary = report(results, duration, _targets(args.goodput))
    print(format_table(summary))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    raw = [
        {
            "prompt_tokens": r.prompt_tokens,
            "max_tokens": r.request.max_tokens,
            "error": r.error,
            "sent": r.timing.sent if r.timing else None,
            "chunks": list(r.timing.chunks) if r.timing else [],
        }
        for r in results
    ]
    (out / "serve_bench.json").write_text(json.dumps({"summary": summary, "requests": raw}, indent=1))
    plot(results, summary, out / "serve_bench.png")
    print(f"wrote {out / 'serve_bench.json'} and {out / 'serve_bench.png'}")
    return summary


def load_requests(args: argparse.Namespace, target: str) -> list[BenchRequest]:
    rng = random.Random(args.seed)
    if args.dataset:
        rows = [json.loads(line) for line in Path(args.dataset).read_text().splitlines() if line.strip()]
        return [BenchRequest(row["prompt"], int(row.get("max_tokens", args.output_len))) for row in rows][
            : args.num_prompts
        ]

    async def vocab() -> int:
        async with AsyncClient(target, api_key=args.api_key, tls_ca=args.tls_ca) as client:
            return (await client.model_info()).vocab_size

    vocab_size = asyncio.run(vocab())

    def length(mean: int) -> int:
        low, high = max(1, int(mean * (1 - args.range_ratio))), max(1, int(mean * (1 + args.range_ratio)))
        return rng.randint(low, high)

    return [
        BenchRequest([rng.randrange(3, vocab_size) for _ in range(length(args.input_len))], length(args.output_len))
        for _ in range(args.num_prompts)
    ]


async def _drive(target: str, requests: list[BenchRequest], args: argparse.Namespace) -> tuple[list[Result], float]:
    rng = random.Random(args.seed + 1)
    limit = asyncio.Semaphore(args.concurrency) if args.concurrency else None
    bar = tqdm(total=len(requests), disable=args.no_progress, desc="requests")
    async with AsyncClient(target, api_key=args.api_key, timeout=args.timeout, retries=0, tls_ca=args.tls_ca) as client:

        async def one(request: BenchRequest) -> Result:
            if limit is not None:
                await limit.acquire()
            sent = time.perf_counter()
            chunks: list[tuple[float, int]] = []
            try:
                async for delta in client.stream(
                    request.prompt, max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True
                ):
                    chunks.append((time.perf_counter(), len(delta.token_ids)))
                error = None if chunks else "no tokens"
            except TandemError as e:
                error = str(e)
            finally:
                if limit is not None:
                    limit.release()
                bar.update(1)
            timing = RequestTiming(sent, tuple(chunks)) if chunks and error is None else None
            tokens = len(request.prompt) if isinstance(request.prompt, list) else 0
            return Result(request, timing, error, tokens)

        start = time.perf_counter()
        tasks = []
        for request in requests:
            tasks.append(asyncio.create_task(one(request)))
            if args.rate != float("inf"):
                # Gamma gaps with mean 1/rate; shape 1 is a Poisson process.
                await asyncio.sleep(rng.gammavariate(args.burstiness, 1 / (args.rate * args.burstiness)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    return list(results), duration


def report(results: list[Result], duration: float, targets: Targets | None) -> dict[str, Any]:
    done = [r.timing for r in results if r.timing is not None]
    output = sum(t.output_tokens for t in done)
    prompt = sum(r.prompt_tokens for r in results if r.timing is not None)
    summary: dict[str, Any] = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration,
        "request_throughput": len(done) / duration,
        "output_token_throughput": output / duration,
        "total_token_throughput": (output + prompt) / duration,
        "ttft_ms": _ms(summarize([t.ttft for t in done])),
        "tpot_ms": _ms(summarize([t.tpot for t in done if t.tpot is not None])),
        "itl_ms": _ms(summarize([gap for t in done for gap in t.itl])),
        "e2el_ms": _ms(summarize([t.e2e for t in done])),
    }
    if targets is not None:
        summary["goodput"] = goodput(done, targets, duration)
        summary["slo"] = {"ttft_ms": targets.ttft_s * 1e3, "tpot_ms": targets.tpot_s * 1e3}
    return summary


def format_table(s: dict[str, Any]) -> str:
    lines = [
        "{:=^60}".format(" Serving Benchmark Result "),
        f"{'Successful requests:':<40}{s['completed']:>20}",
        f"{'Failed requests:':<40}{s['failed']:>20}",
        f"{'Benchmark duration (s):':<40}{s['duration_s']:>20.2f}",
        f"{'Request throughput (req/s):':<40}{s['request_throughput']:>20.2f}",
        f"{'Output token throughput (tok/s):':<40}{s['output_token_throughput']:>20.2f}",
        f"{'Total token throughput (tok/s):':<40}{s['total_token_throughput']:>20.2f}",
    ]
    if "goodput" in s:
        lines.append(f"{'Request goodput (req/s):':<40}{s['goodput']:>20.2f}")
    for key, title in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                       ("itl_ms", "Inter-token Latency"), ("e2el_ms", "End-to-end Latency")):  # fmt: skip
        short = key.split("_")[0].upper()
        lines.append(f"{title:-^60}")
        for stat in ("mean", "median", "p90", "p99"):
            label = f"{stat.capitalize() if stat in ('mean', 'median') else stat.upper()} {short} (ms):"
            lines.append(f"{label:<40}{s[key][stat]:>20.2f}")
    lines.append("=" * 60)
    return "\n".join(lines)


def plot(results: list[Result], summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r.timing for r in results if r.timing is not None]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for label, values in (
        ("TTFT", [t.ttft for t in done]),
        ("TPOT", [t.tpot for t in done if t.tpot is not None]),
        ("ITL", [g for t in done for g in t.itl]),
        ("E2E", [t.e2e for t in done]),
    ):
        if values:
            xs = sorted(v * 1e3 for v in values)
            a.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)
    a.set_xscale("log")
    a.set_xlabel("ms")
    a.set_ylabel("share of requests (ITL: of gaps)")
    a.set_title("latency CDFs")
    a.legend()
    if done:
        t0 = min(t.sent for t in done)
        stamps = sorted((at - t0, n) for t in done for at, n in t.chunks)
        end = stamps[-1][0]
        bins = max(1, min(60, int(end) + 1))
        width = end / bins or 1.0
        counts = [0.0] * bins
        for at, n in stamps:
            counts[min(int(at / width), bins - 1)] += n
        b.bar([i * width for i in range(bins)], [c / width for c in counts], width=width, align="edge")
    b.set_xlabel("seconds since the first request")
    b.set_ylabel("output tokens / s")
    b.set_title(f"throughput ({summary['output_token_throughput']:.0f} tok/s overall)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _targets(specs: list[str]) -> Targets | None:
    if not specs:
        return None
    values = {}
    for spec in specs:
        key, _, ms = spec.partition(":")
        if key not in ("ttft", "tpot") or not ms:
            raise ValueError(f"--goodput takes ttft:MS and tpot:MS, got {spec!r}")
        values[key] = float(ms) / 1e3
    return Targets(values.get("ttft", float("inf")), values.get("tpot", float("inf")))


def _ms(stats: dict[str, float]) -> dict[str, float]:
    return {k: v * 1e3 for k, v in stats.items()}
