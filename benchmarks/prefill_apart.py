"""A chat turn arriving at a decode worker that is decoding: its chunk beside the decode rows, or apart.

A turn whose history is in the worker's KV (in its pool, or loaded from a KV tier) computes only its new
tokens there, on the decode worker, while the worker's running batch decodes. With
`scheduler.prefill_apart: false` (vLLM's way) one pass holds the turn's chunk and every decode row; with
`true` (SGLang's) the chunk runs in a pass of its own, and the decode rows in the next, as a pass of
decode rows alone (on CPU, `tandem_cpu::decode_layers`).

Two engines share SmolLM2-135M-Instruct's weights in this one process, one per setting, taking turns:
each holds `--decoding` requests decoding after 500-token prompts; per turn a 496-token history is
computed and cached, then the turn (the history and `--new` tokens) arrives. Reported per setting
(medians over turns): the turn's time to first token, the decode rows' longest wait for a token while
the turn was served (their TPOT then), and a step of decode rows alone. Writes
`benchmarks/results/prefill_apart{_suffix}.{json,png}` (the suffix names the CPU kind).

    PYTHONPATH=proto .venv/bin/python benchmarks/prefill_apart.py
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from decode_roofline_measure import _NoText  # noqa: E402
from plots import Panel, bar_panels  # noqa: E402

from cluster.config import CacheConfig, SchedulerConfig  # noqa: E402
from cluster.cpu import auto_dtype, cpu_kind, results_suffix  # noqa: E402
from cluster.engine.request import SamplingParams  # noqa: E402
from cluster.model.loader import load_model  # noqa: E402
from decode_worker.engine import Engine  # noqa: E402

MODEL = Path(__file__).resolve().parents[1] / ".cache" / "models" / "SmolLM2-135M-Instruct"
OUT = Path(__file__).resolve().parent / "results"
HISTORY, PROMPT = 496, 500
SETTINGS = {"beside": False, "apart": True}


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 40000) for _ in range(n)]


def run_until(engine: Engine, request_id: str) -> list[tuple[float, set[str]]]:
    """Steps until `request_id` has a token: each step's end time and the requests that gained one."""
    steps = []
    while True:
        outputs = engine.step()
        got = {o.request_id for o in outputs}
        steps.append((time.perf_counter(), got))
        if request_id in got:
            return steps


def start(engine: Engine, decoding: int) -> None:
    rng = random.Random(1)
    for i in range(decoding):
        engine.add_request(f"d{i}", tokens(rng, PROMPT), SamplingParams(max_tokens=4000, ignore_eos=True))
    for i in range(decoding):
        run_until(engine, f"d{i}")


def turn(engine: Engine, n: int, new: int) -> dict[str, float]:
    """One turn: its history computed and cached, then the turn itself served beside the decode rows."""
    rng = random.Random(100 + n)
    history = tokens(rng, HISTORY)
    engine.add_request(f"h{n}", history, SamplingParams(max_tokens=1))
    run_until(engine, f"h{n}")
    before = run_until(engine, "d0")[-1][0]  # the decode rows' last token before the turn arrives
    arrived = time.perf_counter()
    engine.add_request(f"t{n}", [*history, *tokens(rng, new)], SamplingParams(max_tokens=1))
    steps = run_until(engine, f"t{n}")
    steps += run_until(engine, "d0")  # the decode rows' next token, if the turn's step had none
    row_times = [before] + [t for t, got in steps if "d0" in got]
    alone = [run_until(engine, "d0")[-1][0] for _ in range(6)]
    return {
        "ttft_ms": next(t for t, got in steps if f"t{n}" in got) - arrived,
        "decode_wait_ms": max(b - a for a, b in itertools.pairwise(row_times)),
        "decode_step_ms": statistics.median(b - a for a, b in itertools.pairwise(alone)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=MODEL)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--decoding", type=int, default=8, help="requests decoding when a turn arrives")
    ap.add_argument("--new", type=int, default=72, help="the turn's new tokens after its cached history")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model, auto_dtype("cpu")[0] if args.dtype == "auto" else args.dtype)
    cache = CacheConfig(block_size=16, num_blocks=4096)
    engines = {}
    for name, apart in SETTINGS.items():
        config = SchedulerConfig(max_num_seqs=args.decoding + 2, prefill_apart=apart)
        engines[name] = Engine(model, _NoText(), cache, config)
        start(engines[name], args.decoding)
    results: dict[str, list[dict[str, float]]] = {name: [] for name in SETTINGS}
    for n in range(args.turns):
        for name, engine in engines.items():
            results[name].append(turn(engine, n, args.new))
    rows = {
        name: {key: statistics.median(r[key] * 1e3 for r in runs) for key in runs[0]} for name, runs in results.items()
    }
    kind = cpu_kind()
    dtype = model.embed_tokens.weight.dtype
    print(f"\n{kind}, {args.threads} threads, {args.model.name} ({dtype}), {args.decoding} decoding, a turn of "
          f"{args.new} new tokens after {HISTORY} cached; medians of {args.turns} turns")  # fmt: skip
    print(f"{'setting':8} {'turn TTFT ms':>13} {'decode rows wait ms':>20} {'decode step alone ms':>21}")
    for name, row in rows.items():
        print(f"{name:8} {row['ttft_ms']:13.1f} {row['decode_wait_ms']:20.1f} {row['decode_step_ms']:21.1f}")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"prefill_apart{results_suffix()}"
    meta = {"cpu": kind, "threads": args.threads, "model": args.model.name, "decoding": args.decoding,
            "new": args.new, "history": HISTORY, "turns": args.turns}  # fmt: skip
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows, "turns": results}, indent=2))
    names = list(rows)
    bar_panels(
        stem.with_suffix(".png"),
        names,
        [
            Panel([rows[n]["ttft_ms"] for n in names], "ms", "the arriving turn's time to first token"),
            Panel([rows[n]["decode_wait_ms"] for n in names], "ms", "decode rows' longest wait for a token then"),
        ],
        title=f"{kind}: a turn's chunk beside the decode rows or apart",
    )
    print(f"\nwrote {stem}.json and .png")


if __name__ == "__main__":
    main()
