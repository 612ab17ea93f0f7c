"""Structured output's cost: TPOT and throughput with and without a JSON-schema constraint, side by
side in one run, on the real model.

    .venv/bin/python benchmarks/structured.py [--model .cache/models/SmolLM2-135M-Instruct] [--dtype bfloat16]
        [--batches 1,32] [--max-tokens 48] [--repeats 3] [--threads 2] [--quick]

One decode engine in this process runs `batch` chat requests at once, `--max-tokens` tokens each,
greedy: once plain (ignore_eos, so every request runs to the end) and once under a JSON schema (a
list of 30 items, each a bounded name, a quantity and a unit from an enum: longer than max_tokens,
so every constrained request runs to the end too). Repeats are interleaved (plain, json, plain,
...); medians count. TPOT is the median time of a step once every request has its first token
(each such step gives every request one token), and beside it the fastest such step (the least
disturbed on a shared machine); throughput is output tokens over the whole run.
A third run, `json_schema_before`, computes the masks before the pass instead of on a thread beside
it. Also reported: the time spent computing masks per step, and the time the step waits for them
after the pass. Checks that every constrained output is a prefix of a valid
document. Goal: TPOT overhead <= 10 % at batch 32. Writes `benchmarks/results/structured.{json,png}`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from cluster.config import CacheConfig, SchedulerConfig  # noqa: E402
from cluster.engine.request import Constraint, SamplingParams  # noqa: E402
from cluster.engine.structured import Grammars, PendingMasks, for_tokenizer  # noqa: E402
from cluster.model.loader import load_model  # noqa: E402
from cluster.model.tokenizer import Tokenizer  # noqa: E402
from decode_worker.engine import Engine  # noqa: E402

MODEL = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"
OUT = ROOT / "benchmarks" / "results"
ITEM = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "qty": {"type": "integer", "minimum": 0, "maximum": 999},
        "unit": {"enum": ["kg", "g", "l", "ml", "piece"]},
    },
    "required": ["name", "qty", "unit"],
    "additionalProperties": False,
}
SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": ITEM, "minItems": 30, "maxItems": 30}},
    "required": ["items"],
    "additionalProperties": False,
}
PROMPT = "List thirty things to buy for a picnic as JSON: each item with a name, a quantity and a unit."


class MaskClock:
    """Time the mask thread spends computing, and the time steps wait for it after the pass."""

    def __init__(self, grammars: Grammars) -> None:
        self.compute = self.wait = 0.0
        fill, wait = grammars._fill, PendingMasks.wait

        def timed_fill(*args):  # type: ignore[no-untyped-def]
            start = time.perf_counter()
            try:
                return fill(*args)
            finally:
                self.compute += time.perf_counter() - start

        def timed_wait(pending):  # type: ignore[no-untyped-def]
            start = time.perf_counter()
            try:
                return wait(pending)
            finally:
                self.wait += time.perf_counter() - start

        grammars._fill = timed_fill  # type: ignore[method-assign]
        PendingMasks.wait = timed_wait  # type: ignore[method-assign]


def run(engine: Engine, prompt: list[int], batch: int, params: SamplingParams) -> dict:
    """`batch` requests at once: wall time, decode step times, tokens."""
    tokens: dict[str, list[int]] = {}
    for i in range(batch):
        engine.add_request(f"r{i}", prompt, params)
        tokens[f"r{i}"] = []
    steps, start = [], time.perf_counter()
    while engine.has_unfinished:
        t0 = time.perf_counter()
        outs = engine.step()
        decoding = all(tokens[rid] for rid in tokens)  # every request had its first token before this step
        for out in outs:
            tokens[out.request_id] += out.token_ids
        if decoding:
            steps.append(time.perf_counter() - t0)
    wall = time.perf_counter() - start
    return {"wall_s": wall, "steps": steps, "tokens": tokens, "output_tokens": sum(len(t) for t in tokens.values())}


def measure(model, tok: Tokenizer, grammars: Grammars, clock: MaskClock, batch: int, args) -> list[dict]:  # type: ignore[no-untyped-def]
    engine = Engine(
        model, tok, CacheConfig(block_size=16, num_blocks=2048), SchedulerConfig(max_num_seqs=64),
        tok.eos_token_ids, grammars=grammars,
    )  # fmt: skip
    prompt = tok.encode_chat([{"role": "user", "content": PROMPT}])
    constraint = Constraint("json_schema", json.dumps(SCHEMA))
    js = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, structured=constraint)
    kinds = {  # kind -> (params, masks on a thread beside the pass)
        "plain": (SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True), True),
        "json_schema": (js, True),
        "json_schema_before": (js, False),
    }
    for params, _ in kinds.values():  # warm-up: allocator, kernels, the constraint's compile
        run(engine, prompt, min(batch, 4), dataclasses.replace(params, max_tokens=4))
    runs: dict[str, list[dict]] = {k: [] for k in kinds}
    masks: dict[str, dict[str, list[float]]] = {k: {"compute": [], "wait": []} for k in kinds}
    for _ in range(args.repeats):
        for kind, (params, overlap) in kinds.items():  # interleaved: drift on a shared machine hits all alike
            grammars.overlap = overlap
            clock.compute = clock.wait = 0.0
            r = run(engine, prompt, batch, params)
            runs[kind].append(r)
            masks[kind]["compute"].append(clock.compute / max(len(r["steps"]), 1))
            masks[kind]["wait"].append(clock.wait / max(len(r["steps"]), 1))
    grammars.overlap = True
    for kind in ("json_schema", "json_schema_before"):
        for r in runs[kind]:
            for ids in r["tokens"].values():
                assert len(ids) == args.max_tokens and not grammars.matcher(constraint, ids).error, "invalid output"
        assert runs[kind][0]["tokens"] == runs["json_schema"][0]["tokens"]
    rows = []
    for kind, rs in runs.items():
        tpot = statistics.median(statistics.median(r["steps"]) for r in rs)
        wall = statistics.median(r["wall_s"] for r in rs)
        rows.append({
            "batch": batch, "kind": kind, "tpot_ms": tpot * 1e3,
            "tpot_spread_ms": (max(statistics.median(r["steps"]) for r in rs)
                               - min(statistics.median(r["steps"]) for r in rs)) * 1e3,
            "tpot_min_ms": min(min(r["steps"]) for r in rs) * 1e3,  # the least disturbed step
            "tokens_per_s": rs[0]["output_tokens"] / wall, "wall_s": wall,
            "mask_compute_ms_per_step": statistics.median(masks[kind]["compute"]) * 1e3,
            "mask_wait_ms_per_step": statistics.median(masks[kind]["wait"]) * 1e3,
        })  # fmt: skip
    plain, fastest = rows[0]["tpot_ms"], rows[0]["tpot_min_ms"]
    for row in rows:
        row["tpot_vs_plain"] = row["tpot_ms"] / plain
        row["min_vs_plain"] = row["tpot_min_ms"] / fastest
    return rows


def print_table(rows: list[dict]) -> None:
    head = ("batch", "kind", "TPOT ms", "spread", "vs plain", "min ms", "vs plain", "tok/s", "mask ms", "wait ms")
    print(f"{head[0]:>5} {head[1]:<20}" + "".join(f"{h:>9}" for h in head[2:]))
    for r in rows:
        values = (r["tpot_ms"], r["tpot_spread_ms"], r["tpot_vs_plain"], r["tpot_min_ms"], r["min_vs_plain"],
                  r["tokens_per_s"],
                  r["mask_compute_ms_per_step"], r["mask_wait_ms_per_step"])  # fmt: skip
        print(f"{r['batch']:>5} {r['kind']:<20}" + "".join(f"{v:>9.2f}" for v in values))


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in rows})
    fig, (tpot_ax, rate_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for i, kind in enumerate(("plain", "json_schema", "json_schema_before")):
        values = [next(r for r in rows if (r["batch"], r["kind"]) == (b, kind)) for b in batches]
        xs = [j + (i - 1) * 0.27 for j in range(len(batches))]
        tpot_ax.bar(xs, [v["tpot_ms"] for v in values], 0.27, label=kind)
        rate_ax.bar(xs, [v["tokens_per_s"] for v in values], 0.27, label=kind)
    for ax, title in ((tpot_ax, "TPOT (ms)"), (rate_ax, "throughput (tokens/s)")):
        ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
        ax.set_title(title)
        ax.legend()
    fig.suptitle("JSON-schema constraint against plain decoding (greedy, same run)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=MODEL)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="1 repeat, 8 tokens, batches 1 and 4: a smoke run")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.max_tokens, args.batches = 1, 8, "1,4"
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model, args.dtype), Tokenizer(args.model)
    grammars = for_tokenizer(tok, model.arch.vocab_size, tok.eos_token_ids)
    assert grammars is not None
    clock = MaskClock(grammars)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        rows += measure(model, tok, grammars, clock, batch, args)
    print_table(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"model": args.model.name, "dtype": args.dtype, "max_tokens": args.max_tokens, "repeats": args.repeats,
            "threads": args.threads, "schema": SCHEMA}  # fmt: skip
    suffix = "_quick" if args.quick else ""
    (args.out / f"structured{suffix}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    plot(rows, args.out / f"structured{suffix}.png")


if __name__ == "__main__":
    main()
