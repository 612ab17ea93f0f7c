"""Speculative decoding against plain decoding, side by side in one run.

    .venv/bin/python benchmarks/speculative.py [--repeats 3] [--max-tokens 64] [--modes eager,compiled] [--quick]

Model: the bundled demo model (`models/tandem-demo-code`, 5.8M parameters, float32) with its draft
(`models/tandem-demo-code-draft`, 2 layers). Two workloads of held-out Python (text the models
never trained on), greedy, `--max-tokens` output tokens each:

- continue: a snippet of code to continue; the proposer must guess what comes next;
- copy (code editing): a snippet, then the marker `# the same code again:` and the snippet's first
  line, so the natural output copies the snippet from the prompt.

For each mode (eager passes; compiled: decode rows, verification passes and the draft model's
passes through `torch.compile`d graphs, `COMPILE_BUCKETS`), each workload, at batch 1 (one request
at a time) and batch 8 (eight at once), three engines run the same requests: plain decoding, the
n-gram (prompt-lookup) proposer and the draft model, both with `--k` draft tokens. Repeats are
interleaved (plain, n-gram, draft, plain, ...) and the median wall time counts. Reports acceptance
rate, output tokens per target-model pass, the speed-up over plain decoding, and where a step's
time goes (inside target-model passes, inside the proposer), and checks that every speculative run
produced exactly the plain run's tokens. Writes `benchmarks/results/speculative.{json,png}`.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from cluster.config import CacheConfig, SchedulerConfig, SpeculativeConfig  # noqa: E402
from cluster.engine.request import SamplingParams  # noqa: E402
from cluster.engine.speculative import build_proposer  # noqa: E402
from cluster.model.loader import load_model  # noqa: E402
from cluster.model.tokenizer import Tokenizer  # noqa: E402
from decode_worker.engine import Engine  # noqa: E402

DEMO = ROOT / "models" / "tandem-demo-code"
DRAFT = ROOT / "models" / "tandem-demo-code-draft"
OUT = ROOT / "benchmarks" / "results"
METHODS = ("plain", "ngram", "draft")
# Decode rows per compiled graph: a request alone (1) verifying up to 4 drafts (5), eight (8)
# verifying theirs (40), and the draft model's catch-up rows in between.
COMPILE_BUCKETS = (1, 2, 3, 4, 5, 8, 16, 24, 32, 40)


def workloads(tok: Tokenizer, n: int, seed: int = 0) -> dict[str, list[list[int]]]:
    text = (DEMO / "heldout_eval.txt").read_text(encoding="utf-8")
    lines = text.splitlines(keepends=True)
    rng = random.Random(seed)
    cont, copy = [], []
    while len(cont) < n:
        start = rng.randrange(0, len(lines) - 40)
        snippet = "".join(lines[start : start + 12])
        if len(tok.encode(snippet)) < 60 or not lines[start].strip():
            continue
        cont.append(tok.encode(snippet))
        copy.append(tok.encode(snippet + "\n# the same code again:\n" + lines[start]))
    return {"continue": cont, "copy": copy}


def engine(model, tok: Tokenizer, method: str, k: int, compiled: bool) -> Engine:  # type: ignore[no-untyped-def]
    cache = CacheConfig(block_size=16, num_blocks=1024, watermark=0.0)
    buckets = COMPILE_BUCKETS if compiled else ()
    proposer = None
    if method != "plain":
        config = SpeculativeConfig(method=method, num_tokens=k, draft_model=DRAFT, draft_memory_gib=0.05)
        proposer = build_proposer(config, model, cache.block_size, compile_buckets=buckets)
    eng = Engine(
        model, tok, cache, SchedulerConfig(max_num_seqs=16), compile_buckets=buckets, proposer=proposer,
        num_speculative_tokens=k,
    )  # fmt: skip
    eng.warm_up()
    return eng


class Clock:
    """Seconds spent inside the wrapped methods, by label."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}

    def wrap(self, obj: object, method: str, label: str) -> None:
        inner = getattr(obj, method)

        def timed(*args, **kwargs):  # type: ignore[no-untyped-def]
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.spent[label] = self.spent.get(label, 0.0) + time.perf_counter() - start

        setattr(obj, method, timed)


def clocked(eng: Engine) -> Clock:
    """Times the target model's passes and the proposer's work."""
    clock = Clock()
    clock.wrap(eng.runner, "logits", "target")
    if eng.proposer is not None:
        clock.wrap(eng.proposer, "propose", "proposer")
    return clock


def run(eng: Engine, prompts: list[list[int]], batch: int, max_tokens: int) -> dict:
    """Runs `prompts` `batch` at a time; wall time, tokens, the speculation counts, and the time
    inside target passes and the proposer (when `eng` is `clocked`)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    drafted = accepted = passes = steps = 0
    clock: Clock | None = getattr(eng, "clock", None)
    if clock is not None:
        clock.spent.clear()
    start = time.perf_counter()
    for first in range(0, len(prompts), batch):
        for i in range(first, min(first + batch, len(prompts))):
            eng.add_request(f"r{i}", prompts[i], params)
            tokens[f"r{i}"] = []
        while eng.has_unfinished:
            steps += 1
            for out in eng.step():
                tokens[out.request_id] += out.token_ids
                if out.finished:
                    drafted += out.num_draft_tokens
                    accepted += out.num_accepted_tokens
                    passes += out.num_passes
    wall = time.perf_counter() - start
    n_out = sum(len(t) for t in tokens.values())
    spent = dict(clock.spent) if clock is not None else {}
    return {"wall_s": wall, "tokens": tokens, "output_tokens": n_out, "draft": drafted, "accepted": accepted,
            "passes": passes, "steps": steps, "target_s": spent.get("target", 0.0),
            "proposer_s": spent.get("proposer", 0.0)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=8, help="requests per workload (batch 8 runs them at once)")
    ap.add_argument("--k", type=int, default=4, help="draft tokens per step")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--modes", default="eager,compiled", help="eager and/or compiled passes")
    ap.add_argument("--quick", action="store_true", help="1 repeat, 2 requests, 16 tokens: a smoke run")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.requests, args.max_tokens = 1, 2, 16
    modes = [m for m in args.modes.split(",") if m]
    torch.set_num_threads(args.threads)
    model, tok = load_model(DEMO, "float32"), Tokenizer(DEMO)
    rows = []
    compile_s = {}
    for mode in modes:
        start = time.perf_counter()
        engines = {m: engine(model, tok, m, args.k, mode == "compiled") for m in METHODS}
        compile_s[mode] = time.perf_counter() - start
        for eng in engines.values():
            eng.clock = clocked(eng)  # type: ignore[attr-defined]
        for eng in engines.values():  # warm up: first passes pay for allocator and kernel set-up
            run(eng, workloads(tok, 2, seed=99)["copy"], 2, 8)
        rows += measure(engines, mode, workloads(tok, args.requests), args)
    print_table(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"model": DEMO.name, "draft": DRAFT.name, "k": args.k, "max_tokens": args.max_tokens,
            "requests": args.requests, "repeats": args.repeats, "threads": args.threads,
            "compile_buckets": COMPILE_BUCKETS, "set_up_s": compile_s}  # fmt: skip
    suffix = "_quick" if args.quick else ""
    (args.out / f"speculative{suffix}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    plot(rows, args.out / f"speculative{suffix}.png")


def measure(engines: dict[str, Engine], mode: str, loads: dict[str, list[list[int]]], args) -> list[dict]:  # type: ignore[no-untyped-def]
    """Each workload at batch 1 and 8 through the three engines, repeats interleaved; one row each."""
    rows = []
    for name, prompts in loads.items():
        for batch in (1, 8):
            runs: dict[str, list[dict]] = {m: [] for m in METHODS}
            for _ in range(args.repeats):
                for m in METHODS:  # interleaved, so drift on a shared machine hits all three alike
                    runs[m].append(run(engines[m], prompts, batch, args.max_tokens))
            plain_tokens = runs["plain"][0]["tokens"]
            plain_wall = statistics.median(r["wall_s"] for r in runs["plain"])
            for m in METHODS:
                last = runs[m][-1]
                assert all(r["tokens"] == plain_tokens for r in runs[m]), f"{m} changed greedy output"
                wall = statistics.median(r["wall_s"] for r in runs[m])
                rows.append(
                    {
                        "mode": mode, "workload": name, "batch": batch, "method": m, "wall_s": wall,
                        "wall_spread_s": max(r["wall_s"] for r in runs[m]) - min(r["wall_s"] for r in runs[m]),
                        "tokens_per_s": last["output_tokens"] / wall,
                        "acceptance_rate": last["accepted"] / last["draft"] if last["draft"] else None,
                        "tokens_per_pass": last["output_tokens"] / last["passes"] if last["passes"] else 1.0,
                        "speedup": plain_wall / wall,
                        "ms_per_step": 1e3 * wall / last["steps"],
                        "target_ms_per_step": 1e3 * last["target_s"] / last["steps"],
                        "proposer_ms_per_step": 1e3 * last["proposer_s"] / last["steps"],
                    }
                )  # fmt: skip
    return rows


def print_table(rows: list[dict]) -> None:
    print(
        f"{'mode':8} {'workload':9} {'batch':>5} {'method':6} {'tok/s':>8} {'accept':>7} {'tok/pass':>8} "
        f"{'speed-up':>8} {'ms/step':>8} {'target ms/step':>14} {'proposer ms/step':>16}"
    )
    for r in rows:
        acc = f"{r['acceptance_rate']:.2f}" if r["acceptance_rate"] is not None else "-"
        print(
            f"{r['mode']:8} {r['workload']:9} {r['batch']:>5} {r['method']:6} {r['tokens_per_s']:>8.1f} {acc:>7} "
            f"{r['tokens_per_pass']:>8.2f} {r['speedup']:>7.2f}x {r['ms_per_step']:>8.2f} "
            f"{r['target_ms_per_step']:>14.2f} {r['proposer_ms_per_step']:>16.2f}"
        )


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(dict.fromkeys(r["mode"] for r in rows))
    fig, axes = plt.subplots(len(modes), 2, figsize=(11, 4 * len(modes)), squeeze=False)
    groups = [(w, b) for w in ("continue", "copy") for b in (1, 8)]
    width = 0.25
    for mode, (speed_ax, pass_ax) in zip(modes, axes, strict=True):
        for i, m in enumerate(METHODS):
            values = [
                next(r for r in rows if (r["mode"], r["workload"], r["batch"], r["method"]) == (mode, w, b, m))
                for w, b in groups
            ]
            xs = [g + (i - 1) * width for g in range(len(groups))]
            speed_ax.bar(xs, [v["speedup"] for v in values], width, label=m)
            pass_ax.bar(xs, [v["tokens_per_pass"] for v in values], width, label=m)
        titles = (f"{mode}: speed-up over plain decoding", f"{mode}: output tokens per target pass")
        for ax, title in zip((speed_ax, pass_ax), titles, strict=True):
            ax.set_xticks(range(len(groups)), [f"{w}\nbatch {b}" for w, b in groups])
            ax.axhline(1.0, color="grey", lw=0.8)
            ax.set_title(title)
            ax.legend()
    fig.suptitle("Speculative decoding on the demo model (greedy, identical output)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
