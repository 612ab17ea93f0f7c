"""Decode attention: `tandem_cpu::decode_attention` against torch's scaled-dot-product attention over
the gathered blocks (the path a model takes without the kernels), side by side in one run, and the
cache bytes each reads per second against the machine's bandwidth probe.

    .venv/bin/python benchmarks/decode_attention.py [--threads 2] [--repeats 9]

SmolLM2-135M's heads (9 query heads over 3 KV heads of 64 dims), a paged cache of 16-token blocks
placed at random, one decode row per sequence: contexts of 512 to 8,192 positions at batch 1, and
512 at batches 8 and 32, in bfloat16 and float32. Each case holds 30 layers' caches, as a decode
step does, attended one after another, so each call finds its keys and values in memory, not in the
cache the call before warmed; the two paths alternate, and the median of each is taken. The roofline
column is the kernel's rate over the probe's: a decode step's attention can go no faster than
reading its cache once. Prints a table, writes `benchmarks/results/decode_attention{suffix}.{json,png}`
(`cluster.cpu.results_suffix()`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from decode_roofline_measure import measure_bandwidth  # noqa: E402

from cluster.cpu import cpu_kind, results_suffix  # noqa: E402
from cluster.model import cpu_kernels  # noqa: E402
from cluster.model.attention import SeqChunk, _attend_padded, build_attention_metadata  # noqa: E402

OUT = ROOT / "benchmarks" / "results"
HEADS, KV_HEADS, DIM, BLOCK, LAYERS, SCALE = 9, 3, 64, 16, 30, 0.125
CASES = [(1, 512), (1, 2048), (1, 8192), (8, 512), (32, 512)]  # (sequences, context)


def case(batch: int, context: int, dtype: torch.dtype, gen: torch.Generator):  # type: ignore[no-untyped-def]
    """30 layers' caches, each sequence's blocks at random places in them, and the calls of both paths."""
    per_seq = context // BLOCK
    num_blocks = batch * per_seq
    order = torch.randperm(num_blocks, generator=gen).tolist()
    chunks = [SeqChunk(order[s * per_seq : (s + 1) * per_seq], context - 1, 1) for s in range(batch)]
    (g,) = build_attention_metadata(chunks, BLOCK).groups
    shape = (num_blocks, BLOCK, KV_HEADS, DIM)
    layers = [tuple(torch.randn(shape, generator=gen).to(dtype) for _ in "kv") for _ in range(LAYERS)]
    q = torch.randn(batch, HEADS, DIM, generator=gen).to(dtype)
    mask = g.masks[None]

    def ours() -> None:
        for k, v in layers:
            torch.ops.tandem_cpu.decode_attention(q, k, v, g.block_tables, mask, SCALE)

    def theirs() -> None:
        for k, v in layers:
            _attend_padded(q, k, v, g.block_tables, g.query_index, mask, 1, SCALE)

    k, v = layers[0]
    got = torch.ops.tandem_cpu.decode_attention(q, k, v, g.block_tables, mask, SCALE).float()
    expected = _attend_padded(q.float(), k.float(), v.float(), g.block_tables, g.query_index, mask, 1, SCALE)
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)  # timing the right answer
    return ours, theirs, batch * context * KV_HEADS * DIM * 2 * layers[0][0].element_size()


def median_call_s(fns, repeats: int) -> list[float]:  # type: ignore[no-untyped-def]
    """Each function's median time a layer, the functions alternating."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            out.append((time.perf_counter() - start) / LAYERS)
    return [statistics.median(t) for t in times]


def report(dtype: str, batch: int, context: int, nbytes: int, mine: float, theirs: float, probe: float) -> dict:
    """One case's row, printed."""
    row = {"dtype": dtype, "seqs": batch, "context": context, "bytes": nbytes, "tandem_us": mine * 1e6,
           "torch_us": theirs * 1e6, "tandem_GBps": nbytes / mine / 1e9, "torch_GBps": nbytes / theirs / 1e9,
           "ratio": theirs / mine, "roofline": nbytes / mine / probe}  # fmt: skip
    print(
        f"{dtype:9} {batch:>4} {context:>7} {row['tandem_us']:>9.1f} {row['tandem_GBps']:>5.1f} "
        f"{row['torch_us']:>8.1f} {row['torch_GBps']:>5.1f} {row['ratio']:>5.2f} {row['roofline']:>7.0%}"
    )
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    if not cpu_kernels.available():
        sys.exit("the CPU kernels could not be built (see the warning above)")
    torch.set_num_threads(args.threads)
    probe = measure_bandwidth("cpu")
    print(f"{cpu_kind()}, kernels {cpu_kernels.variant()}, {args.threads} threads, probe {probe / 1e9:.1f} GB/s")
    head = f"{'dtype':9} {'seqs':>4} {'context':>7} {'Tandem us':>9} {'GB/s':>5} {'torch us':>8} {'GB/s':>5}"
    print(head, "ratio roofline")
    gen = torch.Generator().manual_seed(0)
    rows = []
    with torch.inference_mode():
        for dtype in (torch.bfloat16, torch.float32):
            for batch, context in CASES:
                ours, theirs, nbytes = case(batch, context, dtype, gen)
                median_call_s([ours, theirs], 1)  # warm up both
                mine, torch_s = median_call_s([ours, theirs], args.repeats)
                rows.append(report(str(dtype).removeprefix("torch."), batch, context, nbytes, mine, torch_s, probe))
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"cpu": cpu_kind(), "kernels": cpu_kernels.variant(), "threads": args.threads, "probe_GBps": probe / 1e9,
            "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": DIM, "block": BLOCK, "layers": LAYERS}  # fmt: skip
    stem = args.out / ("decode_attention" + results_suffix())
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    plot(rows, stem.with_suffix(".png"))
    print(f"wrote {stem}.json and .png")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    labels = [f"{r['seqs']}x{r['context']}" for r in rows if r["dtype"] == "bfloat16"]
    for dtype, style in (("bfloat16", "-"), ("float32", "--")):
        mine = [r for r in rows if r["dtype"] == dtype]
        axes[0].plot(labels, [r["tandem_GBps"] for r in mine], linestyle=style, marker="o", label=f"Tandem {dtype}")
        axes[0].plot(labels, [r["torch_GBps"] for r in mine], linestyle=style, marker="x", label=f"torch {dtype}")
        axes[1].plot(labels, [r["roofline"] for r in mine], linestyle=style, marker="o", label=dtype)
    axes[0].set(title="cache bytes read per second", xlabel="sequences x context", ylabel="GB/s")
    axes[1].set(title="Tandem's kernel against the bandwidth probe", xlabel="sequences x context", ylabel="fraction")
    for ax in axes:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
