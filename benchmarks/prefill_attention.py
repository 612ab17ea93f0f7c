"""Prompt chunks' attention on this CPU: `tandem_cpu::prefill_attention`'s own kernel against torch's
flash attention (the op with `torch_flash`), alone and inside a whole first pass, side by side in one run.

    .venv/bin/python benchmarks/prefill_attention.py [--model .cache/models/SmolLM2-135M-Instruct] [--threads 1]

1. The op, bfloat16, SmolLM2-135M's heads (9 query heads over 3 KV heads of 64 dims), a paged cache of
   16-token blocks: chunks of new tokens after cached ones (a turn of a chat: 72 after 496; a
   prompt: 512 from nothing), both paths interleaved, the median of each. The own kernel runs its
   products on AMX tiles where the CPU has them and the kernels may use them
   (`cpu_kernels.tile_amx()`), else as AVX512-BF16 pair products where the CPU has them, else in
   float32 vectors; torch's runs its products through oneDNN, on AMX tiles where the CPU has them.
2. One engine step prefilling a chunk (`--model`, bfloat16; the demo preset without one): the time
   from the request's admission to its first token, for each path.

`cluster.model.cpu_kernels.torch_flash()` picks torch's only on a CPU with AMX tiles the own kernel
cannot use: this benchmark is what says so, per kind of CPU. Prints a table, writes
`benchmarks/results/prefill_attention{suffix}.{json,png}` (`cluster.cpu.results_suffix()`).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from cluster.cpu import cpu_kind, results_suffix  # noqa: E402
from cluster.model import cpu_kernels  # noqa: E402

OUT = ROOT / "benchmarks" / "results"
HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16
CHUNKS = [(72, 0), (72, 496), (64, 1000), (256, 1024), (512, 0)]  # (new tokens, cached tokens)
PATHS = {"own kernel": False, "torch flash": True}


def op_times(new: int, cached: int, repeats: int) -> dict[str, float]:
    """Median seconds of one call of each path on one sequence's chunk."""
    ctx = cached + new
    blocks = (ctx + BLOCK - 1) // BLOCK
    gen = torch.Generator().manual_seed(new + cached)
    k_cache = torch.randn(blocks + 8, BLOCK, KV_HEADS, DIM, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(blocks + 8, BLOCK, KV_HEADS, DIM, generator=gen).to(torch.bfloat16)
    q = torch.randn(new, HEADS, DIM, generator=gen).to(torch.bfloat16)
    table = torch.randperm(blocks + 8, generator=gen)[:blocks].view(1, -1)  # scattered, as a pool leaves them

    def call(torch_flash: bool) -> torch.Tensor:
        return torch.ops.tandem_cpu.prefill_attention(q, k_cache, v_cache, table, [new], [cached], DIM**-0.5, None,
                                                      torch_flash)  # fmt: skip

    torch.testing.assert_close(call(False).float(), call(True).float(), rtol=2e-2, atol=2e-2)
    times: dict[str, list[float]] = {name: [] for name in PATHS}
    for _ in range(repeats):
        for name, flag in PATHS.items():
            start = time.perf_counter()
            call(flag)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


PASSES = (("72 new after 496 cached", 496, 72), ("512 new", 0, 512))  # (label, cached, new): a turn, a prompt


def first_pass_turns(model: torch.nn.Module, repeats: int, paths: dict[str, Callable[[], None]]) -> list[dict]:
    """Admission to first token of each chunk in `PASSES` on `model`'s engine, the `paths` taking turns
    (each set up by calling it before its request); the median seconds per path, after one warm-up turn."""
    from decode_roofline_measure import _NoText

    from cluster.config import CacheConfig, SchedulerConfig
    from cluster.engine.request import SamplingParams
    from decode_worker.engine import Engine

    engine = Engine(model, _NoText(), CacheConfig(block_size=BLOCK, num_blocks=400), SchedulerConfig())

    def first_token(prompt: list[int], rid: str) -> float:
        engine.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0))
        start, first = time.perf_counter(), None
        while engine.has_unfinished:
            if engine.step() and first is None:
                first = time.perf_counter() - start
        return first or 0.0

    rng, vocab = random.Random(0), model.arch.vocab_size
    history = [rng.randrange(10, vocab) for _ in range(max(c for _, c, _ in PASSES))]
    first_token(history, "history")  # cached from here on
    rows = []
    for label, cached, new in PASSES:
        times: dict[str, list[float]] = {name: [] for name in paths}
        for i in range(repeats + 1):
            for name, use in paths.items():
                use()
                t = first_token(
                    history[:cached] + [rng.randrange(10, vocab) for _ in range(new)], f"{label}-{name}-{i}"
                )
                if i:  # the first turn warms up
                    times[name].append(t)
        rows.append({"chunk": label, **{name: statistics.median(t) for name, t in times.items()}})
    return rows


def first_pass_times(model_folder: Path | None, repeats: int) -> list[dict]:
    """Admission to first token of one chunk (`PASSES`), each attention path in turn."""
    from cluster.model.builder import init_model_folder
    from cluster.model.loader import load_model

    folder = model_folder or init_model_folder(Path("/tmp/tandem-prefill-attention-demo"), "smollm-135m")
    model = load_model(folder, "bfloat16", "cpu")
    chosen = cpu_kernels.torch_flash

    def path(flag: bool) -> Callable[[], None]:
        def use() -> None:
            cpu_kernels.torch_flash = lambda: flag  # what `attention._attend` asks

        return use

    try:
        return first_pass_turns(model, repeats, {name: path(flag) for name, flag in PATHS.items()})
    finally:
        cpu_kernels.torch_flash = chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="a model folder (default: the demo preset)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    if not cpu_kernels.used():
        raise SystemExit("the CPU kernels are not in use here (no compiler, or a CPU without AVX2)")
    torch.set_num_threads(args.threads)
    chosen = "torch flash" if cpu_kernels.torch_flash() else "own kernel"
    kind = cpu_kind()
    print(f"{kind}; kernels {cpu_kernels.variant()}; {args.threads} thread(s); the model takes: {chosen}\n")
    print(f"{'chunk (new, cached)':<24}{'own ms':>9}{'torch ms':>10}{'own / torch':>13}")
    ops = []
    for new, cached in CHUNKS:
        t = op_times(new, cached, args.repeats)
        ops.append({"new": new, "cached": cached, **t, "ratio": t["own kernel"] / t["torch flash"]})
        print(f"{f'{new}, {cached}':<24}{t['own kernel'] * 1e3:>9.3f}{t['torch flash'] * 1e3:>10.3f}"
              f"{ops[-1]['ratio']:>13.2f}")  # fmt: skip
    passes = first_pass_times(args.model, max(3, args.repeats // 6))
    print(f"\none engine step, admission to first token ({args.model.name if args.model else 'demo preset'}, bfloat16)")
    for r in passes:
        print(f"{r['chunk']:<28}{r['own kernel'] * 1e3:>9.1f}{r['torch flash'] * 1e3:>10.1f}"
              f"{r['own kernel'] / r['torch flash']:>13.2f}")  # fmt: skip
    results = {"cpu": kind, "kernels": cpu_kernels.variant(), "threads": args.threads, "chosen": chosen,
               "model": args.model.name if args.model else "demo preset", "op": ops, "first_pass": passes}  # fmt: skip
    save(results, "prefill_attention", plot)


def save(results: dict, name: str, plot: Callable[[dict, Path], None]) -> None:
    """Writes `results` and its figure as `benchmarks/results/{name}{suffix}.{json,png}`."""
    OUT.mkdir(parents=True, exist_ok=True)
    stem = OUT / f"{name}{results_suffix()}"
    stem.with_suffix(".json").write_text(json.dumps(results, indent=2))
    plot(results, stem.with_suffix(".png"))
    print(f"\nwrote {stem}.json and .png")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    labels = [f"{r['new']} after {r['cached']}" for r in results["op"]]
    xs = range(len(labels))
    for offset, name in ((-0.2, "own kernel"), (0.2, "torch flash")):
        axes[0].bar([x + offset for x in xs], [r[name] * 1e3 for r in results["op"]], width=0.4, label=name)
        axes[1].bar([x + offset for x in range(len(results["first_pass"]))],
                    [r[name] * 1e3 for r in results["first_pass"]], width=0.4, label=name)  # fmt: skip
    axes[0].set(title="prefill_attention, one layer (ms)", xticks=list(xs))
    axes[0].set_xticklabels(labels, rotation=20)
    passes = range(len(results["first_pass"]))
    axes[1].set(title=f"first token of a chunk, {results['model']} (ms)", xticks=list(passes))
    axes[1].set_xticklabels([r["chunk"] for r in results["first_pass"]])
    for ax in axes:
        ax.legend()
    fig.suptitle(f"{results['cpu']}, {results['threads']} thread(s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
