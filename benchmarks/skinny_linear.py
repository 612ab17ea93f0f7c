"""Few-row products: `tandem_cpu::skinny_linear` against torch's `F.linear`, and
`tandem_cpu::skinny_linear_int8` and `_int4` against torch's `_weight_int8pack_mm` and
`_weight_int4pack_mm_for_cpu` on int8 and int4 weights, side by side in one run.

    .venv/bin/python benchmarks/skinny_linear.py [--layers 30] [--threads 2]

The weights of `--layers` layers of the `smollm-135m` preset (the fused q/k/v, output, gate/up and
down projections: 3.5M parameters a layer; all 30 layers are 212 MB in bfloat16, far more than the
last-level cache holds, as in a decode step), in float32 and bfloat16, and as int8 weights with a
scale per row and as int4 weights in groups of 32, under float32 and bfloat16 activations. For
each row count (1 to 64; quantised 1 to 16),
both kernels run every matrix once, repeats interleaved; the median time gives the weight bytes
read per second, the arithmetic rate and the ratio. `F.linear` here multiplies unpacked weights;
compiled decode graphs hand torch's products weights prepacked for oneDNN, which is faster from
about 24 bfloat16 rows (see `cluster.model.cpu_kernels.SKINNY_ROWS`). Prints a table, writes
`benchmarks/results/skinny_linear{,_amx,_avx2}.{json,png}` (each kind of CPU its own, `cluster.cpu.results_suffix`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cluster.model import cpu_kernels  # noqa: E402
from cluster.model.quant import Int4Linear, quantize_int8  # noqa: E402

OUT = ROOT / "benchmarks" / "results"
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # smollm-135m: qkv, o, gate_up, down
ROWS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
INT8_ROWS = (1, 2, 4, 8, 16)  # int8 products go through the kernel up to `quant.INT8_SKINNY_ROWS`


def products(op, xs: dict[int, torch.Tensor], weights: list):  # type: ignore[no-untyped-def]
    """Runs `op(x, w)` (`op(x, q, scales)` for int8 weights) for every weight matrix, with the input
    rows of its width."""
    return lambda: [op(xs[_width(w)], *w) if isinstance(w, tuple) else op(xs[w.shape[1]], w) for w in weights]


def _width(w: tuple) -> int:
    return w[0].in_features if isinstance(w[0], Int4Linear) else w[0].shape[1]


def _linear(w: torch.Tensor, dtype: torch.dtype) -> torch.nn.Linear:
    layer = torch.nn.Linear(w.shape[1], w.shape[0], bias=False).to(dtype)
    with torch.no_grad():
        layer.weight.copy_(w)
    return layer


def median_time(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(label, dtype, quantised, ours, theirs, row_counts, layers, repeats, gen) -> list[dict]:  # type: ignore[no-untyped-def]
    """One weight kind's rows: Tandem's kernel and torch's on every matrix, interleaved, per row count."""
    out: list[dict] = []
    dense = [torch.randn(n, k, generator=gen) for _ in range(layers) for n, k in SHAPES]
    if quantised == 4:  # `Int4Linear`s in groups of 32, each op given the layer
        weights = [(Int4Linear.from_linear(_linear(w, dtype), 32),) for w in dense]
        nbytes = sum(m.nibbles.numel() + 2 * m.scales.numel() * m.scales.element_size() for (m,) in weights)
    elif quantised:  # (int8 weights, a scale per row in the activations' dtype) for the int8 ops
        weights = [(q, s.to(dtype)) for q, s in map(quantize_int8, dense)]
        nbytes = sum(q.numel() + s.numel() * s.element_size() for q, s in weights)
    else:
        weights = [w.to(dtype) for w in dense]
        nbytes = sum(w.numel() * w.element_size() for w in weights)
    params = sum(w.numel() for w in dense)
    for rows in row_counts:
        xs = {k: torch.randn(rows, k, generator=gen).to(dtype) for _, k in SHAPES}
        ts, tt = [], []
        for _ in range(3):  # interleaved rounds, so drift hits both alike
            ts.append(median_time(products(ours, xs, weights), repeats // 3))
            tt.append(median_time(products(theirs, xs, weights), repeats // 3))
        t_s, t_t = statistics.median(ts), statistics.median(tt)
        r = {"dtype": label, "rows": rows,
             "skinny_GBps": nbytes / t_s / 1e9, "skinny_GFLOPs": 2 * rows * params / t_s / 1e9,
             "torch_GBps": nbytes / t_t / 1e9, "torch_GFLOPs": 2 * rows * params / t_t / 1e9,
             "ratio": t_t / t_s}  # fmt: skip
        out.append(r)
        print(
            f"{label:14} {rows:>4} {r['skinny_GBps']:>11.1f} {r['skinny_GFLOPs']:>8.0f} "
            f"{r['torch_GBps']:>10.1f} {r['torch_GFLOPs']:>8.0f} {r['ratio']:>5.2f}x"
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    if not cpu_kernels.available():
        sys.exit("the CPU kernels could not be built (see the warning above)")
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    rows_out = []
    print(f"{'weights':14} {'rows':>4} {'Tandem GB/s':>11} {'GFLOP/s':>8} {'torch GB/s':>10} {'GFLOP/s':>8} ratio")
    int8 = torch.ops.tandem_cpu.skinny_linear_int8

    def int4_ours(x, m):  # type: ignore[no-untyped-def]
        return torch.ops.tandem_cpu.skinny_linear_int4(x, m.nibbles, m.scales_f32, m.minimums_f32, m.group_size)

    def int4_torch(x, m):  # type: ignore[no-untyped-def]
        return torch._weight_int4pack_mm_for_cpu(x, m.packed, m.group_size, m.scales_and_zeros)

    cases = [  # (label, activations' dtype, int8 weights, Tandem's op, torch's op, row counts)
        ("float32", torch.float32, False, torch.ops.tandem_cpu.skinny_linear, F.linear, ROWS),
        ("bfloat16", torch.bfloat16, False, torch.ops.tandem_cpu.skinny_linear, F.linear, ROWS),
        ("int8 float32", torch.float32, True, int8, torch._weight_int8pack_mm, INT8_ROWS),
        ("int8 bfloat16", torch.bfloat16, True, int8, torch._weight_int8pack_mm, INT8_ROWS),
        ("int4 float32", torch.float32, 4, int4_ours, int4_torch, INT8_ROWS),
        ("int4 bfloat16", torch.bfloat16, 4, int4_ours, int4_torch, INT8_ROWS),
    ]
    for label, dtype, quantised, ours, theirs, row_counts in cases:
        rows_out += measure(label, dtype, quantised, ours, theirs, row_counts, args.layers, args.repeats, gen)
    args.out.mkdir(parents=True, exist_ok=True)
    from cluster.cpu import cpu_kind, results_suffix

    meta = {"cpu": cpu_kind(), "layers": args.layers, "shapes": SHAPES, "threads": args.threads, "used_up_to": {
        str(k).removeprefix("torch."): v for k, v in cpu_kernels.SKINNY_ROWS.items()}}  # fmt: skip
    stem = args.out / ("skinny_linear" + results_suffix())  # each kind of CPU its own
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows_out}, indent=2))
    plot(rows_out, stem.with_suffix(".png"))
    print(f"wrote {stem}.json and .png")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    styles = (("float32", "--"), ("bfloat16", "-"), ("int8 float32", ":"), ("int8 bfloat16", "-."),
              ("int4 float32", (0, (1, 3))), ("int4 bfloat16", (0, (5, 2, 1, 2))))  # fmt: skip
    for dtype, style in styles:
        mine = [r for r in rows if r["dtype"] == dtype]
        xs = [r["rows"] for r in mine]
        axes[0].plot(xs, [r["skinny_GBps"] for r in mine], linestyle=style, marker="o", label=f"Tandem {dtype}")
        axes[0].plot(xs, [r["torch_GBps"] for r in mine], linestyle=style, marker="x", label=f"torch {dtype}")
        axes[1].plot(xs, [r["ratio"] for r in mine], linestyle=style, marker="o", label=dtype)
    axes[0].set(title="weight bytes read per second", xlabel="rows", ylabel="GB/s", xscale="log", xticks=ROWS)
    axes[1].set(title="Tandem's kernel's speed-up over torch's", xlabel="rows", xscale="log", xticks=ROWS)
    axes[1].axhline(1.0, color="grey", lw=0.8)
    for ax in axes:
        ax.set_xticklabels([str(r) for r in ROWS])
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
