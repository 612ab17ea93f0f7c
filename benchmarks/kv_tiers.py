"""KV tiers under multi-turn chat whose conversations do not fit in the pools, side by side in one run:
tiers off; host; host + disk; host + disk + shared (Redis); and, under random placement (a turn
lands on a worker that may never have seen its chat), tiers off and every tier.

    .venv/bin/python benchmarks/kv_tiers.py [--quick] [--model PATH] [--dtype bfloat16] [--rows off,host+disk+shared]
        [--prefill-apart]

A real local cluster in this process (no Ray): one prefill and two decode workers over real gRPC,
fresh for each row, with its three pools together sized to hold about a quarter of the live histories
(each a twelfth: most turns find their history gone from the pools with tiers off); the workload of
`benchmarks/multiturn.py` (conversations sharing a system prompt, each turn's reply becoming history).
Per row: TTFT p50 and p99 on turns >= 2; prompt tokens computed against the ideal (an infinite cache
on one worker); blocks and bytes loaded by tier; and what a block loaded from each tier cost as a
share of computing it (each worker's own measure, `WorkerLoad.tier_block_cost`). Then a restart:
host + disk, each chat's first two turns, every worker stopped and started again on the same disk
directory, and each chat's next turn served by the new workers.

Conversations start spread over the first pause and think between turns (`--think-s`, exponential).
Each engine core runs one thread (`OMP_NUM_THREADS=1`), as under Ray in a worker that reserves one CPU:
three engines on two cores with a thread per core each would spend the machine waiting on each other.

Goals: TTFT p50 on turns >= 2 at least 3x better with every tier on than with tiers off; >= 90 % of
the ideal hit rate with every tier on; under random placement with the shared tier, a turn computes
<= 10 % of the prefix the tiers hold; no row slower than tiers off placed the same way (a tier never
costs more than recomputing); after the restart, <= 10 % of the cached prefix computed again. Prints
a table and writes `benchmarks/results/kv_tiers.{json,png}` (`kv_tiers_quick` with `--quick`; suffixed by
`cluster.cpu.results_suffix()`: `_avx2` on an AVX2-only machine, `_amx` with AMX; `_apart` with
`--prefill-apart`, which runs the workers' prompt chunks in passes apart from their decode rows).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "proto"))

from benchmarks.multiturn import BLOCK, DEMO, Workload, converse, ideal_hit_rate, percentile  # noqa: E402

OUT = ROOT / "benchmarks" / "results"
SECRET = "kv-tiers-benchmark"
ROWS = {  # row -> (tiers, placement)
    "off": ((), "kv"),
    "host": (("host",), "kv"),
    "host+disk": (("host", "disk"), "kv"),
    "host+disk+shared": (("host", "disk", "shared"), "kv"),
    "off, random placement": ((), "random"),
    "shared, random placement": (("host", "disk", "shared"), "random"),
}
POOLS = 3  # two decode workers and a prefill worker (`Cluster`)
BASELINE = {"kv": "off", "random": "off, random placement"}  # recomputing everything, placed the same way


def cluster_config(
    model: Path, dtype: str, tiers: tuple[str, ...], placement: str, blocks: int, tmp: Path, redis: str, apart: bool
):
    from cluster.config import parse_config

    config: dict = {"write": "computed"}
    if "host" in tiers:
        config["host"] = {"gib": 2}
    if "disk" in tiers:
        config["disk"] = {"path": str(tmp), "gib": 8}
    if "shared" in tiers:
        config["shared"] = {"url": redis}
    return parse_config(
        {
            "model": {"path": str(model), "dtype": dtype},
            "cache": {"block_size": BLOCK, "num_blocks": blocks, "tiers": config},
            "scheduler": {"max_num_seqs": 64, "max_num_batched_tokens": 2048, "prefill_apart": apart},
            "transfer": {"transport": "grpc", "timeout_s": 120},
            "router": {"local_prefill_max_tokens": 96, "prefix_routing": placement, "max_queued_requests": 512},
            "auth": {"cluster_secret": SECRET},
        }
    )


class Cluster:
    """Two decode workers, a prefill worker and a router over them, from one config, started."""

    def __init__(self, cfg) -> None:  # type: ignore[no-untyped-def]
        from decode_worker import service as decode_service
        from prefill_worker import service as prefill_service
        from router.service.server import from_config

        self.workers = {f"decode-{i}": decode_service.from_config(cfg, f"decode-{i}") for i in range(2)}
        self.workers["prefill-0"] = prefill_service.from_config(cfg, "prefill-0")
        addresses = {n: worker.start() for n, worker in self.workers.items()}
        self.router = from_config(cfg, lambda: addresses)
        self.target = self.router.start()

    def stop(self) -> None:
        self.router.stop()
        for worker in self.workers.values():
            worker.stop()


def run_row(name: str, w: Workload, model: Path, dtype: str, blocks: int, redis_url: str, apart: bool) -> dict:
    import redis

    redis.Redis.from_url(redis_url, password=SECRET).flushall()  # every row starts with empty tiers
    tiers, placement = ROWS[name]
    with tempfile.TemporaryDirectory() as tmp:
        cluster = Cluster(cluster_config(model, dtype, tiers, placement, blocks, Path(tmp), redis_url, apart))
        try:
            turns = asyncio.run(converse(cluster.target, w, seed=1))
            loads = {n: worker.load() for n, worker in cluster.workers.items()}
            tier_counts = tier_totals(cluster.workers)
            waited = queueing(cluster)
        finally:
            cluster.stop()
    later = [x for x in turns if x.turn >= 1]
    ttfts = [x.ttft * 1e3 for x in later]
    prompt = sum(len(x.prompt) for x in turns)
    computed = prompt - sum(x.cached for x in turns)
    ideal = prompt * (1 - ideal_hit_rate(turns))
    costs = {n: dict(load.tier_block_cost) for n, load in loads.items() if load.tier_block_cost}
    return {
        "row": name, "tiers": list(tiers), "placement": placement,
        "ttft_p50_ms": statistics.median(ttfts), "ttft_p99_ms": percentile(ttfts, 99),
        "prompt_tokens": prompt, "computed_tokens": computed, "ideal_computed_tokens": ideal,
        "hit_rate": 1 - computed / prompt, "ideal_hit_rate": 1 - ideal / prompt,
        "loaded": tier_counts, "block_cost": costs, **waited,  # where a first token waits, every turn's mean
        "ttft_mean_ms": statistics.fmean(x.ttft * 1e3 for x in turns),
        "remote_prefills": sum(1 for x in turns if x.placement.startswith("remote")) / len(turns),
    }  # fmt: skip


def queueing(cluster: Cluster) -> dict[str, float]:
    """Where a turn's first token waited, every turn's mean: in the router before it was placed; in
    the prefill worker's queue before its prefill began (requests prefilled there only); and, of the
    turns prefilled on their decode worker, for their tiers' load, in its queue, and in its passes."""

    def mean_ms(processes: list, metric: str, labels: dict[str, str] | None = None) -> float:  # type: ignore[type-arg]
        registries = [p.telemetry.metrics.registry for p in processes]
        total = sum(r.get_sample_value(f"{metric}_sum", labels or {}) or 0.0 for r in registries)
        count = sum(r.get_sample_value(f"{metric}_count", labels or {}) or 0.0 for r in registries)
        return total / count * 1e3 if count else 0.0

    decode = [w for name, w in cluster.workers.items() if name.startswith("decode")]
    return {
        "router_queue_mean_ms": mean_ms([cluster.router], "tandem_queue_seconds", {"stage": "router"}),
        "prefill_queue_mean_ms": mean_ms([cluster.workers["prefill-0"]], "tandem_queue_seconds", {"stage": "prefill"}),
        "tier_wait_mean_ms": mean_ms(decode, "tandem_kv_tier_wait_seconds"),
        "decode_queue_mean_ms": mean_ms(decode, "tandem_queue_seconds", {"stage": "decode"}),
        "local_prefill_mean_ms": mean_ms(decode, "tandem_local_prefill_seconds"),
    }


def restart_row(w: Workload, model: Path, dtype: str, blocks: int, redis_url: str, apart: bool) -> dict:
    """Host + disk: the chats' first turns, then every worker stopped and started again on the same disk
    directory, and each chat's next turn: what the new workers loaded from disk, and what they computed
    of the prompts' cached prefix."""
    from router.sdk.client import Client

    first = Workload(w.conversations, 2, w.system_tokens, w.user_tokens, w.reply_tokens, w.think_s, w.vocab)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = cluster_config(model, dtype, ("host", "disk"), "kv", blocks, Path(tmp), redis_url, apart)
        cluster = Cluster(cfg)
        try:
            turns = asyncio.run(converse(cluster.target, first, seed=2))
        finally:
            cluster.stop()
        last = {x.conversation: x for x in turns if x.turn == 1}
        cluster = Cluster(cfg)  # new workers, empty pools, the same disk tier
        try:
            with Client(cluster.target) as client:
                replies = [
                    client.generate([*x.prompt, *x.output, *range(3, 3 + w.user_tokens)], max_tokens=w.reply_tokens,
                                    temperature=0.0, ignore_eos=True)
                    for x in last.values()
                ]  # fmt: skip
            counts = tier_totals(cluster.workers)
        finally:
            cluster.stop()
    # Full blocks of each history whose KV was computed (a reply's last token never was)
    held = sum((len(x.prompt) + len(x.output) - 1) // BLOCK * BLOCK for x in last.values())
    cached = sum(r.cached_prompt_tokens for r in replies)
    share = max(0.0, 1 - cached / held) if held else 0.0
    return {"disk_blocks_loaded": counts["disk"]["blocks"], "cached_prefix_tokens": held,
            "cached_tokens_served": cached, "recomputed_share": share}  # fmt: skip


def naming_cost() -> dict[str, float]:
    """What naming a prompt's blocks costs a token: SHA-256 names (`block_names.chain`) beside the
    64-bit Python `hash` chain they replaced, 4,096 tokens, 16-token blocks, best of 7."""
    import timeit

    from cluster.engine.block_names import UNNAMED_MODEL, chain

    def old(tokens: list[int]) -> list[int]:
        names, parent = [], 0
        for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
            parent = hash((parent, tuple(tokens[start : start + BLOCK])))
            names.append(parent)
        return names

    tokens = list(range(4096))
    sha = min(timeit.repeat(lambda: chain(tokens, BLOCK, UNNAMED_MODEL), number=20, repeat=7)) / 20 / len(tokens)
    was = min(timeit.repeat(lambda: old(tokens), number=20, repeat=7)) / 20 / len(tokens)
    return {"sha256_ns_per_token": sha * 1e9, "python_hash_ns_per_token": was * 1e9}


def tier_totals(workers: dict) -> dict:  # type: ignore[type-arg]
    """Blocks and bytes loaded from each tier, and the seconds it took, summed over the workers."""
    totals: dict[str, dict[str, float]] = {}
    for worker in workers.values():
        registry = worker.telemetry.metrics.registry
        for tier in ("host", "disk", "shared"):
            row = totals.setdefault(tier, {"blocks": 0.0, "bytes": 0.0, "seconds": 0.0})
            for key, metric in (("blocks", "hit_blocks"), ("bytes", "loaded_bytes"), ("seconds", "load_seconds")):
                row[key] += registry.get_sample_value(f"tandem_kv_tier_{metric}_total", {"tier": tier}) or 0.0
    return totals


def goals(rows: dict[str, dict], restarted: dict | None) -> dict:
    """Each goal whose rows ran (`--rows` may leave some out, and the restart with them)."""
    out = {}
    if {"off", "host+disk+shared"} <= rows.keys():
        off, full = rows["off"], rows["host+disk+shared"]
        speedup = off["ttft_p50_ms"] / full["ttft_p50_ms"]
        of_ideal = full["hit_rate"] / full["ideal_hit_rate"] if full["ideal_hit_rate"] else 0.0
        out["TTFT p50 turns >= 2, off / every tier"] = (round(speedup, 2), ">= 3", speedup >= 3)
        out["hit rate / ideal, every tier"] = (f"{of_ideal:.0%}", ">= 90%", of_ideal >= 0.9)
    if "shared, random placement" in rows:
        stranger = rows["shared, random placement"]
        held = stranger["prompt_tokens"] * stranger["ideal_hit_rate"]
        recomputed = max(0.0, stranger["computed_tokens"] - stranger["ideal_computed_tokens"]) / held if held else 0.0
        out["cached prefix recomputed, random placement + shared"] = (f"{recomputed:.0%}", "<= 10%", recomputed <= 0.1)
    # a tier may never make a turn slower than recomputing it where the same placement put it
    placed = [r for r in rows.values() if BASELINE[r["placement"]] in rows]
    if placed:
        slowest = max(r["ttft_p50_ms"] / rows[BASELINE[r["placement"]]]["ttft_p50_ms"] for r in placed)
        out["slowest row's TTFT p50 / tiers off, same placement"] = (round(slowest, 2), "<= 1", slowest <= 1.0)
    if restarted is not None:
        share = restarted["recomputed_share"]
        out["cached prefix recomputed after a restart, disk tier"] = (f"{share:.0%}", "<= 10%", share <= 0.1)
    return out


def print_table(rows: dict[str, dict]) -> None:
    print(f"{'row':<26}{'TTFT p50':>10}{'p99':>9}{'hit':>7}{'ideal':>7}{'computed':>10}  loaded blocks (cost/compute)")
    for r in rows.values():
        loaded = ", ".join(f"{t} {int(v['blocks'])}" + cost_of(r, t) for t, v in r["loaded"].items() if v["blocks"])
        print(f"{r['row']:<26}{r['ttft_p50_ms']:>10.1f}{r['ttft_p99_ms']:>9.1f}{r['hit_rate']:>7.0%}"
              f"{r['ideal_hit_rate']:>7.0%}{r['computed_tokens']:>10}  {loaded}")  # fmt: skip
    heads = f"{'TTFT':>9}{'router queue':>14}{'prefill queue':>15}{'remote prefill':>16}"
    print(f"\n{'where TTFT goes, every turn (means, ms)':<40}{heads}")
    for r in rows.values():
        print(f"{r['row']:<40}{r['ttft_mean_ms']:>9.1f}{r['router_queue_mean_ms']:>14.1f}"
              f"{r['prefill_queue_mean_ms']:>15.1f}{r['remote_prefills']:>16.0%}")  # fmt: skip
    heads = f"{'tier load':>11}{'decode queue':>14}{'prefill passes':>16}"
    print(f"\n{'turns prefilled on their decode worker (means, ms)':<52}{heads}")
    for r in rows.values():
        print(f"{r['row']:<52}{r['tier_wait_mean_ms']:>11.1f}{r['decode_queue_mean_ms']:>14.1f}"
              f"{r['local_prefill_mean_ms']:>16.1f}")  # fmt: skip


def cost_of(row: dict, tier: str) -> str:
    costs = [c[tier] for c in row["block_cost"].values() if tier in c]
    return f" ({statistics.median(costs):.2f})" if costs else ""


def plot(rows: dict[str, dict], path: Path) -> None:
    from benchmarks.plots import Panel, bar_panels

    names = list(rows)
    bar_panels(path, names, [
        Panel([rows[n]["ttft_p50_ms"] for n in names], "TTFT p50, turns >= 2 (ms)", "TTFT by tiers"),
        Panel([rows[n]["computed_tokens"] for n in names], "prompt tokens computed", "computed vs ideal",
              marks=[rows[n]["ideal_computed_tokens"] for n in names], marks_label="ideal"),
    ])  # fmt: skip


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the demo model, 16 conversations of 4 turns")
    parser.add_argument("--model", default=None, help="a model folder (default: the demo model)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--think-s", type=float, default=None, help="mean pause between a reply and the next turn")
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows to run (default: all, and the "
                        "restart); fewer write kv_tiers_rows*.{json,png}, never the full run's files")  # fmt: skip
    parser.add_argument("--prefill-apart", action="store_true", help="the workers' prompt chunks in passes of their "
                        "own, apart from decode rows (`scheduler.prefill_apart`)")  # fmt: skip
    return parser.parse_args()


def main() -> None:
    from cluster.cpu import cpu_kind, results_suffix  # the kind of CPU each figure comes from
    from tests.redis_server import RedisServer

    args = arguments()
    chosen = args.rows.split(",")
    if unknown := [name for name in chosen if name not in ROWS]:
        raise SystemExit(f"unknown rows {unknown}: choose from {', '.join(ROWS)}")
    every = set(chosen) == set(ROWS)
    model = DEMO if args.model is None else Path(args.model)
    # Users who read a reply before they answer. The full workload's tiers-off row still asks more of two
    # cores than they have (every turn prefills its whole history): its TTFT includes its queue, which
    # the breakdown below reports; the rows with tiers are what the machine carries.
    think_s = args.think_s if args.think_s is not None else (4.0 if args.quick else 60.0)
    os.environ["OMP_NUM_THREADS"] = "1"  # each engine core process, spawned from here, one thread
    shape = (16, 4) if args.quick else (64, 6)
    w = Workload(*shape, 400, 48, 24, think_s=think_s)
    # The histories' distinct tokens (one system prompt, each conversation's own turns); the three pools
    # (two decode workers', the prefill worker's) hold a quarter of them together.
    live = w.system_tokens + w.conversations * w.turns * (w.user_tokens + w.reply_tokens)
    blocks = max(64, live // BLOCK // 4 // POOLS)
    with tempfile.TemporaryDirectory() as tmp:
        redis = RedisServer(Path(tmp), password=SECRET, maxmemory="2gb").start()
        try:
            apart = args.prefill_apart
            rows = {n: run_row(n, w, model, args.dtype, blocks, redis.url, apart) for n in ROWS if n in chosen}
            restarted = restart_row(w, model, args.dtype, blocks, redis.url, apart) if every else None
        finally:
            redis.stop()
    kind = cpu_kind()
    print(f"\nKV tiers, {model.name} {args.dtype}, {w.conversations} conversations x {w.turns} turns, "
          f"{blocks} blocks a pool ({kind})")  # fmt: skip
    print_table(rows)
    results = {"workload": w.__dict__, "model": model.name, "blocks": blocks, "cpu": kind, "rows": rows}
    results["prefill_apart"] = args.prefill_apart
    results["restart"] = restarted
    if restarted is not None:
        print(f"\nworkers restarted on their disk tier: {int(restarted['disk_blocks_loaded'])} blocks loaded from "
              f"disk, {restarted['recomputed_share']:.0%} of the cached prefix computed again")  # fmt: skip
    results["naming"] = naming = naming_cost()
    print(f"\nnaming a block: {naming['sha256_ns_per_token']:.0f} ns a token (SHA-256) against "
          f"{naming['python_hash_ns_per_token']:.0f} ns (the 64-bit hash it replaced)")  # fmt: skip
    results["goals"] = goals(rows, restarted)
    print("\ngoals")
    for name, (value, goal, met) in results["goals"].items():
        print(f"  {name}: {value} (goal {goal}) {'met' if met else 'MISSED'}")
    # each kind of CPU its own files, and --quick its own: it never overwrites the full workload's
    suffix = ("_quick" if args.quick else "") + ("" if every else "_rows") + ("_apart" if args.prefill_apart else "")
    suffix += results_suffix()
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"kv_tiers{suffix}.json").write_text(json.dumps(results, indent=2))
    plot(rows, OUT / f"kv_tiers{suffix}.png")
    print(f"\nwrote {OUT / f'kv_tiers{suffix}.json'} and {OUT / f'kv_tiers{suffix}.png'}")


if __name__ == "__main__":
    main()
