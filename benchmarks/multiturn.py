"""Multi-turn chat under three placements, side by side in one run: KV-aware routing (the workers'
own cache events, `router.prefix_routing: kv`), first-block hash routing (`hash`) and random.

    .venv/bin/python benchmarks/multiturn.py [--quick]

The workload: conversations that share a system prompt; each turn appends a user message to the
history and the reply becomes history too; a think time between turns; the conversations run at
once. Token ids throughout (no text), greedy, `ignore_eos`.

1. A real local cluster in this process (no Ray): the demo model, one prefill and two decode
   workers over real gRPC; for each placement, fresh workers (empty caches) and a router. Per
   turn: TTFT p50 and p99, the prefix hit rate (prompt tokens the prefilling worker found cached),
   and KV bytes shipped (the prefill worker's transfers, measured).
2. Fake workers (`tests.fake_workers`, another process): 256 decode and 32 prefill workers, each
   with a prefix cache whose events it pushes and a prefill time per uncached token; the same
   comparison at that size, with the hit rate beside an ideal single worker with an infinite cache
   (each prompt's longest prefix sent before it), and KV tokens shipped (remote prefills' prompts).
3. The prefix index at 10M blocks: its memory (resident set growth) and a 64-block lookup.

Goals: on turns ≥ 2, TTFT p50 at least 3x better than hash routing and KV bytes shipped per turn at
least 80 % lower (the real cluster); on the fake workers, a hit rate ≥ 90 % of the ideal. Prints a
table and writes `benchmarks/results/multiturn.{json,png}`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "proto"))

from cluster.engine.block_names import UNNAMED_MODEL, chain  # noqa: E402
from cluster.model.gguf import model_folder  # noqa: E402
from cluster.slo import percentile  # noqa: E402

OUT = ROOT / "benchmarks" / "results"
DEMO = ROOT / "models" / "tandem-demo-code"
MODES = ("kv", "hash", "random")
BLOCK = 16


@dataclass(frozen=True)
class Workload:
    conversations: int
    turns: int
    system_tokens: int
    user_tokens: int
    reply_tokens: int
    think_s: float
    vocab: int = 2000


@dataclass
class Turn:
    conversation: int
    turn: int
    sent: float
    prompt: list[int]
    ttft: float = 0.0
    output: list[int] = field(default_factory=list)
    cached: int = 0
    placement: str = ""


async def converse(target: str, w: Workload, seed: int) -> list[Turn]:
    """Every conversation at once; returns each turn as it went."""
    import grpc
    from tandem.v1 import api_pb2, api_pb2_grpc

    rng = random.Random(seed)
    system = [rng.randrange(3, w.vocab) for _ in range(w.system_tokens)]
    turns: list[Turn] = []
    async with grpc.aio.insecure_channel(target) as channel:
        stub = api_pb2_grpc.TandemStub(channel)

        async def one(c: int) -> None:
            local = random.Random(seed * 1000 + c)
            history = list(system)
            await asyncio.sleep(local.uniform(0, w.think_s))
            for t in range(w.turns):
                history += [local.randrange(3, w.vocab) for _ in range(w.user_tokens)]
                turn = Turn(c, t, time.perf_counter(), list(history))
                sampling = api_pb2.SamplingParams(max_tokens=w.reply_tokens, temperature=0.0, ignore_eos=True)
                call = stub.Generate(
                    api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=history), sampling=sampling)
                )
                async for m in call:
                    if not turn.output:
                        turn.ttft = time.perf_counter() - turn.sent
                    turn.output += m.token_ids
                    if m.HasField("usage"):
                        turn.cached = m.usage.cached_prompt_tokens
                turn.placement = dict(await call.initial_metadata()).get("tandem-prefill", "")
                turns.append(turn)
                history += turn.output
                await asyncio.sleep(local.expovariate(1 / w.think_s) if w.think_s else 0.0)

        await asyncio.gather(*(one(c) for c in range(w.conversations)))
    return turns


def per_turn(turns: list[Turn], w: Workload, shipped_by_turn: dict[int, float] | None = None) -> list[dict]:
    rows = []
    for t in range(w.turns):
        these = [x for x in turns if x.turn == t]
        ttfts = [x.ttft * 1e3 for x in these]
        prompt = sum(len(x.prompt) for x in these)
        rows.append({
            "turn": t + 1, "requests": len(these), "ttft_p50_ms": statistics.median(ttfts),
            "ttft_p99_ms": percentile(ttfts, 99), "hit_rate": sum(x.cached for x in these) / max(1, prompt),
            "remote": sum(x.placement.startswith("remote") for x in these) / max(1, len(these)),
            "shipped_per_request": (shipped_by_turn or {}).get(t, 0.0) / max(1, len(these)),
        })  # fmt: skip
    return rows


def summary(rows: list[dict], turns: list[Turn]) -> dict:
    later = [r for r in rows if r["turn"] >= 2]
    prompt = sum(len(x.prompt) for x in turns)
    return {
        "ttft_p50_ms_turns_2_on": statistics.median([x.ttft * 1e3 for x in turns if x.turn >= 1]),
        "hit_rate": sum(x.cached for x in turns) / max(1, prompt),
        "shipped_per_turn_2_on": statistics.mean(r["shipped_per_request"] for r in later),
    }


# -- 1. a real local cluster --------------------------------------------------------------------------


def real_cluster(mode: str, w: Workload, seed: int, model: Path = DEMO, dtype: str = "float32") -> dict:
    from cluster.config import parse_config
    from decode_worker import service as decode_service
    from prefill_worker import service as prefill_service
    from router.service.server import from_config

    cfg = parse_config(
        {
            "model": {"path": str(model), "dtype": dtype},
            "cache": {"block_size": BLOCK, "num_blocks": 2048},
            "scheduler": {"max_num_seqs": 64, "max_num_batched_tokens": 2048},
            "transfer": {"transport": "grpc", "timeout_s": 60},
            "router": {"local_prefill_max_tokens": 96, "prefix_routing": mode, "max_queued_requests": 512},
        }
    )
    workers = {f"decode-{i}": decode_service.from_config(cfg, f"decode-{i}") for i in range(2)}
    prefill = workers["prefill-0"] = prefill_service.from_config(cfg, "prefill-0")
    addresses = {name: worker.start() for name, worker in workers.items()}
    router = from_config(cfg, lambda: addresses)
    try:
        target = router.start()
        warm = Workload(2, 2, 64, 16, 4, think_s=0.0, vocab=w.vocab)  # first calls, paths, channels
        asyncio.run(converse(target, warm, seed + 7919))
        kv_bytes = prefill.telemetry.metrics.kv_bytes.labels("grpc")
        before = kv_bytes._sum.get()
        turns = asyncio.run(converse(target, w, seed))
        total = kv_bytes._sum.get() - before
        remote = {t: sum(len(x.prompt) for x in turns if x.turn == t and x.placement.startswith("remote"))
                  for t in range(w.turns)}  # fmt: skip
        tokens = sum(remote.values())
        shipped = {t: total * n / tokens if tokens else 0.0 for t, n in remote.items()}  # bytes, by tokens sent
    finally:
        router.stop()
        for worker in workers.values():
            worker.stop()
    rows = per_turn(turns, w, shipped)
    return {"mode": mode, "turns": rows, "summary": summary(rows, turns), "kv_bytes": total}


# -- 2. fake workers at 256 ---------------------------------------------------------------------------


def fake_cluster(mode: str, w: Workload, seed: int, decode: int, prefill: int) -> dict:
    from cluster.config import TelemetryConfig
    from cluster.telemetry import Telemetry
    from router.placement.discovery import WorkerDiscovery
    from router.service.server import Router
    from router.service.settings import RouterSettings
    from router.service.validate import Limits
    from tests.fake_workers import VOCAB, FakeTokenizer

    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'proto'}"}
    fleet = subprocess.Popen(
        [sys.executable, "-m", "tests.fake_workers", "--workers", str(decode), "--prefill-workers", str(prefill),
         "--step-s", "0.002", "--cache-blocks", "4096", "--prefill-s-per-token", "0.00005"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT, env=env, text=True,
    )  # fmt: skip
    addresses = json.loads(fleet.stdout.readline())  # type: ignore[union-attr]
    settings = RouterSettings(
        model_name="fake", architecture="fake", limits=Limits(8192, VOCAB), block_size=BLOCK, eos_token_ids=(),
        has_chat_template=False, dtype="none", max_queued_requests=4096, local_prefill_max_tokens=96,
        prefix_routing=mode,
    )  # fmt: skip
    router = Router(
        settings, FakeTokenizer(), WorkerDiscovery(lambda: addresses), Telemetry(TelemetryConfig(), "router")
    )
    try:
        target = router.start()
        turns = asyncio.run(converse(target, Workload(**{**w.__dict__, "vocab": VOCAB}), seed))
    finally:
        router.stop()
        fleet.stdin.close()  # type: ignore[union-attr]
        fleet.wait(30)
    shipped = {t: float(sum(len(x.prompt) for x in turns if x.turn == t and x.placement.startswith("remote")))
               for t in range(w.turns)}  # fmt: skip
    rows = per_turn(turns, w, shipped)
    ideal = ideal_hit_rate(turns)
    return {"mode": mode, "turns": rows, "summary": {**summary(rows, turns), "ideal_hit_rate": ideal}}


def ideal_hit_rate(turns: list[Turn]) -> float:
    """One worker with an infinite cache: each prompt's longest prefix any earlier request computed."""
    seen: set[bytes] = set()
    cached = prompt = 0
    for x in sorted(turns, key=lambda x: x.sent):
        for h in chain(x.prompt[:-1], BLOCK, UNNAMED_MODEL):
            if h not in seen:
                break
            cached += BLOCK
        prompt += len(x.prompt)
        seen.update(chain([*x.prompt, *x.output[:-1]], BLOCK, UNNAMED_MODEL))
    return cached / max(1, prompt)


# -- 3. the index at 10M blocks -----------------------------------------------------------------------


def index_at_scale(blocks: int, workers: int = 256) -> dict:
    from router.placement.prefix_index import PrefixIndex

    def rss() -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    rng = random.Random(0)
    index = PrefixIndex(max_blocks=blocks)
    prompt = chain(list(range(64 * BLOCK)), BLOCK, UNNAMED_MODEL)
    before, start = rss(), time.perf_counter()
    per_worker = blocks // workers
    for n in range(workers):
        batch = _Batch(True, [rng.randbytes(16) for _ in range(per_worker - (64 if n < 4 else 0))])
        index.apply(f"decode-{n}", batch)
    for n in range(4):  # four workers hold one 64-block prompt
        index.apply(f"decode-{n}", _Batch(False, prompt, first=2, last=2))
    fill_s, grown = time.perf_counter() - start, rss() - before
    start = time.perf_counter()
    for _ in range(1000):
        matched = index.match(prompt)
    lookup = (time.perf_counter() - start) / 1000
    assert matched == {f"decode-{n}": 64 for n in range(4)}
    return {"blocks": len(index), "rss_bytes": grown, "bytes_per_block": grown / len(index),
            "fill_s": fill_s, "lookup_64_blocks_us": lookup * 1e6}  # fmt: skip


@dataclass
class _Batch:
    snapshot: bool
    stored: list[bytes]
    removed: list[bytes] = field(default_factory=list)
    first: int = 0
    last: int = 1
    root: bytes = UNNAMED_MODEL


# -- report -------------------------------------------------------------------------------------------


def print_section(title: str, runs: list[dict], shipped_unit: str) -> None:
    print(f"\n{title}")
    print(f"{'routing':<8}{'turn':>5}{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}{'hit rate':>10}{'remote':>8}"
          f"{shipped_unit:>16}")  # fmt: skip
    for run in runs:
        for r in run["turns"]:
            print(f"{run['mode']:<8}{r['turn']:>5}{r['ttft_p50_ms']:>13.1f}{r['ttft_p99_ms']:>13.1f}"
                  f"{r['hit_rate']:>10.0%}{r['remote']:>8.0%}{r['shipped_per_request']:>16.0f}")  # fmt: skip


def goals(results: dict) -> dict:
    real = {r["mode"]: r["summary"] for r in results["real"]}
    fake = {r["mode"]: r["summary"] for r in results["fake"]}
    ttft = real["hash"]["ttft_p50_ms_turns_2_on"] / real["kv"]["ttft_p50_ms_turns_2_on"]
    hash_shipped = real["hash"]["shipped_per_turn_2_on"]
    cut = 1 - real["kv"]["shipped_per_turn_2_on"] / hash_shipped if hash_shipped else 0.0
    hit = fake["kv"]["hit_rate"] / fake["kv"]["ideal_hit_rate"]
    return {
        "TTFT p50 turns >= 2, hash / kv (real)": (round(ttft, 2), ">= 3", ttft >= 3),
        "KV bytes shipped per turn >= 2, cut vs hash (real)": (f"{cut:.0%}", ">= 80%", cut >= 0.8),
        "hit rate / ideal (fake, 256 workers)": (f"{hit:.0%}", ">= 90%", hit >= 0.9),
    }


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, key, title in ((axes[0], "real", "real cluster"), (axes[1], "fake", "256 fake workers")):
        for run in results[key]:
            ax.plot(
                [r["turn"] for r in run["turns"]], [r["ttft_p50_ms"] for r in run["turns"]], "o-", label=run["mode"]
            )
        ax.set(xlabel="turn", ylabel="TTFT p50 ms", title=title, yscale="log")
        ax.legend()
    for run in results["real"]:
        axes[2].plot([r["turn"] for r in run["turns"]], [r["shipped_per_request"] / 1e6 for r in run["turns"]], "o-",
                     label=run["mode"])  # fmt: skip
    axes[2].set(xlabel="turn", ylabel="KV MB shipped per request", title="real cluster: KV shipped")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer conversations and workers, a smaller index")
    parser.add_argument("--model", default=None, help="the real cluster's model folder or GGUF file (default: demo)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    model = DEMO if args.model is None else model_folder(args.model)
    real_w = Workload(8 if args.quick else 16, 4 if args.quick else 6, 400, 48, 24, think_s=0.2)
    fake_w = Workload(32 if args.quick else 128, 6, 500, 64, 32, think_s=0.1)
    size = (32, 4) if args.quick else (256, 32)
    results: dict = {"workload": {"real": real_w.__dict__, "fake": fake_w.__dict__}, "model": model.name}
    results["real"] = [real_cluster(mode, real_w, 1, model, args.dtype) for mode in MODES]
    title = f"real local cluster ({model.name}, {args.dtype}; 1 prefill + 2 decode workers)"
    print_section(title, results["real"], "KV B / request")
    results["fake"] = [fake_cluster(mode, fake_w, 2, *size) for mode in MODES]
    print_section(f"fake workers ({size[0]} decode + {size[1]} prefill)", results["fake"], "KV tok / request")
    for run in results["fake"]:
        s = run["summary"]
        print(f"  {run['mode']}: hit rate {s['hit_rate']:.0%}, ideal single worker {s['ideal_hit_rate']:.0%}")
    results["index"] = index_at_scale(1_000_000 if args.quick else 10_000_000)
    i = results["index"]
    print(f"\nprefix index: {i['blocks']:,} blocks, {i['rss_bytes'] / 2**20:.0f} MiB resident "
          f"({i['bytes_per_block']:.0f} B/block), filled in {i['fill_s']:.1f} s; "
          f"a 64-block lookup {i['lookup_64_blocks_us']:.1f} us")  # fmt: skip
    results["goals"] = goals(results)
    print("\ngoals")
    for name, (value, goal, met) in results["goals"].items():
        print(f"  {name}: {value} (goal {goal}) {'met' if met else 'MISSED'}")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "multiturn.json").write_text(json.dumps(results, indent=2))
    plot(results, OUT / "multiturn.png")
    print(f"\nwrote {OUT / 'multiturn.json'} and {OUT / 'multiturn.png'}")


if __name__ == "__main__":
    main()
