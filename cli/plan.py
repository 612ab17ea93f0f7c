"""`tandem profile` and `tandem plan` (added to the `tandem` command by `cli.main`).

tandem profile --config C [--out P.json] [--quick]
        measure this machine's costs for the config's model, dtype and transport (minutes)
tandem plan --profile P --workload W --slo ttft:MS tpot:MS --workers N [--config C] [--out PREFIX]
        rank colocated and P:D layouts of N workers by simulated goodput; write PREFIX.json, PREFIX.png

Bad input (a missing profile, SLOs no layout can meet, an empty workload) raises a ValueError
whose message says what is wrong; `tandem` prints it and exits 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from cluster.config import ClusterConfig, load_config
from cluster.slo import Targets
from planner import profile as profiles
from planner import search, workload
from planner.sim import Layout


def add_commands(commands: argparse._SubParsersAction) -> None:
    prof = commands.add_parser("profile", help="measure this machine's costs for a model (writes a profile)")
    prof.add_argument("--config", required=True, help="cluster config: the model, dtype, transport, cache")
    prof.add_argument("--out", default="profile.json", help="profile to write (default: profile.json)")
    prof.add_argument("--threads", default="1,2", help="torch thread counts to measure (default: 1,2)")
    prof.add_argument("--quick", action="store_true", help="fewer points and repeats (well under a minute)")
    prof.set_defaults(run=_profile)

    plan = commands.add_parser("plan", help="choose colocated or a P:D split by simulation")
    plan.add_argument("--profile", required=True, help="a profile from `tandem profile`")
    plan.add_argument("--workload", required=True, help=f"a workload file, or one of {', '.join(workload.PRESETS)}")
    plan.add_argument("--slo", nargs="+", required=True, metavar="KIND:MS", help="ttft:MS tpot:MS")
    plan.add_argument("--workers", type=int, required=True, help="workers to lay out")
    plan.add_argument("--config", default=None, help="cluster config for scheduler and cache settings")
    plan.add_argument("--threads", type=int, default=1, help="torch threads per worker (a profiled count)")
    plan.add_argument("--attainment", type=float, default=0.9, help="share of requests that must meet the SLOs")
    plan.add_argument("--requests", type=int, default=600, help="requests per simulation")
    plan.add_argument("--exhaustive", action="store_true", help="simulate the whole grid, not the advisor's path")
    plan.add_argument("--out", default="plan", help="writes OUT.json and OUT.png (default: plan)")
    plan.set_defaults(run=_plan)


def parse_slo(items: list[str]) -> Targets:
    slo: dict[str, float] = {}
    for item in items:
        kind, _, value = item.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = -1.0
        if kind not in ("ttft", "tpot") or not ms > 0:
            raise ValueError(f"--slo takes ttft:MS and tpot:MS with positive milliseconds, not {item!r}")
        slo[kind] = ms / 1e3
    if set(slo) != {"ttft", "tpot"}:
        raise ValueError("--slo needs both ttft:MS and tpot:MS")
    return Targets(slo["ttft"], slo["tpot"])


def base_layout(config: ClusterConfig | None, profile: profiles.Profile, threads: int) -> Layout:
    """The layout every candidate starts from: the config's scheduler, cache and router settings."""
    if config is None:
        return Layout(1, 1, prefill_threads=threads, decode_threads=threads, decode_blocks=_blocks(None, profile))
    return Layout(
        1, 1,
        local_prefill_max_tokens=config.router.local_prefill_max_tokens,
        decode_scheduler=config.scheduler,
        prefill_scheduler=config.scheduler,
        decode_blocks=_blocks(config, profile),
        prefill_blocks=_blocks(config, profile),
        prefill_threads=threads,
        decode_threads=threads,
        transport=config.transfer.transport,
        compiled=bool(config.model.compile_buckets),
        watermark=config.cache.watermark,
        prefix_caching=config.cache.enable_prefix_caching,
    )  # fmt: skip


def _blocks(config: ClusterConfig | None, profile: profiles.Profile) -> int:
    if config is not None and config.cache.num_blocks:
        return config.cache.num_blocks
    gib = config.cache.memory_gib if config is not None else 2.0
    return max(1, int(gib * 2**30) // (profile.block_size * max(1, profile.kv_bytes_per_token)))


def _plan(args: argparse.Namespace) -> int:
    prof = profiles.load(args.profile)
    wl = workload.load(args.workload)
    targets = parse_slo(args.slo)
    if args.workers < 1:
        raise search.PlanError("--workers must be at least 1")
    if not 0 < args.attainment <= 1:
        raise search.PlanError("--attainment must be in (0, 1]")
    config = load_config(args.config) if args.config else None
    base = base_layout(config, prof, args.threads)
    prof.step_costs(args.threads)
    if base.transport not in prof.transfer:
        base = replace(base, transport=sorted(prof.transfer)[0])
    evaluator = search.Evaluator(prof, wl, targets, args.attainment, args.requests)
    search.check_reachable(evaluator, base)
    from tqdm import tqdm

    with tqdm(desc="simulating layouts", unit="layout", file=sys.stderr) as bar:
        result = search.plan(evaluator, base, args.workers, exhaustive=args.exhaustive, progress=lambda _: bar.update())
    print(search.table(result))
    rec = result.recommended
    targets_now = result.targets_for(float(wl.rate or 1))
    verdict = "colocated (disaggregation does not pay here)" if rec.layout.prefill == 0 else rec.layout.name
    print(
        f"recommended: {verdict}, {rec.goodput:.2f} req/s within the SLOs ({rec.goodput_per_worker:.3f} per worker); "
        f"for {wl.rate} req/s: {targets_now} workers"
    )
    print(
        "apply to a running cluster (predictive autoscaling): "
        + "; ".join(f"tandem scale {pool} --plan {n}" for pool, n in targets_now.items() if n)
        + " (or each pool's autoscaling.planned_replicas in the config)"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(search.to_json(result, evaluator), indent=1))
    search.plot(result, str(out.with_suffix(".png")), f"{wl.name}: goodput per worker, {args.workers} workers")
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')} ({result.simulations} simulations)")
    return 0


def _profile(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    try:
        threads = sorted({int(t) for t in args.threads.split(",")})
    except ValueError:
        raise ValueError(f"--threads takes thread counts like 1,2, not {args.threads!r}") from None
    if not threads or threads[0] < 1:
        raise ValueError("--threads must name positive thread counts")
    from planner import measure

    prof = measure.profile(config, threads, quick=args.quick)
    profiles.save(prof, args.out)
    print(measure.describe(prof))
    print(f"wrote {args.out}")
    return 0
