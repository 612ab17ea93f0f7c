"""Prompt products on weights packed once (`cluster.model.prepack`), for oneDNN and, where the kernels
run on AMX tiles, for the tile kernel, against the layers' own products, alone and inside a whole first
pass, side by side in one run.

    .venv/bin/python benchmarks/prefill_products.py [--model .cache/models/SmolLM2-135M-Instruct] [--threads 2]

1. The products: one SmolLM2-135M layer's four (q/k/v 960x576, o 576x576, gate/up 3072x576, down
   576x1536), summed, at 17 to 1,024 rows, bfloat16 activations. Each weight setting's own layer
   (`F.linear` on the plain weight for bfloat16; the int8 and int4 layers' forward, which take torch's
   weight-only kernels or dequantise and multiply) beside the same layer with each packed copy. The
   median of interleaved repeats.
2. SmolLM2-135M's 30 layers of products in turn, bfloat16, so each layer's weights come from memory as in
   a pass: each packed copy, at 16 to 512 rows.
3. One engine step prefilling a chunk (`--model`, bfloat16, int8 and int4 weights; the demo preset without
   one): admission to first token of a chat turn's 72 tokens after 496 cached and of a 512-token prompt,
   with the layers' weights packed each way and not, taking turns.

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
ROWS = (17, 32, 72, 128, 256, 512, 1024)
SETTINGS = ("bfloat16", "int8", "int4")
GROUP = 64  # int4's group: SmolLM2's 576 columns take 64 where 128 is asked for


def layer(setting: str, out_features: int, in_features: int) -> nn.Module:
    plain = Linear(in_features, out_features, bias=False, dtype=torch.bfloat16).requires_grad_(False)
    if setting == "int8":
        return Int8Linear.from_linear(plain)
    return Int4Linear.from_linear(plain, GROUP) if setting == "int4" else plain


def packings() -> dict[str, bool]:
    """The packed copies measured here: oneDNN's, and the tile kernel's where it runs on AMX tiles."""
    tiled = cpu_kernels.used() and torch.ops.tandem_cpu.tile_amx()
    return {"onednn": False, **({"tiles": True} if tiled else {})}


def product_times(setting: str, rows: int, repeats: int) -> dict[str, float]:
    """Median seconds of one layer's four products, the layer's own and on each packed copy."""
    layers = [layer(setting, n, k) for n, k in SHAPES.values()]
    inputs = [torch.randn(rows, k).to(torch.bfloat16) for _, k in SHAPES.values()]
    weights = [m.dense() if hasattr(m, "dense") else m.weight for m in layers]
    copies = {"own": [None] * len(layers)}
    copies.update({name: [prepack.pack(w, tiled) for w in weights] for name, tiled in packings().items()})

    def run(name: str) -> float:
        for m, p in zip(layers, copies[name], strict=True):
            m.prepacked, m.prepacked_dtype = p, torch.bfloat16
        start = time.perf_counter()
        for m, x in zip(layers, inputs, strict=True):
            m(x)
        return time.perf_counter() - start

    times: dict[str, list[float]] = {name: [] for name in copies}
    for _ in range(repeats):
        for name in copies:
            times[name].append(run(name))
    for name in copies:  # the same arithmetic every way: the dequantised weight, rounded once
        run(name)
        for m, x, w in zip(layers, inputs, weights, strict=True):
            ref = torch.nn.functional.linear(x.float(), w.float())
            torch.testing.assert_close(m(x).float(), ref, rtol=3e-2, atol=5e-2)
    return {name: statistics.median(t[2:]) for name, t in times.items()}


LAYERS, LAYER_ROWS = 30, (16, 32, 72, 128, 512)


def layers_times(rows: int, repeats: int) -> dict[str, float]:
    """Median seconds of `LAYERS` layers' products in turn on each packed copy, the caches flushed first."""
    weights = [torch.randn(n, k).to(torch.bfloat16) for _ in range(LAYERS) for n, k in SHAPES.values()]
    copies = {name: [prepack.pack(w, tiled) for w in weights] for name, tiled in packings().items()}
    inputs = {k: torch.randn(rows, k).to(torch.bfloat16) for _, k in SHAPES.values()}
    flush = torch.ones(128 * 1024 * 1024)  # 512 MB, more than the last-level cache holds
    times: dict[str, list[float]] = {name: [] for name in copies}
    for _ in range(repeats):
        for name, packed in copies.items():
            flush.sum()
            start = time.perf_counter()
            for w, p in zip(weights, packed, strict=True):
                prepack.product(inputs[w.shape[1]], p, None)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t[1:]) for name, t in times.items()}


def first_pass_times(model_folder: Path | None, repeats: int) -> list[dict]:
    """Admission to first token of each chunk in `PASSES`, per weight setting, on each packed copy and
    on none, in turn."""
    from cluster.model.builder import init_model_folder
    from cluster.model.loader import load_model

    folder = model_folder or init_model_folder(Path("/tmp/tandem-prefill-attention-demo"), "smollm-135m")
    rows = []
    for setting in SETTINGS:
        weights = "auto" if setting == "bfloat16" else setting
        model = load_model(folder, "bfloat16", "cpu", weights, GROUP, prepack_weights="off")
        layers = [m for m in model.layers.modules() if hasattr(m, "prepacked")]
        copies = {"own": {m: None for m in layers}}
        for name, tiled in packings().items():
            copies[name] = {m: prepack.pack(m.dense() if hasattr(m, "dense") else m.weight, tiled) for m in layers}

        def use(name: str, copies: dict = copies) -> Callable[[], None]:
            def set_copies() -> None:
                for m, p in copies[name].items():
                    m.prepacked, m.prepacked_dtype = p, torch.bfloat16

            return set_copies

        passes = first_pass_turns(model, repeats, {name: use(name) for name in copies})
        rows += [{"setting": setting, **r} for r in passes]
    return rows


def ratio_columns(t: dict) -> dict[str, float]:
    """own / each packed copy, and oneDNN's / the tile kernel's where both ran."""
    out = {f"own_over_{name}": t["own"] / t[name] for name in packings()}
    if "tiles" in t:
        out["onednn_over_tiles"] = t["onednn"] / t["tiles"]
    return out


def ratio_text(t: dict) -> str:
    text = "".join(f"{t['own_over_' + name]:>14.2f}" for name in packings())
    return text + (f"{t['onednn_over_tiles']:>16.2f}" if "tiles" in t else "")


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
    names = ["own", *packings()]
    header = "".join(f"{name + ' ms':>11}" for name in names)
    ratios = "".join(f"{'own / ' + name:>14}" for name in names[1:]) + (
        f"{'onednn / tiles':>16}" if "tiles" in names else ""
    )
    print(f"{'setting':<10}{'rows':>6}{header}{ratios}")
    products = []
    for setting in SETTINGS:
        for rows in ROWS:
            t = product_times(setting, rows, args.repeats)
            t.update(ratio_columns(t))
            products.append({"setting": setting, "rows": rows, **t})
            print(f"{setting:<10}{rows:>6}" + "".join(f"{t[name] * 1e3:>11.3f}" for name in names) + ratio_text(t))
    print(f"\n{LAYERS} layers' products in turn, bfloat16, weights from memory")
    print(f"{'rows':>6}" + "".join(f"{name + ' ms':>11}" for name in names[1:]))
    chained = []
    for rows in LAYER_ROWS:
        t = layers_times(rows, max(4, args.repeats // 3))
        chained.append({"rows": rows, **t})
        print(f"{rows:>6}" + "".join(f"{t[name] * 1e3:>11.1f}" for name in names[1:]))
    passes = first_pass_times(args.model, max(3, args.repeats // 6))
    print(f"\none engine step, admission to first token ({args.model.name if args.model else 'demo preset'})")
    print(f"{'setting':<10}{'chunk':<26}{header}{ratios}")
    for r in passes:
        r.update(ratio_columns(r))
        print(
            f"{r['setting']:<10}{r['chunk']:<26}" + "".join(f"{r[name] * 1e3:>11.1f}" for name in names) + ratio_text(r)
        )
    results = {"cpu": kind, "kernels": cpu_kernels.variant(), "threads": args.threads, "auto_packs": auto,
               "model": args.model.name if args.model else "demo preset", "paths": names, "products": products,
               "layers": chained, "first_pass": passes}  # fmt: skip
    save(results, "prefill_products", plot)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    packed = [name for name in results["paths"] if name != "own"]
    for setting in SETTINGS:
        rows = [r for r in results["products"] if r["setting"] == setting]
        for name in packed:
            axes[0].plot([r["rows"] for r in rows], [r[f"own_over_{name}"] for r in rows], marker="o",
                         linestyle="-" if name == "tiles" else "--", label=f"{setting}, {name}")  # fmt: skip
    axes[0].axhline(1.0, color="grey", lw=0.8)
    axes[0].set(title="one layer's products: own / packed", xlabel="rows", xscale="log")
    passes = results["first_pass"]
    xs, width = range(len(passes)), 0.8 / len(results["paths"])
    for i, name in enumerate(results["paths"]):
        axes[1].bar([x + (i - 1) * width for x in xs], [r[name] * 1e3 for r in passes], width=width, label=name)
    axes[1].set(title=f"first token of a chunk, {results['model']} (ms)", xticks=list(xs))
    axes[1].set_xticklabels([f"{r['setting']}\n{r['chunk'].split(' cached')[0]}" for r in passes], fontsize=7)
    for ax in axes:
        ax.legend()
    fig.suptitle(f"{results['cpu']}, {results['threads']} thread(s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
