"""Prompt products on weights packed once for oneDNN (`cluster.model.prepack`) against the layers' own
products, alone and inside a whole first pass, side by side in one run.

    .venv/bin/python benchmarks/prefill_products.py [--model .cache/models/SmolLM2-135M-Instruct] [--threads 2]

1. The products: one SmolLM2-135M layer's four (q/k/v 960x576, o 576x576, gate/up 3072x576, down
   576x1536), summed, at 17 to 1,024 rows, bfloat16 activations. Each weight setting's own layer
   (`F.linear` on the plain weight for bfloat16; the int8 and int4 layers' forward, which take torch's
   weight-only kernels or dequantise and multiply) beside the same layer with a packed copy. The
   median of interleaved repeats.
2. One engine step prefilling a chunk (`--model`, bfloat16, int8 and int4 weights; the demo preset without
   one): admission to first token of a chat turn's 72 tokens after 496 cached and of a 512-token prompt,
   with the layers' weights packed and not, taking turns.

Prints a table, writes `benchmarks/results/prefill_products{suffix}.{json,png}` (`cluster.cpu.results_suffix()`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from prefill_attention import first_pass_turns, save  # noqa: E402

from cluster.cpu import cpu_kind  # noqa: E402
from cluster.model import cpu_kernels, prepack  # noqa: E402
from cluster.model.causal_lm import Linear  # noqa: E402
from cluster.model.quant import Int4Linear, Int8Linear  # noqa: E402

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}  # (out, in)
ROWS = (17, 72, 128, 256, 512, 1024)
SETTINGS = ("bfloat16", "int8", "int4")
GROUP = 64  # int4's group: SmolLM2's 576 columns take 64 where 128 is asked for


def layer(setting: str, out_features: int, in_features: int) -> nn.Module:
    plain = Linear(in_features, out_features, bias=False, dtype=torch.bfloat16).requires_grad_(False)
    if setting == "int8":
        return Int8Linear.from_linear(plain)
    return Int4Linear.from_linear(plain, GROUP) if setting == "int4" else plain


def product_times(setting: str, rows: int, repeats: int) -> dict[str, float]:
    """Median seconds of one layer's four products, the layer's own and on its packed copy."""
    layers = [layer(setting, n, k) for n, k in SHAPES.values()]
    inputs = [torch.randn(rows, k).to(torch.bfloat16) for _, k in SHAPES.values()]
    packed = [prepack.pack(m.dense() if hasattr(m, "dense") else m.weight) for m in layers]

    def use(with_packed: bool) -> None:
        for m, p in zip(layers, packed, strict=True):
            m.onednn, m.onednn_dtype = (p, torch.bfloat16) if with_packed else (None, None)

    def run(with_packed: bool) -> float:
        use(with_packed)
        start = time.perf_counter()
        for m, x in zip(layers, inputs, strict=True):
            m(x)
        return time.perf_counter() - start

    own, on_packed = [], []
    for _ in range(repeats):
        own.append(run(False))
        on_packed.append(run(True))
    for with_packed in (False, True):  # the same arithmetic either way: the dequantised weight, rounded once
        use(with_packed)
        for m, x in zip(layers, inputs, strict=True):
            ref = torch.nn.functional.linear(x.float(), (m.dense() if hasattr(m, "dense") else m.weight).float())
            torch.testing.assert_close(m(x).float(), ref, rtol=3e-2, atol=5e-2)
    return {"own": statistics.median(own[2:]), "packed": statistics.median(on_packed[2:])}


def first_pass_times(model_folder: Path | None, repeats: int) -> list[dict]:
    """Admission to first token of each chunk in `PASSES`, per weight setting, packed and not in turn."""
    from cluster.model.builder import init_model_folder
    from cluster.model.loader import load_model

    folder = model_folder or init_model_folder(Path("/tmp/tandem-prefill-attention-demo"), "smollm-135m")
    rows = []
    for setting in SETTINGS:
        weights = "auto" if setting == "bfloat16" else setting
        model = load_model(folder, "bfloat16", "cpu", weights, GROUP, prepack_weights="on")
        copies = {m: m.onednn for m in model.layers.modules() if getattr(m, "onednn", None) is not None}

        def use(packed: bool, copies: dict = copies) -> Callable[[], None]:
            def set_copies() -> None:
                for m, p in copies.items():
                    m.onednn = p if packed else None

            return set_copies

        passes = first_pass_turns(model, repeats, {"own": use(False), "packed": use(True)})
        rows += [{"setting": setting, **r} for r in passes]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="a model folder (default: the demo preset)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    if not prepack.wanted("on", torch.bfloat16, "cpu"):
        raise SystemExit("oneDNN does not run bfloat16 products on this CPU: nothing to pack")
    torch.set_num_threads(args.threads)
    kind, auto = cpu_kind(), prepack.wanted("auto", torch.bfloat16, "cpu")
    print(f"{kind}; kernels {cpu_kernels.variant()}; {args.threads} thread(s); "
          f"prepack_weights auto packs bfloat16 here: {auto}\n")  # fmt: skip
    print(f"{'setting':<10}{'rows':>6}{'own ms':>9}{'packed ms':>11}{'own / packed':>14}")
    products = []
    for setting in SETTINGS:
        for rows in ROWS:
            t = product_times(setting, rows, args.repeats)
            products.append({"setting": setting, "rows": rows, **t, "ratio": t["own"] / t["packed"]})
            print(
                f"{setting:<10}{rows:>6}{t['own'] * 1e3:>9.3f}{t['packed'] * 1e3:>11.3f}{products[-1]['ratio']:>14.2f}"
            )
    passes = first_pass_times(args.model, max(3, args.repeats // 6))
    print(f"\none engine step, admission to first token ({args.model.name if args.model else 'demo preset'})")
    print(f"{'setting':<10}{'chunk':<26}{'own ms':>9}{'packed ms':>11}{'own / packed':>14}{'vs bf16 packed':>16}")
    bf16 = {r["chunk"]: r["packed"] for r in passes if r["setting"] == "bfloat16"}
    for r in passes:
        r["ratio"], r["vs_bfloat16_packed"] = r["own"] / r["packed"], bf16[r["chunk"]] / r["packed"]
        print(f"{r['setting']:<10}{r['chunk']:<26}{r['own'] * 1e3:>9.1f}{r['packed'] * 1e3:>11.1f}"
              f"{r['ratio']:>14.2f}{r['vs_bfloat16_packed']:>16.2f}")  # fmt: skip
    results = {"cpu": kind, "kernels": cpu_kernels.variant(), "threads": args.threads, "auto_packs": auto,
               "model": args.model.name if args.model else "demo preset", "products": products,
               "first_pass": passes}  # fmt: skip
    save(results, "prefill_products", plot)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for setting in SETTINGS:
        rows = [r for r in results["products"] if r["setting"] == setting]
        axes[0].plot([r["rows"] for r in rows], [r["ratio"] for r in rows], marker="o", label=setting)
    axes[0].axhline(1.0, color="grey", lw=0.8)
    axes[0].set(title="one layer's products: own / packed", xlabel="rows", xscale="log")
    passes = results["first_pass"]
    xs = range(len(passes))
    axes[1].bar([x - 0.2 for x in xs], [r["own"] * 1e3 for r in passes], width=0.4, label="own")
    axes[1].bar([x + 0.2 for x in xs], [r["packed"] * 1e3 for r in passes], width=0.4, label="packed")
    axes[1].set(title=f"first token of a chunk, {results['model']} (ms)", xticks=list(xs))
    axes[1].set_xticklabels([f"{r['setting']}\n{r['chunk'].split(' cached')[0]}" for r in passes], fontsize=7)
    for ax in axes:
        ax.legend()
    fig.suptitle(f"{results['cpu']}, {results['threads']} thread(s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
